"""The store: the project's real single-node Ceph (testkit.ceph_cluster), run inside the link's namespace.

The Ceph daemons talk to each other on the namespace's own loopback; radosgw additionally listens on the
store end of the veth pair, which is the only way in from the node. `testkit.ceph_cluster` binds radosgw
to 127.0.0.1, so the helper adds a second beast endpoint on the store address (beast takes several).

The helper is a child process started with `ip netns exec`; it prints the cluster's facts as one JSON
line, then holds the cluster until its stdin closes or it gets SIGTERM, and stops it (by PID) on the
way out. If the benchmark dies, the pipe closes and the helper cleans up; if the helper dies, the
daemons get SIGTERM from the kernel (PR_SET_PDEATHSIG, set by the harness).

    python -m bench.burst.cephstore serve WORKDIR BIND_ADDR     (run inside the namespace)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .netlink import Link


class StoreProcess:
    """The node side's handle on the Ceph helper running in the namespace."""

    def __init__(self, link: Link, workdir: Path, *, memstore_mib: int = 8192) -> None:
        self.link = link
        self.workdir = workdir
        self.memstore_mib = memstore_mib
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    @property
    def endpoint(self) -> str:
        return f"http://{self.link.store_addr}:{self.info['rgw_port']}"

    def s3_env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.info["access_key"], "AWS_SECRET_ACCESS_KEY": self.info["secret_key"],
                "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        repo = Path(__file__).resolve().parents[2]
        argv = self.link.ns_argv([sys.executable, "-m", "bench.burst.cephstore", "serve", str(self.workdir),
                                  self.link.store_addr, str(self.memstore_mib)])
        self.proc = subprocess.Popen(argv, cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(repo)})
        assert self.proc.stdout is not None
        line = _readline_with_timeout(self.proc, timeout)
        if not line:
            self.stop()
            raise RuntimeError(f"the Ceph store did not start; logs in {self.workdir}/log")
        self.info = json.loads(line)

    def stop(self, timeout: float = 60.0) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            assert p.stdin is not None
            p.stdin.close()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _readline_with_timeout(p: subprocess.Popen[bytes], timeout: float) -> bytes:
    out: list[bytes] = []

    def read() -> None:
        assert p.stdout is not None
        out.append(p.stdout.readline())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else b""


# -- the helper, inside the namespace ----------------------------------------------------------
def serve(workdir: str, bind_addr: str, memstore_mib: int) -> int:
    from testkit.ceph_cluster import CephCluster

    class NsCephCluster(CephCluster):
        def _write_conf(self) -> None:
            super()._write_conf()
            text = self.conf.read_text()
            # tcp_nodelay: without it every response small enough to fit in one segment after the
            # headers waits ~40 ms for the client's delayed ACK (Nagle), which is most of a small GET.
            text, n = re.subn(r"^(rgw frontends = beast endpoint=127\.0\.0\.1:(\d+))(.*)$",
                              rf"\1 endpoint={bind_addr}:\2 tcp_nodelay=1\3", text, flags=re.M)
            if n != 1:
                raise RuntimeError("cannot find radosgw's frontend line in the generated ceph.conf")
            self.conf.write_text(text)

    try:
        cluster = NsCephCluster(workdir, memstore_mib=memstore_mib, die_with_parent=True)
    except TypeError:  # an older harness without the memstore knob
        cluster = NsCephCluster(workdir, die_with_parent=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cluster.start(cephfs=False)
        except TypeError:
            cluster.start()
        info = {"rgw_port": cluster.rgw_port, "access_key": cluster.access_key, "secret_key": cluster.secret_key,
                "pids": {n: d.pid for n, d in cluster.daemons.items()}, "timings": cluster.timings}
        sys.stdout.write(json.dumps(info) + "\n")
        sys.stdout.flush()

        def wait_stdin() -> None:
            with contextlib.suppress(Exception):
                sys.stdin.buffer.read()
            stop.set()

        threading.Thread(target=wait_stdin, daemon=True).start()
        while not stop.wait(0.5):
            pass
    finally:
        t = time.monotonic()
        cluster.stop()
        print(f"burst: store stopped in {time.monotonic() - t:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 8192))
    print("usage: python -m bench.burst.cephstore serve WORKDIR BIND_ADDR [MEMSTORE_MIB]", file=sys.stderr)
    sys.exit(2)
