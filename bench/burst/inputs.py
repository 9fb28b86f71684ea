"""The burst's real inputs, built once and cached under bench/.cache/inputs/.

- base: a Debian userland from `mmdebstrap --variant=minbase --include=python3` (no mirror argument, so it
  reads the machine's apt sources), as the tar mmdebstrap writes;
- toolkits: Python venvs built with the machine's Debian python3.11 (the base's interpreter), every
  distribution pinned, installed from the machine's configured package index, relocated to /opt/toolkit
  (shebangs, pyvenv.cfg, bytecode paths);
- workspaces: sdists of real projects from PyPI, unpacked under /workspace, plus the task script.

Every layer ends up as one `.tar.gz` (the conventional path's format; the layerstore builder reads the
same file), with a small JSON of facts beside it. A cache entry is named by a hash of its spec, built in
a temporary directory and renamed into place, so an interrupted build is never mistaken for a cached one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from . import spec

DEBIAN_PYTHON = "/usr/bin/python3.11"


def cache_root() -> Path:
    env = os.environ.get("LAYERSTORE_BENCH_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".cache"


def run_root() -> Path:
    """Where a run keeps its live state: the node disk's image and mount, the store's daemons, state
    files for crash clean-up. Outside the work tree on purpose: tools that walk the tree (linters, git,
    a test's copy of the repo) must not wander into a node's FUSE and EROFS mounts mid-run."""
    env = os.environ.get("LAYERSTORE_BENCH_RUN_DIR")
    return Path(env) if env else Path("/var/tmp/layerstore-bench-burst")


@dataclass
class Layer:
    name: str  # e.g. "base", "toolkit-sci", "workspace-jinja2"
    role: str  # base | toolkit | workspace
    tar_gz: Path
    facts: dict[str, int]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "tar_gz": self.tar_gz.name, **self.facts}  # (no machine path)


def log(msg: str) -> None:
    print(f"burst: {msg}", file=sys.stderr, flush=True)


def ensure_debs(packages: list[str]) -> None:
    """Install Debian packages the benchmark needs (not `make test`), only if missing."""
    missing = [p for p in packages if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True).stdout.find("ok installed") < 0]
    if not missing:
        return
    log(f"installing {' '.join(missing)} (apt, the machine's sources)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def _tar_gz(tree: Path, out: Path) -> None:
    # Sorted names, root owners: the same tree always gives the same archive listing.
    subprocess.run(["tar", "--sort=name", "--numeric-owner", "--owner=0", "--group=0", "-C", str(tree),
                    "-czf", str(out), "."], check=True)


def _facts_of_tar(path: Path) -> dict[str, int]:
    files = total = 0
    with tarfile.open(path, "r:*") as tf:
        for m in tf:
            if m.isfile():
                files += 1
                total += m.size
    return {"files": files, "content_bytes": total, "tar_gz_bytes": path.stat().st_size}


def _publish(tmp_out: Path, out: Path) -> dict[str, int]:
    facts = _facts_of_tar(tmp_out)
    out.with_suffix(".json").write_text(json.dumps(facts) + "\n")
    os.replace(tmp_out, out)
    return facts


def _cached(out: Path) -> dict[str, int] | None:
    meta = out.with_suffix(".json")
    if out.exists() and meta.exists():
        return dict(json.loads(meta.read_text()))
    return None


def minbase_tar() -> Path:
    """`mmdebstrap --variant=minbase bookworm` as a plain tar: the one the tests cache
    (tests/runtime_shim/test_shim_debian.py: $XDG_CACHE_HOME/layerstore/tests/, built under the same
    lock file), shared by the build and VM benchmarks, so that a machine builds it once for all of them
    (~15-30 s from the machine's apt sources)."""
    d = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "layerstore" / "tests"
    d.mkdir(parents=True, exist_ok=True)
    tar = d / "debian-bookworm-minbase.tar"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tar.is_file() and tar.stat().st_size):
            ensure_debs(["mmdebstrap"])
            log("building the Debian minbase tar with mmdebstrap (once; shared with the tests)")
            part = d / "debian-bookworm-minbase.part"
            # --format: mmdebstrap picks the format from the output name otherwise, and ".part" is none
            subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", "bookworm", str(part)],
                           check=True)
            os.replace(part, tar)
    return tar


