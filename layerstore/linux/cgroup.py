"""A process's own place among the kernel's killers: its OOM score adjustment
(/proc/PID/oom_score_adj) and its cgroup in the unified (v2) hierarchy (/proc/PID/cgroup,
cgroup.procs). Used by the fanotify keeper (fuse_client/fanotify/keeper.py), which must outlive
an OOM kill or a cgroup kill of the node daemon, and which leaves its cgroup when it quits
(`leave`, `remove_if_empty`). Pure (`own_v2_cgroup`, `sibling`, `parent`) apart from the reads and
writes of /proc and /sys.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
OOM_SCORE_ADJ_MIN = -1000  # never chosen by the OOM killer, nor killed with its cgroup (memory.oom.group)


def set_oom_score_adj(value: int, pid: int | str = "self") -> None:
    """Write /proc/PID/oom_score_adj (lowering it needs CAP_SYS_RESOURCE). OSError if refused."""
    with open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write(f"{value}\n")


def oom_score_adj(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def v2_root(root: Path = CGROUP_ROOT) -> Path | None:
    """The mount of the unified hierarchy: /sys/fs/cgroup on a v2 node, /sys/fs/cgroup/unified on a
    hybrid one, None on a v1-only node."""
    for cand in (root, root / "unified"):
        if (cand / "cgroup.controllers").exists():
            return cand
    return None


def own_v2_cgroup(proc_cgroup: str) -> str | None:
    """The v2 cgroup path (`0::/a/b` line) of a /proc/PID/cgroup text, None if it has none (pure)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def sibling(own: str, name: str) -> str:
    """`name` beside the cgroup `own` (a child of the root when `own` is the root): a cgroup that a
    kill of `own` (cgroup.kill, memory.oom.group) does not reach (pure)."""
    return os.path.join(parent(own), name)


def parent(rel: str) -> str:
    """The cgroup that holds `rel` ("/" for the root and its children) (pure)."""
    return os.path.dirname(rel.rstrip("/")) or "/"


def cgroup_of(pid: int | str = "self") -> str | None:
    """The v2 cgroup of a process, None if it has none or is gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return own_v2_cgroup(f.read())
    except OSError:
        return None


def move_self(rel: str, root: Path | None = None) -> Path:
    """Move this process into the v2 cgroup `rel` (created if missing); its directory. OSError if
    there is no unified hierarchy or the kernel refuses (no delegation, the internal-process rule)."""
    root = root or v2_root()
    if root is None:
        raise OSError("no unified (v2) cgroup hierarchy")
    target = root / rel.lstrip("/")
    for _ in range(2):  # (once more if another process removed it, empty, between the two steps)
        target.mkdir(exist_ok=True)
        try:
            (target / "cgroup.procs").write_text(f"{os.getpid()}\n")
            return target
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"cgroup {rel} removed while moving into it")


def remove_if_empty(rel: str, root: Path | None = None) -> bool:
    """Remove the v2 cgroup `rel` (never the root); whether it is gone now. The kernel refuses while
    a process or a child cgroup is in it (EBUSY): then it stays, and so on any other error."""
    root = root or v2_root()
    if root is None or rel.strip("/") == "" or ".." in rel.split("/"):
        return False
    try:
        (root / rel.lstrip("/")).rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def leave(rel: str, to: list[str], root: Path | None = None) -> bool:
    """Move this process out of the v2 cgroup `rel` into the first cgroup of `to` that takes it
    (a parent with controllers enabled for its children refuses processes: the internal-process
    rule), then remove `rel` if that leaves it empty; whether it is gone. Never raises: a process
    that cannot leave stays where it is."""
    root = root or v2_root()
    if root is None:
        return False
    for dest in to:
        try:
            (root / dest.lstrip("/") / "cgroup.procs").write_text(f"{os.getpid()}\n")
            break
        except OSError:
            continue
    return remove_if_empty(rel, root)
