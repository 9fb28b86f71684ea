"""The trees the images are built from: random data in a few large files, and a copy of a Python
standard library (many small files)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .spec import SMALL_SOURCE, MiB


def make_big_tree(root: Path, total_mib: int, files: int = 4) -> None:
    root.mkdir(parents=True)
    per = total_mib * MiB // files
    for i in range(files):
        with open(root / f"big{i}.bin", "wb") as f:
            left = per
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n


def make_small_tree(root: Path) -> None:
    def ignore(d: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (os.path.isfile(os.path.join(d, n))
                                                              or os.path.isdir(os.path.join(d, n)))]

    shutil.copytree(SMALL_SOURCE, root, symlinks=True, ignore=ignore)


def tree_stats(root: Path) -> dict[str, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files += 1
                size += os.path.getsize(p)
    return {"files": files, "bytes": size}
