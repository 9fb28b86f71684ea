"""The outer process: the run re-executed under `unshare --mount` (its overlays never reach the host's
mount table), charged to a memory cgroup of its own, and checked afterwards from outside for anything
left behind (mounts, loop devices, processes, the namespace, the work directory)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import project, report
from .spec import CGROUP_ENV, INNER_ENV, log


def is_inner() -> bool:
    return bool(os.environ.get(INNER_ENV))


def leftovers(doc: dict[str, Any]) -> dict[str, Any]:
    """Seen from outside the run's namespace, after it ended: what is left of it."""
    work = doc.get("workdir", "/nonexistent")
    ns = doc.get("mount_namespace")
    procs, in_ns = [], []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if ns and os.readlink(f"/proc/{pid}/ns/mnt") == ns:
                in_ns.append(int(pid))
            if work.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                procs.append(int(pid))
        except OSError:
            continue
    loops = []
    for dev in Path("/sys/block").glob("loop*"):
        bf = dev / "loop" / "backing_file"
        with contextlib.suppress(OSError):
            if bf.exists() and bf.read_text().startswith(work):
                loops.append(dev.name)
    linux = project.linux()

    mounts = [m.mountpoint for m in linux.mounts_under(linux.read_mounts(), work)]
    return {"processes": procs, "processes_in_namespace": in_ns, "loop_devices": loops, "mounts": mounts,
            "workdir_exists": os.path.exists(work),
            "clean": not (procs or in_ns or loops or mounts or os.path.exists(work))}


def make_cgroup() -> Path | None:
    """A memory cgroup (v1) for the run, under the one this process is in (so that whatever accounts
    for that one still sees the run), to charge the run's kernel memory to. None if there is none."""
    try:
        rel = next(ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                   if ln.split(":", 2)[1] == "memory")
    except (OSError, StopIteration):
        return None
    cg = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / f"layerstore-compose-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError:
        return None
    return cg


def remove_cgroup(cg: Path | None, wait: float = 0) -> list[int]:
    """Remove the run's cgroup; the processes still in it (none, after a clean run)."""
    deadline = time.monotonic() + wait
    while cg is not None:
        try:
            left = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            return []
        if not left:
            with contextlib.suppress(OSError):
                cg.rmdir()
            return []
        if time.monotonic() > deadline:
            return left
        time.sleep(0.5)
    return []


def outer(script: Path, argv: list[str], out: Path) -> int:
    """Run `script argv` again in a private mount namespace (the run), then check what it left and
    write the document to `out`. 0 only if nothing is left."""
    with tempfile.NamedTemporaryFile(prefix="compose-", suffix=".json", delete=False) as tmp:
        inner_out = tmp.name
    cgroup = make_cgroup()
    try:
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, str(script),
               *argv, "--inner-out", inner_out]
        env = {**os.environ, INNER_ENV: "1", **({CGROUP_ENV: str(cgroup)} if cgroup else {})}
        rc = subprocess.run(cmd, env=env).returncode
        text = Path(inner_out).read_text() if os.path.getsize(inner_out) else ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(inner_out)
    if rc != 0 or not text:
        log(f"the run failed (exit {rc})")
        remove_cgroup(cgroup, wait=30)
        return rc or 1
    doc = json.loads(text)
    deadline = time.monotonic() + 30  # the daemon may take a moment to exit after its mount went
    while True:
        doc["leftovers"] = leftovers(doc)
        cgroup_left = remove_cgroup(cgroup)  # (a multiprocessing helper may take a moment to exit)
        doc["leftovers"]["processes_in_cgroup"] = cgroup_left
        doc["leftovers"]["clean"] = doc["leftovers"]["clean"] and not cgroup_left
        if doc["leftovers"]["clean"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    doc["verdicts"] = report.verdicts(doc)
    report.write(doc, out)
    log(f"wrote {out}; clean: {doc['leftovers']['clean']}")
    report.summary(doc)
    return 0 if doc["leftovers"]["clean"] else 1
