"""The service's connections under a hostile client (issue 27; docs/service.md, "Connection floods").

uvicorn holds a connection that never sends a request, or never finishes its headers, forever;
past the file limit its accept loop logs a traceback for every failed accept (2,048 a second).
This module is the guard `layerctl serve` runs uvicorn with, per worker process:

- `GuardedHttp`, uvicorn's HTTP protocol with a header deadline (a connection must deliver its
  request's headers, at most `MAX_HEADER_BYTES`, within `header_timeout` of opening or of its
  first byte after an answer: else a 408 and close) and a connection cap: at the cap a new
  connection closes the least recently active idle one (no request in progress), or itself if
  every one is busy. Idle keep-alive connections are uvicorn's `timeout_keep_alive`.
- `guarded_loop`, the event loop factory (`GuardedLoop`): at most `ACCEPTS_PER_TICK` accepts a
  turn, and an accept that fails for lack of file descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM)
  lowers the cap below the connections open and closes the excess idle ones instead of a
  traceback per attempt.
- Garbage: a closed connection's transport cycle is broken (`GuardedHttp.connection_lost`), the
  loaded app is frozen out of the collector's sight and full collections made rarer
  (`GC_THRESHOLDS`): a full collection over thousands of connections held the loop for most of a
  second.
- `GuardLog`: what the guard did, one line per interval with counts (never a line per event); it
  also swallows uvicorn's per-connection "Invalid HTTP request received." warnings into a count.

The cap is per worker and kept below the file limit (`effective_cap`); `raise_nofile` lifts the
soft limit to the hard one before the workers start. State is the worker's memory only: a worker
that dies takes its connections with it."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("layerstore.service.connections")

MAX_CONNECTIONS_ENV = "LAYERSTORE_SERVE_MAX_CONNECTIONS"
HEADER_TIMEOUT_ENV = "LAYERSTORE_SERVE_HEADER_TIMEOUT"
DEFAULT_MAX_CONNECTIONS = 4096  # per worker; 10,000 held the loop > 1 s under a 40,000 flood (docs)
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 15.0
MAX_HEADER_BYTES = 32 << 10  # a request line and headers larger than this are refused (431)
BACKLOG = 4096  # the listen queue (the kernel caps it at net.core.somaxconn): room for a burst
ACCEPTS_PER_TICK = 64
# A full collection walks every connection's objects (~28 each): at 4,096 connections 0.3 s on a
# loaded 2-core machine. Connections churning at a flood's rate triggered one about every second;
# a tenth as often (Python's default third threshold is 10).
GC_THRESHOLDS = (700, 10, 100)
LOG_INTERVAL = 10.0  # seconds between two lines of the guard's log
FD_RESERVE_MIN = 256  # file descriptors kept free of connections (store files, threads, logs)
ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
QUIET_UVICORN = ("Invalid HTTP request received.", "Unsupported upgrade request.")
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_TOO_BIG_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


def raise_nofile() -> int:
    """Lift RLIMIT_NOFILE's soft limit to the hard one (as far as this process may); the new soft
    limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return soft
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def effective_cap(wanted: int, nofile: int) -> int:
    """The connection cap a worker can hold: `wanted`, but below the file limit by a reserve
    (a tenth of it, at least FD_RESERVE_MIN)."""
    return max(1, min(wanted, nofile - max(FD_RESERVE_MIN, nofile // 10)))


@dataclass
class GuardLog:
    """Counts of what the guard did, logged at most once per `interval` (a line with every count
    since the last one); a count noted after a quiet spell is flushed by a timer."""

    interval: float = LOG_INTERVAL
    counts: dict[str, int] = field(default_factory=dict)
    last: float = float("-inf")
    _timer: asyncio.TimerHandle | None = None

    def note(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._timer = loop.call_later(self.last + self.interval - now, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # (a loop running late: the timer's turn has come and gone)
            self._timer = None
        if not self.counts:
            return
        self.last = time.monotonic()
        text = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        self.counts.clear()
        log.warning("connection guard: %s", text)


class QuietFilter(logging.Filter):
    """Drops uvicorn's per-connection warnings (QUIET_UVICORN) into the guard's counts."""

    def __init__(self, guard_log: GuardLog) -> None:
        super().__init__()
        self.guard_log = guard_log

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in QUIET_UVICORN:
            self.guard_log.note("bad requests refused")
            return False
        return True


@dataclass
class ConnectionGuard:
    """One worker's connections, least recently active first, and its limits."""

    cap: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    log: GuardLog = field(default_factory=GuardLog)
    conns: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    _last_shed: float = float("-inf")

    @classmethod
    def from_env(cls) -> ConnectionGuard:
        wanted = int(os.environ.get(MAX_CONNECTIONS_ENV) or DEFAULT_MAX_CONNECTIONS)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        cap = effective_cap(wanted, nofile)
        if cap < wanted:
            log.warning("connection cap %d per worker (asked %d; the file limit is %d)", cap, wanted, nofile)
        guard = cls(cap=cap, header_timeout=float(os.environ.get(HEADER_TIMEOUT_ENV) or DEFAULT_HEADER_TIMEOUT))
        logging.getLogger("uvicorn.error").addFilter(QuietFilter(guard.log))
        # The app is loaded (this runs at the first connection): out of the collector's sight, so a
        # full collection under a flood walks the connections' objects only, not FastAPI's too.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLDS[0], GC_THRESHOLDS[1], GC_THRESHOLDS[2])
        return guard

    def opened(self, conn: Any) -> bool:
        """A new connection: room is made at the cap; False if there is none (close it)."""
        if len(self.conns) >= self.cap and not self.shed(1):
            self.log.note("connections refused at the cap (all busy)")
            return False
        self.conns[conn] = None
        return True

    def closed(self, conn: Any) -> None:
        self.conns.pop(conn, None)

    def touch(self, conn: Any) -> None:
        if conn in self.conns:
            self.conns.move_to_end(conn)

    def shed(self, n: int) -> int:
        """Close up to `n` idle connections, least recently active first; how many."""
        done = skipped = 0
        while done < n and skipped < len(self.conns):
            conn = next(iter(self.conns))
            if conn.guard_busy():
                self.conns.move_to_end(conn)  # active: not a candidate for a while
                skipped += 1
                continue
            del self.conns[conn]
            conn.guard_close()
            done += 1
        if done:
            self.log.note("idle connections closed at the cap", done)
        return done

    def accept_failed(self, exc: BaseException | None) -> None:
        """An accept failed for lack of resources (the loop retries a second later): the cap was
        above what this process can hold, so it comes down below the connections open now (and
        the file limit), the excess idle connections are closed, and it is counted. Once per
        burst: the loop's accept attempts of one turn all fail alike."""
        name = errno.errorcode.get(getattr(exc, "errno", 0) or 0, "resources")
        self.log.note(f"accept errors ({name})")
        now = time.monotonic()
        if now - self._last_shed < 0.5:
            return
        self._last_shed = now
        batch = max(16, len(self.conns) // 100)
        cap = min(len(self.conns) - batch, effective_cap(self.cap, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        if 0 < cap < self.cap:
            self.cap = cap
            self.log.note(f"cap lowerings (now {cap})")
        self.shed(max(batch, len(self.conns) - self.cap))


_guard: ConnectionGuard | None = None


def guard() -> ConnectionGuard:
    """This worker's guard (configured from the environment `layerctl serve` sets)."""
    global _guard
    if _guard is None:
        _guard = ConnectionGuard.from_env()
    return _guard


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guard's header deadline and connection cap."""

    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _guard: ConnectionGuard | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard = guard()
        if not self._guard.opened(self):
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._guard is not None:
            self._guard.closed(self)
        super().connection_lost(exc)
        # asyncio's socket transport refers to itself (its read callback is its own bound method):
        # a cycle only the collector frees. Broken here, a closed connection is freed at once; a
        # flood's thousands otherwise make full collections pauses of half a second and more.
        if getattr(self.transport, "_read_ready_cb", None) is not None:
            self.transport._read_ready_cb = None  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and not self.guard_busy():
            self._arm_header_timer()  # the first bytes of the next request
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # its headers are complete: a request began
            self._cancel_header_timer()
        elif self._header_timer is not None:  # still in the headers (a body's bytes are not counted)
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._refuse(_TOO_BIG_431, "requests refused for header size")
                return
        if self._guard is not None:
            self._guard.touch(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._guard is not None:
            self._guard.touch(self)

    # -- what the guard asks of a connection ------------------------------------------------
    def guard_busy(self) -> bool:
        """A request is in progress (its headers came; its answer is not complete)."""
        return self.cycle is not None and not self.cycle.response_complete

    def guard_close(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.abort()  # no lingering FIN_WAIT: the descriptor is free at once

    # -- the header deadline ------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._header_bytes = 0
        timeout = self._guard.header_timeout if self._guard is not None else DEFAULT_HEADER_TIMEOUT
        self._header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._header_bytes = 0

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.guard_busy() or self.transport.is_closing():
            return
        if self._header_bytes:
            self._refuse(_TIMEOUT_408, "half-sent requests closed (header timeout)")
        else:
            self._refuse(None, "silent connections closed (header timeout)")

    def _refuse(self, answer: bytes | None, what: str) -> None:
        self._cancel_header_timer()
        if self._guard is not None:
            self._guard.log.note(what)
            self._guard.closed(self)
        if answer is not None:
            self.transport.write(answer)
        self.transport.close()


def _on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRORS and "accept" in str(context.get("message", "")):
        guard().accept_failed(exc)
        return
    loop.default_exception_handler(context)


class GuardedLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop, accepting at most ACCEPTS_PER_TICK connections a turn (asyncio takes
    as many as the listen backlog, 4,096: a flood's burst would hold the loop for most of a second
    while a health check waits behind it)."""

    def _accept_connection(self, protocol_factory: Any, sock: Any, sslcontext: Any = None, server: Any = None,
                           backlog: int = 100, *args: Any, **kw: Any) -> None:
        super()._accept_connection(protocol_factory, sock, sslcontext, server,  # type: ignore[misc]
                                   min(backlog, ACCEPTS_PER_TICK), *args, **kw)

    def close(self) -> None:
        if _guard is not None:
            _guard.log.flush()  # the last counts, as the worker stops
        super().close()


def guarded_loop() -> asyncio.AbstractEventLoop:
    """The event loop of a guarded worker (uvicorn's `loop=` factory): a `GuardedLoop` whose failed
    accepts go to the guard, not to a traceback each."""
    loop = GuardedLoop()
    loop.set_exception_handler(_on_loop_error)
    return loop

