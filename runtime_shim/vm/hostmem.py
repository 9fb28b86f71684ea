"""What VMs cost the host in memory, read from /proc and mincore(2) (Linux only): the figures the
pmem tests and bench/vm_memory.py compare (docs/vm-memory.md).

- `mappings(pid)`: a process's memory by mapping (/proc/PID/smaps): Rss, Pss, Shared_Clean,
  Private_* in bytes, keyed by the mapped path ("" for anonymous memory: a VMM's guest RAM).
  Pss splits a page shared by N processes N ways, so the Pss of one file's mapping summed over
  every process mapping it is that file's resident mapped pages counted once.
- `resident(path)`: how many bytes of a file are in the host page cache (`layerstore.linux`'s
  mincore over a shared mapping of it, which faults nothing in).
- `host_memory(pids, files)`: the memory a set of VMMs and the files they read cost the host,
  each page once: the processes' Pss except their mappings of `files`, plus the page cache of
  `files` (mapped or not).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerstore.linux.memory import PAGE, resident_pages

_FIELDS = {"Rss": "rss", "Pss": "pss", "Shared_Clean": "shared_clean", "Shared_Dirty": "shared_dirty",
           "Private_Clean": "private_clean", "Private_Dirty": "private_dirty"}


@dataclass
class Usage:
    rss: int = 0
    pss: int = 0
    shared_clean: int = 0
    shared_dirty: int = 0
    private_clean: int = 0
    private_dirty: int = 0

    def add(self, other: Usage) -> None:
        for f in _FIELDS.values():
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class ProcessMemory:
    pid: int
    by_path: dict[str, Usage] = field(default_factory=dict)

    def total(self, exclude: Iterable[str] = ()) -> Usage:
        skip = set(exclude)
        out = Usage()
        for path, u in self.by_path.items():
            if path not in skip:
                out.add(u)
        return out


def mappings(pid: int) -> ProcessMemory:
    """/proc/PID/smaps summed by mapped path (bytes). `OSError` if the process is gone."""
    pm = ProcessMemory(pid)
    cur: Usage | None = None
    with open(f"/proc/{pid}/smaps", "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            head = line.split(None, 5)
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                path = head[5].strip() if len(head) > 5 else ""
                if path.startswith("["):
                    path = ""  # [heap], [stack], ...: anonymous
                cur = pm.by_path.setdefault(path, Usage())
                continue
            key, _, rest = line.partition(":")
            name = _FIELDS.get(key)
            if name is not None and cur is not None:
                kb = rest.split()
                if kb:
                    setattr(cur, name, getattr(cur, name) + int(kb[0]) * 1024)
    return pm


def resident(path: str | os.PathLike[str]) -> int:
    """Bytes of `path` in the host page cache (whole pages; 0 for an empty file)."""
    return sum(b & 1 for b in resident_pages(path, follow=True)) * PAGE


def host_memory(pids: Iterable[int], files: Iterable[str]) -> dict[str, int]:
    """{"processes": their Pss but for mappings of `files`, "page_cache": `files` resident,
    "total": both}: every page once. Processes that are gone count 0."""
    names = [os.path.realpath(f) for f in files]
    procs = 0
    for pid in pids:
        try:
            procs += mappings(pid).total(exclude=names).pss
        except OSError:
            continue
    cache = 0
    for f in set(names):
        try:
            cache += resident(f)
        except OSError:
            continue
    return {"processes": procs, "page_cache": cache, "total": procs + cache}
