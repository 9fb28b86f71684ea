"""The shape of the house, checked by walking the code (no imports executed):

- the import graph of the project's modules has no circles (every import counts, also the ones
  inside functions and under TYPE_CHECKING: a lazy import is still a dependency);
- between top-level packages, imports flow one way: a package imports only what `ALLOWED` lists
  for it (the tiers below, plus the few sideways imports named with their reason);
- no private name (`_name`) is used outside the module that defines it: neither imported from
  another module nor reached as an attribute of an object of another module's making.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (gc/ is imported as layergc: CPython's gc always wins)
PACKAGES = {"layerstore": "layerstore", "manifest": "manifest", "erofs_builder": "erofs_builder",
            "fuse_client": "fuse_client", "runtime_shim": "runtime_shim", "layerctl": "layerctl",
            "layergc": "gc", "service": "service", "snapshotter": "snapshotter"}
# Also walked for private use (they import the packages, nothing imports them).
EXTRA = {"bench": "bench"}


def _modules(names: dict[str, str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name, folder in names.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            if ".cache" in path.parts or "results" in path.parts or path.stem.endswith(("_pb2", "_pb2_grpc")):
                continue  # caches, results and generated gRPC stubs are not the house
            rel = path.relative_to(base).with_suffix("")
            parts = [name, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules(PACKAGES)
ALL = {**MODULES, **_modules(EXTRA)}


def _is_package(mod: str) -> bool:
    return ALL[mod].name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _project(name: str) -> str | None:
    """The project module that `name` (a dotted import) lands in, or None."""
    while name:
        if name in ALL:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, tree: ast.AST) -> dict[str, set[str]]:
    """Project modules this module imports -> the names it takes from each ("" = the module)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _project(a.name)
                if target is not None:
                    out.setdefault(target, set()).add("")
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in ALL:  # `from pkg import module`
                    out.setdefault(sub, set()).add("")
                    continue
                target = _project(src)
                if target is not None:
                    out.setdefault(target, set()).add(a.name)
    return out


TREES = {mod: ast.parse(path.read_text(), str(path)) for mod, path in ALL.items()}
GRAPH = {mod: _imports(mod, TREES[mod]) for mod in ALL}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# The house's tiers, bottom to top: a package may import any package of a lower tier; within a
# tier only what SIDEWAYS names. (README's architecture diagram draws the same order.)
TIERS = [
    ["layerstore"],
    ["manifest", "erofs_builder"],
    ["fuse_client", "layergc"],
    ["runtime_shim", "service", "snapshotter"],
    ["layerctl"],
]
SIDEWAYS = {
    ("erofs_builder", "manifest"): "an image's runtime config becomes an environment's (image_config, image_env)",
    ("snapshotter", "runtime_shim"): "the snapshotter mounts layers through the shim's shared blob mounts",
}
ALLOWED: dict[str, set[str]] = {
    pkg: {low for below in TIERS[:i] for low in below} | {b for (a, b) in SIDEWAYS if a == pkg}
    for i, tier in enumerate(TIERS) for pkg in tier
}


def _top(mod: str) -> str:
    return mod.partition(".")[0]


