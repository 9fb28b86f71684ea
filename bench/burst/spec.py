"""What the burst is made of: toolkits, workspaces, environments, the task, and the run sizes.

Everything here is data; nothing does I/O. Versions are pinned so that two runs of the benchmark build
the same layers (the base follows the machine's apt sources, which is the one moving part).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

BASE_SUITE = "bookworm"
BASE_INCLUDE = ("python3",)

# Inside every sandbox: the toolkit is a venv at this path (its python is the base's /usr/bin/python3.11),
# and the workspace layer holds the project tree and the task script under /workspace.
TOOLKIT_ROOT = "/opt/toolkit"
WORKSPACE_ROOT = "/workspace"
TASK_PATH = f"{WORKSPACE_ROOT}/burst_task.py"
START_MARK = "BURST-START"
RESULT_MARK = "BURST-RESULT"


@dataclass(frozen=True)
class Toolkit:
    name: str
    requirements: tuple[str, ...]  # every distribution pinned, transitive ones included

    def key(self) -> str:
        return input_key(asdict(self))


@dataclass(frozen=True)
class Workspace:
    name: str
    sdist: str  # a PyPI requirement `name==version`, downloaded as an sdist
    tree: str  # the directory the sdist unpacks to
    pythonpath: str  # relative to the tree
    test: str  # a pytest node id or file, relative to the tree
    test_args: tuple[str, ...] = ()

    def key(self) -> str:
        return input_key(asdict(self))


@dataclass(frozen=True)
class Environment:
    name: str
    toolkit: str
    workspace: str
    imports: tuple[str, ...]  # toolkit modules the task imports


TOOLKITS: dict[str, Toolkit] = {
    t.name: t
    for t in (
        Toolkit("sci", (
            "numpy==2.4.6", "pandas==3.1.1", "pytest==9.2.0", "rich==15.0.0", "requests==2.34.2",
            "PyYAML==6.0.4", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "idna==3.20",
            "iniconfig==2.3.1", "markdown-it-py==4.3.0", "packaging==26.4", "pluggy==1.7.0",
            "Pygments==2.21.0", "python-dateutil==2.9.0.post0", "six==1.17.0", "urllib3==2.8.0",
            "mdurl==0.1.2", "tzdata==2026.6",
        )),
        Toolkit("web", (
            "Jinja2==3.1.6", "MarkupSafe==3.0.4", "pydantic==2.14.4", "pydantic_core==2.50.5",
            "requests==2.34.2", "rich==15.0.0", "pytest==9.2.0", "click==8.5.1", "PyYAML==6.0.4",
            "annotated-types==0.8.0", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
            "idna==3.20", "iniconfig==2.3.1", "markdown-it-py==4.3.0", "packaging==26.4", "pluggy==1.7.0",
            "Pygments==2.21.0", "typing_extensions==4.16.0", "typing-inspection==0.4.5", "urllib3==2.8.0",
            "mdurl==0.1.2",
        )),
    )
}

WORKSPACES: dict[str, Workspace] = {
    w.name: w
    for w in (
        Workspace("networkx", "networkx==3.5", "networkx-3.5", ".",
                  "networkx/algorithms/tests/test_cycles.py"),
        Workspace("jinja2", "jinja2==3.1.6", "jinja2-3.1.6", "src", "tests/test_lexnparse.py"),
        Workspace("more-itertools", "more-itertools==11.2.1", "more_itertools-11.2.1", ".",
                  "tests/test_more.py", ("-k", "Chunked or Windowed or Distinct or Interleave")),
        Workspace("toolz", "toolz==1.2.0", "toolz-1.2.0", ".", "toolz/tests/test_itertoolz.py"),
    )
}

ENVIRONMENTS: dict[str, Environment] = {
    e.name: e
    for e in (
        Environment("sci-networkx", "sci", "networkx", ("numpy", "pandas", "yaml", "rich.console")),
        Environment("web-jinja2", "web", "jinja2", ("pydantic", "requests", "rich.console", "click", "yaml")),
        Environment("sci-moreitertools", "sci", "more-itertools", ("numpy", "pandas", "requests", "rich.table")),
        Environment("web-toolz", "web", "toolz", ("pydantic", "jinja2", "requests", "rich.progress")),
    )
}


LAYERSTORE_CONTENDERS = ("lazy", "lazy-prefetch", "lazy-noreadahead", "eager", "lazy-cli")
# containerd itself pulling from a registry behind the same link: its own overlayfs snapshotter, and the
# layerstore snapshotter (bench/burst/ctrnode.py)
CONTAINERD_CONTENDERS = ("containerd-overlayfs", "containerd-layerstore")
# Kubernetes' pull path: containerd's CRI plugin with either snapshotter, driven over the CRI API
# (bench/burst/crinode.py)
CRI_CONTENDERS = ("cri-overlayfs", "cri-layerstore")
# Extra `layerctl daemon` arguments per contender (what-if variants of the lazy path).
DAEMON_ARGS = {"lazy-noreadahead": ("--readahead", "0")}


@dataclass(frozen=True)
class Size:
    name: str
    sandboxes: int
    environments: tuple[str, ...]
    rounds: int = 2
    rate_mbit: int = 1000
    contenders: tuple[str, ...] = ("conventional", "lazy", "lazy-prefetch", "lazy-noreadahead", "eager",
                                   *CONTAINERD_CONTENDERS, *CRI_CONTENDERS)


SIZES: dict[str, Size] = {
    # quick: one round of the two paths the burst compares (each contender costs ~25-45 s, and the
    # prefetch and containerd ones a set-up of their own), so that `make bench SIZE=quick` (every
    # benchmark) stays under ~10 minutes on a shared machine; the report's quick section is `--size quick
    # --rounds 2 --contenders conventional,lazy,lazy-prefetch,eager,containerd-overlayfs,containerd-layerstore`
    "quick": Size("quick", 16, ("sci-networkx", "web-jinja2", "sci-moreitertools"), rounds=1,
                  contenders=("conventional", "lazy")),
    "full": Size("full", 64, tuple(ENVIRONMENTS)),
}


# The tiny environment (smoke tests of the benchmark's plumbing): a busybox base, a few files as the
# toolkit and the workspace, a shell task. Kept apart from ENVIRONMENTS (the measured workloads).
TINY = Environment("tiny", "tiny", "tiny", ())


def environment(name: str) -> Environment:
    """A measured environment, or the tiny one."""
    return TINY if name == TINY.name else ENVIRONMENTS[name]


MAX_NODES = 200  # node i is 198.19.<run>.(10 + i) on the cluster link


@dataclass(frozen=True)
class Shape:
    """One burst at cluster shape: `nodes` nodes with `per_node` sandboxes each, all reading one store
    through one link of `rate_mbit`."""

    nodes: int
    per_node: int
    rate_mbit: float = 1000

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node}@{self.rate_mbit:g}"

    @classmethod
    def parse(cls, text: str, per_node: int, rates: tuple[float, ...]) -> list[Shape]:
        """`4`, `4x4`, `16x4,8x16` (per node, if not given, from `per_node`), each at every rate."""
        out = []
        for part in (t.strip() for t in text.split(",") if t.strip()):
            n, _, m = part.partition("x")
            nodes, each = int(n), int(m) if m else per_node
            if not (1 <= nodes <= MAX_NODES and each >= 1):
                raise ValueError(f"bad shape {part!r}: 1-{MAX_NODES} nodes, >= 1 sandbox per node")
            out += [cls(nodes, each, r) for r in rates]
        return out


# Sizes at cluster shape (issue 19): quick 4 nodes x 4 sandboxes; full 16x4 and 8x16 at 1 Gbit/s and
# at 250 Mbit/s for the shared link; tiny: the smoke test's.
NODE_SIZES: dict[str, tuple[Shape, ...]] = {
    "quick": (Shape(4, 4, 1000),),
    "full": (Shape(16, 4, 1000), Shape(8, 16, 1000), Shape(16, 4, 250), Shape(8, 16, 250)),
    "tiny": (Shape(2, 2, 1000),),
}
NODE_CONTENDERS = ("conventional", "lazy")


@dataclass
class Plan:
    """One burst: which environment each sandbox runs, in launch order (round robin)."""

    sandboxes: list[str] = field(default_factory=list)

    @classmethod
    def round_robin(cls, environments: tuple[str, ...] | list[str], n: int) -> Plan:
        return cls([environments[i % len(environments)] for i in range(n)])

    def spread(self, nodes: int) -> list[list[str]]:
        """Sandbox j on node j % nodes: every node gets a mix of the environments."""
        return [self.sandboxes[k::nodes] for k in range(nodes)]


def task_command(env: Environment) -> list[str]:
    """The command each sandbox runs. The shell's `date` is the start mark: the first thing the
    sandbox executes, before Python is even loaded."""
    if env.name == TINY.name:  # busybox: `date` has no %N; the smoke test checks plumbing, not times
        return ["/bin/sh", "-c", f'echo "{START_MARK} $(date +%s)"; cat {TOOLKIT_ROOT}/data/* '
                f"{WORKSPACE_ROOT}/data/* | md5sum && echo '{RESULT_MARK} {{\"rc\": 0}}'"]
    ws = WORKSPACES[env.workspace]
    tree = f"{WORKSPACE_ROOT}/{ws.tree}"
    pythonpath = tree if ws.pythonpath == "." else f"{tree}/{ws.pythonpath}"
    args = json.dumps([ws.test, *ws.test_args])
    script = (
        f'echo "{START_MARK} $(date +%s.%N)"; cd {tree} && exec env HOME=/root PYTHONPATH={pythonpath} '
        f"BURST_IMPORTS={','.join(env.imports)} BURST_TREE={tree} BURST_TEST_ARGS='{args}' "
        f"{TOOLKIT_ROOT}/bin/python {TASK_PATH}"
    )
    return ["/bin/sh", "-c", script]


# The task, written into every workspace layer as /workspace/burst_task.py: it touches the three layers
# (the base's interpreter and stdlib, the toolkit's packages, the workspace's tree) and runs a real test.
TASK_SCRIPT = f'''\
"""Benchmark task: import toolkit packages, read the workspace sources, run one test file."""
import hashlib
import importlib
import json
import os
import sys
import time

t0 = time.time()
for name in os.environ["BURST_IMPORTS"].split(","):
    importlib.import_module(name)
t_imports = time.time()
files = nbytes = 0
digest = hashlib.sha256()
for root, dirs, names in os.walk(os.environ["BURST_TREE"]):
    dirs.sort()
    for n in sorted(names):
        if n.endswith((".py", ".txt", ".rst", ".toml", ".cfg", ".md")):
            with open(os.path.join(root, n), "rb") as f:
                data = f.read()
            digest.update(data)
            files += 1
            nbytes += len(data)
t_read = time.time()
import pytest

rc = int(pytest.main(["-q", "-p", "no:cacheprovider", *json.loads(os.environ["BURST_TEST_ARGS"])]))
t_end = time.time()
print("{RESULT_MARK} " + json.dumps({{"rc": rc, "files": files, "bytes": nbytes, "imports_s": t_imports - t0,
      "read_s": t_read - t_imports, "test_s": t_end - t_read, "end": t_end}}), flush=True)
sys.exit(rc)
'''


def input_key(obj: object) -> str:
    """The cache key of a benchmark input: a short hash of the facts it is built from."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]
