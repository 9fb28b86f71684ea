"""What the contenders read through: an EROFS mount of an image file, and a `layerctl daemon` with its
FUSE mount and node cache. Both are torn down even when the run fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import spec
from .probes import process_cpu_s, process_faults, thread_sched_ns
from .project import DaemonNotRunning, digestmod, linux, request_json


@contextlib.contextmanager
def erofs_mount(image: Path, work: Path, options: str = "") -> Iterator[Path]:
    target = Path(tempfile.mkdtemp(prefix="mnt-erofs-", dir=work))
    linux.mount_erofs(image, target, options)
    try:
        yield target
    finally:
        linux.umount(target, lazy=True)
        target.rmdir()


PROBE_ATTACH_S = 0.5  # strace and perf attach asynchronously: what they would miss of the run


@dataclass
class DaemonRun:
    pid: int
    mnt: Path
    cache: Path

    def blob(self, digest: str) -> Path:
        return self.mnt / "blobs" / digest

    def counters(self, blob: str) -> dict[str, float]:
        st = request_json(self.cache, "GET", "/stats", timeout=10)["blobs"].get(blob, {})
        on_cpu, waiting = thread_sched_ns(self.pid, self.pid)
        return {"requests": st.get("hits", 0) + st.get("misses", 0), "misses": st.get("misses", 0),
                "served": st.get("served_bytes", 0), "fetched": st.get("fetched_bytes", 0),
                "cpu_s": process_cpu_s(self.pid), "main_cpu_ns": on_cpu, "main_wait_ns": waiting,
                "faults": process_faults(self.pid)}

    @contextlib.contextmanager
    def probed(self, out: dict[str, object]) -> Iterator[None]:
        """`spec.DAEMON_PROBE` attached to the daemon for the block (nothing if none): counts that
        load does not move (system calls, page faults) of exactly the timed run; its summary in
        `out["daemon_probe"]`."""
        if not spec.DAEMON_PROBE:
            yield
            return
        fd, path = tempfile.mkstemp(prefix="daemon-probe-", dir=self.cache.parent)
        os.close(fd)
        proc = subprocess.Popen([*spec.DAEMON_PROBE, "-p", str(self.pid), "-o", path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(PROBE_ATTACH_S)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)  # both tools write their summary when interrupted
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out["daemon_probe"] = Path(path).read_text(errors="replace").strip().splitlines()
            os.unlink(path)

    def data_file(self, blob: str) -> Path:
        hexd = digestmod.hex_of(blob)
        return self.cache / "data" / hexd[:2] / hexd


@contextlib.contextmanager
def daemon(store: str, cache: Path, mnt: Path, log: Path, env: dict[str, str] | None = None,
           extra: list[str] | None = None) -> Iterator[DaemonRun]:
    """A `layerctl daemon` subprocess (its defaults as shipped, unless `extra` arguments say
    otherwise); stopped and unmounted even on failure."""
    mnt.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        proc = subprocess.Popen([spec.LAYERCTL, "daemon", "--store", store, "--cache", str(cache), "--mountpoint",
                                 str(mnt), "--log-level", "warning", *(extra or spec.DAEMON_ARGS)],
                                stdout=logf, stderr=logf, env={**os.environ, **(env or {})})
    try:
        end = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise RuntimeError(f"daemon exited with {proc.returncode}; {log} ends with:\n" + "\n".join(tail))
            if linux.is_mount(mnt):
                with contextlib.suppress(DaemonNotRunning, OSError):
                    request_json(cache, "GET", "/stats", timeout=5)
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"daemon did not mount; see {log}")
            time.sleep(0.02)
        yield DaemonRun(proc.pid, mnt, cache)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if linux.is_mount(mnt):
            linux.umount(mnt, lazy=True)


def unmount_all_under(work: Path) -> None:
    """After the run, even a failed one: whatever is still mounted under the work directory."""
    for p in sorted(work.glob("**/mnt*"), reverse=True):
        if linux.is_mount(p):
            linux.umount(p, lazy=True)