def base_key() -> str:
    """The base layer's cache key: a hash of what it is built from, as for every other input."""
    return spec.input_key({"suite": spec.BASE_SUITE, "include": spec.BASE_INCLUDE, "variant": "minbase"})


def build_base(root: Path) -> Layer:
    key = base_key()
    out = root / f"base-{spec.BASE_SUITE}-{key}.tar.gz"
    facts = _cached(out)
    if facts is None:
        ensure_debs(["mmdebstrap"])
        log(f"building the base layer with mmdebstrap ({spec.BASE_SUITE}, minbase + python3)")
        raw = root / f".base-{key}.tar"
        tmp = root / f".base-{key}.tar.gz.tmp"
        with contextlib.suppress(FileNotFoundError):
            raw.unlink()
        # No mirror argument: mmdebstrap reads the machine's apt sources.
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(spec.BASE_INCLUDE)}",
                        spec.BASE_SUITE, str(raw)], check=True)
        with open(tmp, "wb") as f:
            subprocess.run(["gzip", "-6", "-c", str(raw)], stdout=f, check=True)
        raw.unlink()
        facts = _publish(tmp, out)
    return Layer("base", "base", out, facts)


def build_toolkit(root: Path, tk: spec.Toolkit) -> Layer:
    out = root / f"toolkit-{tk.name}-{tk.key()}.tar.gz"
    facts = _cached(out)
    if facts is None:
        log(f"building toolkit {tk.name}: a venv with {len(tk.requirements)} pinned distributions")
        work = root / f".toolkit-{tk.name}.build"
        shutil.rmtree(work, ignore_errors=True)
        venv = work / "tree" / spec.TOOLKIT_ROOT.lstrip("/")
        subprocess.run([DEBIAN_PYTHON, "-m", "venv", str(venv)], check=True)
        pip_cache = cache_root() / "pip"
        subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--only-binary", ":all:", "--no-compile", "--cache-dir", str(pip_cache),
                        *tk.requirements], check=True)
        _relocate_venv(venv, spec.TOOLKIT_ROOT)
        tmp = root / f".toolkit-{tk.name}.tar.gz.tmp"
        _tar_gz(work / "tree", tmp)
        facts = _publish(tmp, out)
        shutil.rmtree(work, ignore_errors=True)
    return Layer(f"toolkit-{tk.name}", "toolkit", out, facts)


def _relocate_venv(venv: Path, target: str) -> None:
    """Make a venv built at `venv` correct at `target` inside the sandbox."""
    here = str(venv)
    for p in (venv / "bin").iterdir():
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            if data.startswith(b"#!") and here.encode() in data.split(b"\n", 1)[0]:
                first, rest = data.split(b"\n", 1)
                p.write_bytes(first.replace(here.encode(), target.encode()) + b"\n" + rest)
            elif p.suffix in ("", ".sh", ".csh", ".fish") and here.encode() in data:
                p.write_bytes(data.replace(here.encode(), target.encode()))
    cfg = venv / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(here, target))
    # Unchecked-hash bytecode does not depend on mtimes (which a layer build may clamp), so the sandbox
    # never recompiles; the recorded source paths are the in-sandbox ones.
    lib = venv / "lib"
    subprocess.run([DEBIAN_PYTHON, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash",
                    "-s", here, "-p", target, str(lib)], check=False, stdout=subprocess.DEVNULL)


