"""Connection floods for the hostile-client tests of the store service (issue 27): many idle or
half-sent TCP connections from 127.0.0.2-4 (three source addresses: each has its own ~28,000
ephemeral ports), held open while the test polls the service.

`Flood` opens and holds its sockets in a thread of this process (up to its RLIMIT_NOFILE);
`FloodGroup` splits a larger flood over child processes (`python -m testkit.flood`, each at most
`PER_PROCESS` sockets: an unprivileged container cannot raise the hard limit, 20,000 here), which
report their counts on stdout and exit when their stdin closes (so they end with the test even if
it is killed). Only loopback targets: both refuse any other address."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
PER_PROCESS = 15_000
HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: flood\r\nX-Slow: "  # never ends its headers


def raise_nofile(wanted: int) -> int:
    """Raise this process's RLIMIT_NOFILE (soft and, as root, hard) to at least `wanted` if it can;
    returns the soft limit now. Children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class Flood:
    """`count` connections to host:port (loopback only), each idle (nothing sent) or half-sent
    (`HALF_SENT`: a request whose headers never end), opened `batch` at a time (at most `rate` a
    second, 0: as fast as they connect), then held."""

    host: str
    port: int
    count: int
    half_sent: bool = False
    batch: int = 500
    rate: float = 0.0
    opened: int = 0  # connections established
    failed: int = 0  # connects refused or timed out
    closed_by_peer: int = 0  # connections the service closed (EOF or reset seen)
    done_opening: threading.Event = field(default_factory=threading.Event)
    _socks: dict[int, socket.socket] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if not ipaddress.ip_address(self.host).is_loopback:
            raise ValueError(f"a flood targets loopback only, not {self.host}")

    def __enter__(self) -> Flood:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        raise_nofile(self.count + 4096)
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        for s in self._socks.values():
            s.close()
        self._socks.clear()

    @property
    def held(self) -> int:
        """Connections open on this side and not (yet) seen closed by the service."""
        return len(self._socks)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        batch = self.batch if not self.rate else max(1, min(self.batch, int(self.rate / 10)))
        start = time.monotonic()
        try:
            i = 0
            while i < self.count and not self._stop.is_set():
                n = min(batch, self.count - i)
                self._open_batch(sel, i, n)
                i += n
                self._reap(sel, 0)
                while self.rate and not self._stop.is_set():  # (a reap returns at the first close seen)
                    ahead = start + i / self.rate - time.monotonic()
                    if ahead <= 0:
                        break
                    self._reap(sel, ahead)
            self.done_opening.set()
            while not self._stop.is_set():
                self._reap(sel, 0.2)
        finally:
            self.done_opening.set()
            sel.close()

    def _open_batch(self, sel: selectors.BaseSelector, first: int, n: int) -> None:
        pending: dict[int, socket.socket] = {}
        for j in range(first, first + n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.bind((SOURCES[j % len(SOURCES)], 0))
                rc = s.connect_ex((self.host, self.port))
            except OSError:
                s.close()
                self.failed += 1
                continue
            if rc not in (0, errno.EINPROGRESS):
                s.close()
                self.failed += 1
                continue
            pending[s.fileno()] = s
        wsel = selectors.DefaultSelector()
        for s in pending.values():
            wsel.register(s, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline and not self._stop.is_set():
            for key, _ in wsel.select(0.5):
                s = pending.pop(key.fd)
                wsel.unregister(s)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    s.close()
                    self.failed += 1
                    continue
                if self.half_sent:
                    try:
                        s.send(HALF_SENT)
                    except OSError:
                        s.close()
                        self.closed_by_peer += 1
                        continue
                self.opened += 1
                self._socks[s.fileno()] = s
                sel.register(s, selectors.EVENT_READ)
        wsel.close()
        for s in pending.values():  # never completed: the service's queue was full
            s.close()
            self.failed += 1

    def _reap(self, sel: selectors.BaseSelector, timeout: float) -> None:
        """Close (and count) the connections the service has closed."""
        for key, _ in sel.select(timeout):
            s = self._socks.get(key.fd)
            if s is None:
                continue
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # EOF or reset: the service closed it (an answer before it is kept reading)
                sel.unregister(s)
                del self._socks[key.fd]
                s.close()
                self.closed_by_peer += 1


@dataclass
class FloodGroup:
    """A flood of `count` connections split over child processes of at most `PER_PROCESS` each,
    opened at most `rate` a second in all (0: as fast as they connect)."""

    host: str
    port: int
    count: int
    half_sent: bool = False
    rate: float = 0.0
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _status: dict[int, dict[str, int]] = field(default_factory=dict)
    _readers: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not ipaddress.ip_address(self.host).is_loopback:
            raise ValueError(f"a flood targets loopback only, not {self.host}")

    def __enter__(self) -> FloodGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        parts = -(-self.count // PER_PROCESS)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                            os.environ.get("PYTHONPATH", "")])}
        for i in range(parts):
            n = self.count // parts + (1 if i < self.count % parts else 0)
            args = [sys.executable, "-m", "testkit.flood", self.host, str(self.port), str(n)]
            if self.half_sent:
                args.append("--half-sent")
            if self.rate:
                args.append(f"--rate={self.rate / parts}")
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self._procs.append(proc)
            t = threading.Thread(target=self._read, args=(i, proc), daemon=True)
            t.start()
            self._readers.append(t)

    def _read(self, i: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                self._status[i] = json.loads(line)
            except ValueError:
                continue

    def total(self, what: str) -> int:
        """The sum over the children of `opened`, `failed`, `closed_by_peer` or `held`."""
        return sum(s.get(what, 0) for s in list(self._status.values()))

    def done_opening(self) -> bool:
        return len(self._status) == len(self._procs) and all(s.get("done") for s in self._status.values())

    def wait_opened(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.done_opening():
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                proc.stdin.close()  # the child's signal to close its sockets and exit
        for proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for t in self._readers:
            t.join(5)
        for proc in self._procs:
            if proc.stdout is not None:
                proc.stdout.close()


def _child(argv: list[str]) -> None:
    """`python -m testkit.flood HOST PORT COUNT [--half-sent] [--rate=N]`: hold a flood, print its
    counts as a JSON line every 0.2 s, close everything and exit when stdin closes."""
    rate = next((float(a.split("=", 1)[1]) for a in argv if a.startswith("--rate=")), 0.0)
    flood = Flood(argv[0], int(argv[1]), int(argv[2]), half_sent="--half-sent" in argv, rate=rate)
    gone = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()
        gone.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    flood.start()
    try:
        while not gone.wait(0.2):
            counts = {"opened": flood.opened, "failed": flood.failed, "closed_by_peer": flood.closed_by_peer,
                      "held": flood.held, "done": flood.done_opening.is_set()}
            try:
                print(json.dumps(counts), flush=True)
            except BrokenPipeError:
                break
    finally:
        flood.stop()


if __name__ == "__main__":
    _child(sys.argv[1:])