def upward_imports(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Imports between top-level packages that ALLOWED does not list, as `module -> module`."""
    return sorted(f"{m} -> {t}" for m, deps in graph.items() for t in deps
                  if _top(t) != _top(m) and _top(t) not in ALLOWED[_top(m)])


def test_the_tiers_name_every_package_once() -> None:
    named = [pkg for tier in TIERS for pkg in tier]
    assert sorted(named) == sorted(PACKAGES) and len(set(named)) == len(named)


def test_imports_between_packages_flow_one_way() -> None:
    graph = {m: {t: n for t, n in deps.items() if t in MODULES} for m, deps in GRAPH.items() if m in MODULES}
    assert upward_imports(graph) == []


def test_every_sideways_import_is_still_used() -> None:
    used = {(_top(m), _top(t)) for m, deps in GRAPH.items() if m in MODULES for t in deps if t in MODULES}
    assert set(SIDEWAYS) <= used, "a sideways import listed in SIDEWAYS is gone: drop it from the table"


def test_an_upward_or_unlisted_sideways_import_is_caught() -> None:
    graph = {"layerstore.store": {"layerctl.main": {"main"}},  # up
             "manifest.environment": {"erofs_builder.tree": {""}},  # sideways, not listed
             "fuse_client.daemon": {"erofs_builder.build": {""}, "fuse_client.fuse.mount": {""}},  # down; own package
             "erofs_builder.image_env": {"manifest.environment": {""}}}  # sideways, listed
    assert upward_imports(graph) == ["layerstore.store -> layerctl.main", "manifest.environment -> erofs_builder.tree"]


# runtime_shim's sub-packages, bottom to top (docs/runtime-shim.md, "Modules (one concern each)"):
# the same rule one level down. `errors` is the shim's error family; `nodestate` the node's records
# on disk; `resolve` manifests and trust; `supervise` the node daemon; `vm` guest kits and VMMs;
# `backends` container, microVM and VM; `node` layer mounts, overlays and recovery; `sandbox` runs.
SHIM_TIERS = [
    ["errors"],
    ["resolve", "nodestate"],
    ["supervise", "vm"],
    ["backends"],
    ["node"],
    ["sandbox"],
    ["mount_helper"],
]
SHIM_ALLOWED: dict[str, set[str]] = {
    part: {low for below in SHIM_TIERS[:i] for low in below} for i, tier in enumerate(SHIM_TIERS) for part in tier
}


def _shim_part(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else ""


def shim_wrong_way_imports(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Imports between runtime_shim's sub-packages that SHIM_ALLOWED does not list."""
    return sorted(f"{m} -> {t}" for m, deps in graph.items() if _top(m) == "runtime_shim" and _shim_part(m)
                  for t in deps if _top(t) == "runtime_shim" and _shim_part(t)
                  and _shim_part(t) != _shim_part(m) and _shim_part(t) not in SHIM_ALLOWED[_shim_part(m)])


def test_the_shim_tiers_name_every_sub_package_once() -> None:
    parts = {_shim_part(m) for m in MODULES if _top(m) == "runtime_shim"} - {""}
    named = [part for tier in SHIM_TIERS for part in tier]
    assert sorted(named) == sorted(parts) and len(set(named)) == len(named)


def test_imports_between_shim_sub_packages_flow_one_way() -> None:
    graph = {m: {t: n for t, n in deps.items() if t in MODULES} for m, deps in GRAPH.items() if m in MODULES}
    assert shim_wrong_way_imports(graph) == []


def test_a_wrong_way_shim_import_is_caught() -> None:
    graph = {"runtime_shim.nodestate.state": {"runtime_shim.node.shim": {""}},  # up
             "runtime_shim.vm.qemu": {"runtime_shim.supervise.daemon": {""}},  # sideways
             "runtime_shim.node.shim": {"runtime_shim.backends.base": {""}, "runtime_shim.node.layers": {""}}}  # down
    assert shim_wrong_way_imports(graph) == ["runtime_shim.nodestate.state -> runtime_shim.node.shim",
                                             "runtime_shim.vm.qemu -> runtime_shim.supervise.daemon"]


def test_import_graph_has_no_circles() -> None:
    # A package's __init__ importing its own modules is not a circle of the house: drop the
    # edge module -> its package __init__ when the package is only a namespace for it.
    graph = {m: {t for t in deps if t in MODULES and t != m} for m, deps in GRAPH.items() if m in MODULES}
    assert _cycles(graph) == []


# Standard-library names that are public despite their underscore.
STDLIB_PUBLIC = {("os", "_exit"), ("sys", "_getframe")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assignments, attributes set on any
    object, slots and keyword arguments of its own making."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
            names.add(node.value)  # __slots__ entries, getattr names
    return names


def private_uses() -> list[str]:
    found: list[str] = []
    for mod, tree in TREES.items():
        for target, names in GRAPH[mod].items():
            for n in sorted(names):
                if _private(n) and target != mod:
                    found.append(f"{mod} imports {target}.{n}")
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if isinstance(v, ast.Name) and (v.id, node.attr) in STDLIB_PUBLIC:
                continue
            if node.attr in own:
                continue  # an object of this module's own making
            found.append(f"{mod}:{node.lineno} reaches .{node.attr}")
    return found


def test_no_private_name_used_outside_its_module() -> None:
    assert private_uses() == []


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_parses(mod: str) -> None:
    assert TREES[mod] is not None


# -- one libc loader (issue 29) ----------------------------------------------------------------------
LIBC_HOME = "layerstore.linux.libc"
# ctypes' ways to load a shared library (and to find one by name): whoever names one loads libc itself
_LOADERS = {"CDLL", "PyDLL", "cdll", "pydll", "LibraryLoader", "LoadLibrary", "find_library"}


def libc_loaders() -> dict[str, list[int]]:
    """Module -> the lines that name a ctypes library loader (a call, an attribute, an import of
    one). bench/ and tests/ are not walked (they may load what they measure with)."""
    found: dict[str, list[int]] = {}
    for mod in MODULES:
        for node in ast.walk(TREES[mod]):
            named = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                     else None)
            imported = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ctypes") and any(
                a.name in _LOADERS or a.name == "*" for a in node.names)
            if named in _LOADERS or imported:
                found.setdefault(mod, []).append(node.lineno)
    return found


def test_one_module_loads_libc() -> None:
    """Every Linux call goes through layerstore.linux, whose `libc` module is the one loader."""
    loaders = libc_loaders()
    assert sorted(loaders) == [LIBC_HOME], {m: lines for m, lines in loaders.items() if m != LIBC_HOME}


# -- sizes a newcomer can read (issue 29) ---------------------------------------------------------
MAX_FUNCTION_LINES = 120


def long_functions(modules: dict[str, Path], limit: int) -> list[str]:
    """Every function (methods and nested ones too) of these modules longer than `limit` lines."""
    out = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{mod}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_product_function_is_longer_than_120_lines() -> None:
    assert long_functions(MODULES, MAX_FUNCTION_LINES) == []


def test_a_long_function_is_caught(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions({"m": tmp_path / "m.py"}, MAX_FUNCTION_LINES) == [f"m:5 long: {MAX_FUNCTION_LINES + 1} lines"]


MAX_NOTE_LINES = 450


def test_no_design_note_is_longer_than_450_lines() -> None:
    """A note in docs/ is read in about ten minutes; longer write-ups become pages of their own."""
    long = [f"{p.name}: {n}" for p in sorted((ROOT / "docs").glob("*.md"))
            if (n := len(p.read_text().splitlines())) > MAX_NOTE_LINES]
    assert long == []