def build_workspace(root: Path, ws: spec.Workspace) -> Layer:
    out = root / f"workspace-{ws.name}-{ws.key()}.tar.gz"
    facts = _cached(out)
    if facts is None:
        log(f"building workspace {ws.name} from the sdist {ws.sdist}")
        sdists = cache_root() / "sdists"
        sdists.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", "-d", str(sdists), ws.sdist], check=True)
        name, version = ws.sdist.split("==")
        norm = name.replace("-", "_").lower()
        candidates = [p for p in sdists.iterdir() if p.name.lower().startswith(f"{norm}-{version}".lower())
                      and p.name.endswith((".tar.gz", ".zip"))]
        if not candidates:
            raise RuntimeError(f"sdist of {ws.sdist} not found in {sdists}")
        work = root / f".workspace-{ws.name}.build"
        shutil.rmtree(work, ignore_errors=True)
        tree = work / "tree" / spec.WORKSPACE_ROOT.lstrip("/")
        tree.mkdir(parents=True)
        shutil.unpack_archive(candidates[0], tree)
        if not (tree / ws.tree).is_dir():
            raise RuntimeError(f"{candidates[0].name} did not unpack to {ws.tree}")
        (tree / Path(spec.TASK_PATH).name).write_text(spec.TASK_SCRIPT)
        tmp = root / f".workspace-{ws.name}.tar.gz.tmp"
        _tar_gz(work / "tree", tmp)
        facts = _publish(tmp, out)
        shutil.rmtree(work, ignore_errors=True)
    return Layer(f"workspace-{ws.name}", "workspace", out, facts)


BUSYBOX = "/bin/busybox"


def build_tiny(root: Path) -> dict[str, Layer]:
    """The tiny environment's three layers (smoke tests): a busybox base (the static busybox and its
    applet links), and a toolkit and a workspace of a few small files each. Built in a second."""
    out = {}
    busybox = Path(BUSYBOX).resolve()
    key = spec.input_key({"tiny": 1, "busybox": busybox.stat().st_size})
    for name, role in (("base-tiny", "base"), ("toolkit-tiny", "toolkit"), ("workspace-tiny", "workspace")):
        path = root / f"{name}-{key}.tar.gz"
        facts = _cached(path)
        if facts is None:
            work = root / f".{name}.build"
            shutil.rmtree(work, ignore_errors=True)
            tree = work / "tree"
            if role == "base":
                for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root"):
                    (tree / d).mkdir(parents=True)
                shutil.copy2(busybox, tree / "bin" / "busybox")
                applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                                         check=True).stdout.split()
                for a in applets:
                    if a != "busybox":
                        (tree / "bin" / a).symlink_to("busybox")
                (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
            else:
                data = tree / (spec.TOOLKIT_ROOT if role == "toolkit" else spec.WORKSPACE_ROOT).lstrip("/") / "data"
                data.mkdir(parents=True)
                for i in range(8):
                    (data / f"f{i}.txt").write_text(f"{name} {i}\n" * (512 * (i + 1)))
            tmp = root / f".{name}.tar.gz.tmp"
            _tar_gz(tree, tmp)
            facts = _publish(tmp, path)
            shutil.rmtree(work, ignore_errors=True)
        out[name] = Layer(name, role, path, facts)
    return out


def build_all(environments: list[str] | tuple[str, ...]) -> dict[str, Layer]:
    """Every layer the given environments need, by layer name."""
    root = cache_root() / "inputs"
    root.mkdir(parents=True, exist_ok=True)
    if tuple(environments) == (spec.TINY.name,):
        tiny = build_tiny(root)
        base = tiny["base-tiny"]
        return {"base": Layer("base", "base", base.tar_gz, base.facts), "toolkit-tiny": tiny["toolkit-tiny"],
                "workspace-tiny": tiny["workspace-tiny"]}
    layers = {"base": build_base(root)}
    for e in environments:
        env = spec.ENVIRONMENTS[e]
        tk, ws = spec.TOOLKITS[env.toolkit], spec.WORKSPACES[env.workspace]
        if f"toolkit-{tk.name}" not in layers:
            layers[f"toolkit-{tk.name}"] = build_toolkit(root, tk)
        if f"workspace-{ws.name}" not in layers:
            layers[f"workspace-{ws.name}"] = build_workspace(root, ws)
    return layers


def env_layers(env_name: str) -> list[str]:
    """Layer names of an environment, bottom first."""
    env = spec.environment(env_name)
    return ["base", f"toolkit-{env.toolkit}", f"workspace-{env.workspace}"]


if __name__ == "__main__":
    built = build_all(list(spec.ENVIRONMENTS))
    print(json.dumps({k: v.to_json() for k, v in built.items()}, indent=2))
