"""The HTTP store service for tests and benchmarks: `layerctl serve` started on a free loopback port
(or a Unix socket) in front of a store, tracked by PID and always stopped (`running_service` is a
context manager; `Service.stop` ends the process group it started, nothing else)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import httpx

LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
SCOPES = {"read": ["read"], "push": ["push:*"], "gc": ["gc"], "admin": ["admin"]}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tokens(path: Path, tokens: dict[str, list[str]], *, private: list[str] | None = None,
                anonymous: list[str] | None = None) -> dict[str, str]:
    """Write a tokens file with one token per id (scopes as given); returns id -> token."""
    from service.auth import TokenFile, save_token_file

    tf = TokenFile(private=list(private or []), anonymous=list(anonymous or []))
    out = {tid: tf.add(tid, scopes) for tid, scopes in tokens.items()}
    save_token_file(path, tf)
    return out


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    store_url: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """End the service (its uvicorn workers are in its process group) and wait for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        # Workers of a killed supervisor: the group may outlive its leader.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def start_service(store_url: str, workdir: Path, *, tokens: Path | None = None, workers: int = 1,
                  unix: bool = False, port: int | None = None, body_timeout: float | None = None,
                  env: dict[str, str] | None = None, ready_timeout: float = 60.0,
                  tls: tuple[Path, Path] | None = None, extra_args: tuple[str, ...] = ()) -> Service:
    """`layerctl serve` on `store_url`, ready (answering HTTP) when this returns; `tls`: a
    certificate and key (PEM) to serve HTTPS with; `extra_args`: more options of `layerctl serve`."""
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):
        if unix:
            sock = workdir / f"service-{os.getpid()}-{attempt}.sock"
            listen, url = f"unix:{sock}", f"http+unix://{quote(str(sock), safe='')}"
        else:
            p = port or free_port()
            listen, url = f"127.0.0.1:{p}", f"http://127.0.0.1:{p}"
        args = [LAYERCTL, "serve", "--store", store_url, "--listen", listen, "--workers", str(workers),
                "--log-level", "warning"]
        if tokens is not None:
            args += ["--tokens", str(tokens)]
        if body_timeout is not None:
            args += ["--body-timeout", str(body_timeout)]
        if tls is not None:
            args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
            url = url.replace("http://", "https://")
        args += list(extra_args)
        log = workdir / f"service-{listen.replace('/', '_').replace(':', '_')[-60:]}.log"
        full_env = {**os.environ, **(env or {})}
        full_env.pop("LAYERSTORE_TOKEN", None)
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        svc = Service(url, proc, log, store_url)
        try:
            if _wait_ready(svc, ready_timeout):
                return svc
        except BaseException:
            svc.stop()
            raise
        svc.stop()
        if port is not None or "address already in use" not in svc.log_text().lower():
            raise RuntimeError(f"the store service did not start:\n{svc.log_text()[-3000:]}")
    raise RuntimeError("no free port for the store service")


def client_for(url: str, **kw: object) -> httpx.Client:
    """A plain httpx client of the service at `url` (http:// or http+unix://)."""
    if url.startswith("http+unix://"):
        sock = unquote(url[len("http+unix://"):].split("/", 1)[0])
        return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost", **kw)  # type: ignore[arg-type]
    return httpx.Client(base_url=url, verify=False, **kw)  # type: ignore[arg-type]  # (readiness only)


def _wait_ready(svc: Service, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    sock = unquote(svc.url[len("http+unix://"):]) if svc.url.startswith("http+unix://") else None
    with client_for(svc.url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not svc.alive():
                return False
            if sock is not None and not os.path.exists(sock):
                time.sleep(0.05)  # (httpcore leaks the socket of a failed Unix connect)
                continue
            try:
                client.get("/healthz")
                return True
            except httpx.TransportError:
                time.sleep(0.1)
    raise RuntimeError(f"the store service did not answer within {timeout} s:\n{svc.log_text()[-3000:]}")


@contextlib.contextmanager
def running_service(store_url: str, workdir: Path, **kw: object) -> Iterator[Service]:
    svc = start_service(store_url, workdir, **kw)  # type: ignore[arg-type]
    try:
        yield svc
    finally:
        svc.stop()


@contextlib.contextmanager
def threaded_service(store_url: str, *, tokens: Path | None = None, body_timeout: float = 30.0) -> Iterator[str]:
    """The service app on a free loopback port, served by uvicorn in a thread of this process
    (starts in milliseconds: for suites that want a fresh store per test); yields its URL."""
    import threading

    import uvicorn

    from layerstore.store import Store
    from service.app import create_app
    from service.auth import TokenTable

    store = Store.open(store_url)
    app = create_app(store, TokenTable(tokens), body_timeout=body_timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="store-service")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded store service did not start")
            time.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        store.close()
