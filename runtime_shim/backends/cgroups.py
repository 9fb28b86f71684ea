"""A sandbox's cgroup on this node: where it is (every mounted hierarchy), ending what runs in it
and removing it. The container backend names it in the bundle (`sandbox_path`, runc's and crun's
cgroupfs driver: <hierarchy>/layerstore/<id>); a runtime that died or was killed before it could
clean up leaves it, with the container's processes in it, and `remove` takes both away.

Hierarchies are found by listing /sys/fs/cgroup (O(controllers)), never the mount table: a unified
(v2) node has one, a legacy or hybrid (v1) node one per controller (and `unified`, `systemd`).
The split is pure (`pids_of`, `parse_procs`) apart from the I/O (`dirs`, `kill`, `remove`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "layerstore"


def sandbox_path(sandbox: str) -> str:
    """The cgroupsPath the bundle gives the runtime (relative to each hierarchy's root)."""
    return f"/{PREFIX}/{sandbox}"


def hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """The cgroup hierarchies mounted on this node: the root itself when it is unified (v2), else
    each controller's directory under it (links such as cpu -> cpu,cpuacct counted once)."""
    if (root / "cgroup.controllers").exists():
        return [root]
    out: dict[str, Path] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False):
                out.setdefault(os.path.realpath(entry.path), Path(entry.path))
    return sorted(out.values())


def dirs(sandbox: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The sandbox's cgroup directories that exist now (in each hierarchy), children first."""
    rel = sandbox_path(sandbox).lstrip("/")
    found = []
    for h in hierarchies(root):
        top = h / rel
        if top.is_dir():
            found.extend(sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True))
    return found


def parse_procs(text: str) -> set[int]:
    """The pids of a cgroup.procs file's text (pure)."""
    return {int(x) for x in text.split() if x.isdigit()}


def pids_of(sandbox: str, root: Path = CGROUP_ROOT) -> set[int]:
    """Every process in the sandbox's cgroup, in any hierarchy."""
    out: set[int] = set()
    for d in dirs(sandbox, root):
        with contextlib.suppress(OSError):
            out |= parse_procs((d / "cgroup.procs").read_text())
    return out


def kill(sandbox: str, root: Path = CGROUP_ROOT) -> int:
    """SIGKILL every process in the sandbox's cgroup (cgroup.kill where the kernel has it, else
    each pid its cgroup.procs lists: a process in it cannot leave it). How many pids were sent it."""
    sent = 0
    for d in dirs(sandbox, root):
        with contextlib.suppress(OSError), open(d / "cgroup.kill", "r+") as f:  # (the kernel's file: never created)
            f.write("1")
    for pid in pids_of(sandbox, root):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            sent += 1
    return sent


def remove(sandbox: str, timeout: float = 10.0, root: Path = CGROUP_ROOT) -> list[Path]:
    """Kill what runs in the sandbox's cgroup and remove its directories (rmdir: EBUSY until the
    last process has gone), retrying until `timeout` seconds have passed. The directories left
    (empty: all removed)."""
    deadline = time.monotonic() + timeout
    while True:
        kill(sandbox, root)
        left = []
        for d in dirs(sandbox, root):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
                left.append(d)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
