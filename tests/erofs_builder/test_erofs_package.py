"""The shape of erofs_builder, checked by walking its code (nothing imported):

- one EROFS reader: the on-disk structures (format.py) are unpacked in `erofs/read.py` only, so
  the superblock, inodes, xattrs and directory entries are parsed in one place whoever reads an
  image (flattening, a parent build, the benchmarks);
- the format code apart from the image sources: `erofs_builder.erofs` (format, writer, reader)
  imports no source, and the sources (`erofs_builder.sources`) import no format code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ["erofs_builder", "runtime_shim", "fuse_client", "layerctl", "snapshotter", "service", "manifest", "gc",
        "layerstore", "bench"]
STRUCTS = {"SUPERBLOCK", "COMPACT_INODE", "EXTENDED_INODE", "DIRENT", "XATTR_ENTRY", "CHUNK_INDEX"}
UNPACK = {"unpack", "unpack_from", "iter_unpack"}


def _files(*folders: str) -> list[Path]:
    out = []
    for folder in folders:
        out += [p for p in sorted((ROOT / folder).rglob("*.py")) if ".cache" not in p.parts]
    return out


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The dotted names a module imports (relative imports resolved, `from X import y` as X.y)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            src = ".".join([*base, *([node.module] if node.module else [])])
            out.update(f"{src}.{a.name}" for a in node.names)
    return out


def test_the_on_disk_structures_are_unpacked_by_the_one_reader() -> None:
    found = []
    for path in _files(*CODE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in UNPACK and isinstance(node.value, ast.Attribute)
                    and node.value.attr in STRUCTS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found, "the reader unpacks the superblock, inodes, xattrs and dirents"
    assert {f.partition(":")[0] for f in found} == {"erofs_builder/erofs/read.py"}, found


def test_the_format_code_stands_apart_from_the_sources() -> None:
    erofs = _files("erofs_builder/erofs")
    sources = _files("erofs_builder/sources")
    assert erofs and sources
    above = ("erofs_builder.sources", "erofs_builder.workflow", "erofs_builder.build", "erofs_builder.compress",
             "erofs_builder.flatten", "erofs_builder.compose", "erofs_builder.image_env")
    for path in erofs:
        assert not [m for m in _imports(path) if m.startswith(above)], path
    for path in sources:
        assert not [m for m in _imports(path) if m.startswith("erofs_builder.erofs")], path
