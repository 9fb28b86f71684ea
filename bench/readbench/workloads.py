"""What is read: each workload walks a mounted tree and returns the bytes it read."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import blake3

from .spec import MiB


def seq_read(root: Path) -> int:
    """Sequential 1 MiB reads of every file (the large files of the random-data image)."""
    total = 0
    buf = bytearray(MiB)
    for name in sorted(os.listdir(root)):
        with open(root / name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def walk_hash(root: Path) -> int:
    """os.walk + read + blake3 of every regular file (the standard-library image)."""
    total = 0
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            blake3.blake3(data).digest()
            total += len(data)
    return total


# name -> (the tree it reads: "big" or "small", the function)
WORKLOADS: dict[str, tuple[str, Callable[[Path], int]]] = {
    "seq": ("big", seq_read),
    "walk_hash": ("small", walk_hash),
}
