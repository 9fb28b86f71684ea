"""The outer process: the run re-executed under `unshare --mount` (its overlays never reach the host's
mount table), charged to a memory cgroup of its own, and checked afterwards from outside for anything
left behind (mounts, loop devices, processes, the namespace, the work directory). A run that fails or
is interrupted tears itself down as far as it can; what it could not (killed outright) is cleaned up
from here: its processes, its node disk's loop device, its work directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import project, report
from .spec import CGROUP_ENV, INNER_ENV, log

INTERRUPT_GRACE_S = 300  # how long an interrupted run gets to tear itself down before it is killed


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


def clean_after_failure(doc: dict[str, Any], cgroup: Path | None, wait: float = 20) -> dict[str, Any]:
    """After a run that ended without its document (failed, interrupted, killed): its processes still
    alive (a node daemon, whose run was killed before it could stop it) are stopped, SIGTERM then
    SIGKILL; those are the ones in the run's cgroup, or without one those in its namespace that name
    its work directory. Once none is left (so the namespace and its mounts are gone), the loop
    devices backed in the work directory (the node disk) are detached and the directory removed.
    Returns what is left after that."""
    work = doc.get("workdir", "")
    if not os.path.basename(work).startswith("layerstore-compose-"):
        return leftovers(doc)  # not a run's work directory: nothing is touched
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            left = leftovers(doc)
            own = remove_cgroup(cgroup) if cgroup is not None else [
                pid for pid in left["processes_in_namespace"] if pid in left["processes"]]
            for pid in own:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (5 if sig is None else wait)
        while True:
            left = leftovers(doc)
            busy = left["processes"] or left["processes_in_namespace"] or left["mounts"]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not busy:
            break
    if busy:
        return left  # still in use: left as it is, for a person to look at
    for name in left["loop_devices"]:
        subprocess.run(["losetup", "-d", f"/dev/{name}"], check=False)
    shutil.rmtree(work, ignore_errors=True)
    deadline = time.monotonic() + 10  # a loop device still open (its file system going) detaches when let go
    while not (left := leftovers(doc))["clean"] and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def wait_for(proc: subprocess.Popen[bytes]) -> tuple[int, bool]:
    """The run's exit status, and whether it was interrupted. Ctrl-C reaches the run too (the same
    process group) and it tears itself down: it gets INTERRUPT_GRACE_S for that before it is
    killed (subprocess.run would kill it after 0.25 s, leaving its node disk attached). A SIGTERM
    to this process is passed on to the run, which takes it as Ctrl-C."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            return proc.wait(), False
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # (it ignores signals once its teardown began)
            log(f"interrupted: waiting up to {INTERRUPT_GRACE_S} s for the run to tear itself down")
            try:
                return proc.wait(timeout=INTERRUPT_GRACE_S), True
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                return proc.wait(), True
    finally:
        signal.signal(signal.SIGTERM, previous)


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
        rc, interrupted = wait_for(subprocess.Popen(cmd, env=env))
        text = Path(inner_out).read_text() if os.path.getsize(inner_out) else ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(inner_out)
    doc: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        doc = json.loads(text) if text else {}
    if rc != 0 or interrupted or "results" not in doc:
        log("the run was interrupted" if interrupted else f"the run failed (exit {rc})")
        if doc.get("workdir"):  # the run wrote where it works before anything else
            left = clean_after_failure(doc, cgroup)
            log(f"{'nothing left' if left['clean'] else 'left behind'}: {json.dumps(left)}")
        remove_cgroup(cgroup, wait=30)
        return 130 if interrupted else rc or 1
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
