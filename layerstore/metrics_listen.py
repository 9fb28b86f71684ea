"""An opt-in TCP listener that serves one process's Prometheus text at `GET /metrics`, for a
Prometheus to scrape (the node daemon and the snapshotter use it; the store service has its own
HTTP server and route).

It runs in a thread of its own (the standard library's `ThreadingHTTPServer`), never in a trio
loop: parsing a scraper's request and writing the answer cost the daemon's loop nothing. What the
text says comes from a `render` callable the owner passes in; the owner decides where the figures
are read (the node daemon reads its counters on its trio thread, where they are written, so a
scrape sees one consistent picture; the snapshotter's counters are prometheus-client's, which
lock). If the process dies, the socket closes with it: nothing to clean up.

Bound to loopback unless the address names another host: the figures name blobs."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from .errors import ConfigError

log = logging.getLogger("layerstore.metrics")
# HOST:PORT or PORT, one variable per kind of process: the snapshotter starts node daemons (through
# the shim), which inherit its environment; one shared name would have them bind the same port.
NODE_ENV = "LAYERSTORE_NODE_METRICS_LISTEN"
SNAPSHOTTER_ENV = "LAYERSTORE_SNAPSHOTTER_METRICS_LISTEN"
DEFAULT_HOST = "127.0.0.1"


def parse_address(text: str) -> tuple[str, int]:
    """`PORT`, `:PORT` or `HOST:PORT` (`[::1]:PORT` for IPv6) -> (host, port); loopback when no
    host is named."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = "", text.strip()
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"--metrics-listen: {text!r} is not HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"--metrics-listen: port {number} is out of range")
    return host, number


def wanted(flag: str | None, env: str) -> str | None:
    """The address asked for: the flag, else the environment variable `env`, else none (no listener)."""
    return flag or os.environ.get(env) or None


class MetricsListener:
    """`GET /metrics` -> `render()`; anything else 404. `start()` binds (port 0: a free one,
    see `address`), `close()` stops the thread and closes the socket."""

    def __init__(self, address: str, render: Callable[[], bytes]) -> None:
        self.host, self.port = parse_address(address)
        self.render = render
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.server_address[:2]  # type: ignore[return-value]

    def start(self) -> MetricsListener:
        render = self.render

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                try:
                    body = render()
                except Exception:  # a failed scrape is one 500, never the listener's end
                    log.exception("metrics: rendering failed")
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (scrapes are not news)
                pass

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        try:
            self._server = Server((self.host, self.port), Handler)
        except OSError as e:
            raise ConfigError(f"--metrics-listen {self.host}:{self.port}: {e.strerror or e}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-listen", daemon=True)
        self._thread.start()
        log.info("metrics at http://%s:%d/metrics", *self.address)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> MetricsListener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
