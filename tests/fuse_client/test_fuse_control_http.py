"""The control socket's HTTP: a FastAPI app served by hypercorn on the daemon's trio loop, after
our own accept loop checked the peer. Malformed and hostile requests get a clear 4xx (never a
500, never a hang), the server keeps serving after them, a refused peer gets no answer, the
blocking client speaks through the standard library and imports no trio even while it talks,
and no HTTP is parsed or written by hand in `fuse_client/control/`."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuse_client.control as controlpkg
import fuse_client.control.api as apimod
import fuse_client.control.server as servermod
from fuse_client.control import request, request_json, socket_path
from fuse_client.control.server import ControlAPI, ControlServer
from layerstore.errors import BadInput, LayerstoreError, PermissionDenied
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import put_blob, rig

BLOB = "b3:" + "a" * 64


@contextlib.asynccontextmanager
async def serving(store: Store, cache_dir: Path) -> AsyncIterator[ControlServer]:
    async with rig(store, cache_dir) as r, trio.open_nursery() as nursery:
        server = ControlServer(socket_path(cache_dir), ControlAPI(r.lazy))
        await nursery.start(server.serve)
        yield server
        nursery.cancel_scope.cancel()


async def raw(sock: Path, data: bytes, *, eof: bool = False, deadline: float = 20.0) -> bytes:
    """Bytes sent as they are; everything the server answers until it closes (bounded)."""
    with trio.fail_after(deadline):
        stream = await trio.open_unix_socket(str(sock))
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(data)
                if eof:
                    await stream.send_eof()
            out = b""
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await stream.receive_some(65536):
                    out += chunk
            return out


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer else 0


def body_of(answer: bytes) -> dict[str, object]:
    return json.loads(answer.partition(b"\r\n\r\n")[2])  # type: ignore[no-any-return]


def post(path: str, body: bytes, *, ctype: str = "application/json", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {n}\r\n\r\n").encode() + body


DEEP = b"[" * 200_000 + b"]" * 200_000

HOSTILE: list[tuple[str, bytes, int, str]] = [
    ("garbage request line", b"GARBAGE\r\n\r\n", 400, ""),
    ("not HTTP at all", b"\x00\xff" * 64 + b"\r\n\r\n", 400, ""),
    ("a head far over 64 KiB", b"GET /stats HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n", 431, ""),
    ("a body that is not JSON", post("/prefetch", b"{not json"), 400, "BadInput"),
    ("a JSON array", post("/prefetch", b"[1, 2]"), 400, "BadInput"),
    ("JSON nested too deeply", post("/prefetch", DEEP), 400, "BadInput"),
    ("a declared body over the limit", post("/prefetch", b"", length=apimod.MAX_BODY + 1), 400, "BadInput"),
    ("a holder that is not a string", post("/pin", json.dumps({"blob": BLOB, "holder": 5}).encode()), 400,
     "BadInput"),
    ("an empty holder", post("/pin", json.dumps({"blob": BLOB, "holder": ""}).encode()), 400, "BadInput"),
    ("chunk indexes that are not integers", post("/prefetch", json.dumps({"blob": BLOB, "chunks": ["1"]}).encode()),
     400, "BadInput"),
    ("a blob that is not a digest", post("/unpin", json.dumps({"blob": "../../etc", "holder": "h"}).encode()), 400,
     "BadDigest"),
    ("no blob", post("/prefetch", b"{}"), 400, "BadInput"),
    ("a wrong method", b"DELETE /stats HTTP/1.1\r\nHost: x\r\n\r\n", 405, ""),
    ("an unknown route", b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404, ""),
    ("a path trick", b"GET /stats/../cache HTTP/1.1\r\nHost: x\r\n\r\n", 404, ""),
    ("an absolute-form target elsewhere", b"GET http://elsewhere/../../stats/x HTTP/1.1\r\nHost: x\r\n\r\n", 404, ""),
    ("a bad Content-Length", b"POST /unpin HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400, ""),
    ("two Content-Lengths", b"POST /unpin HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     400, ""),
]


@pytest.mark.root
@pytest.mark.trio
async def test_malformed_and_hostile_requests_get_a_clear_4xx(store: Store, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cache_dir = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        async with serving(store, cache_dir):
            sock = socket_path(cache_dir)
            for what, data, status, kind in HOSTILE:
                answer = await raw(sock, data)
                assert status_of(answer) == status, (what, answer[:300])
                if kind:
                    assert body_of(answer)["kind"] == kind, (what, answer[:300])
                if status in (404, 405):
                    assert "no route" in str(body_of(answer)["error"]), what
            # ... and the daemon still answers.
            assert "blobs" in await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/stats")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.root
@pytest.mark.trio
async def test_lying_slow_and_silent_clients_neither_hang_nor_break_the_server(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(servermod, "IDLE_TIMEOUT", 0.3)
    monkeypatch.setattr(apimod, "BODY_DEADLINE", 0.3)
    cache_dir = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        async with serving(store, cache_dir):
            sock = socket_path(cache_dir)
            # Connects and says nothing: closed once the idle time is over.
            assert await raw(sock, b"") == b""
            # Half a request head, then silence.
            assert await raw(sock, b"GET /sta") == b""
            # A body shorter than its Content-Length, then silence: a 400 after the body deadline.
            answer = await raw(sock, post("/unpin", b'{"bl', length=100))
            assert status_of(answer) == 400 and "not received" in str(body_of(answer)["error"]), answer
            # A body shorter than its Content-Length, then the end of the stream: no answer is owed.
            assert status_of(await raw(sock, post("/unpin", b'{"bl', length=100), eof=True)) in (0, 400)
            # Hung up right after the head.
            assert status_of(await raw(sock, post("/prefetch", b"", length=10), eof=True)) in (0, 400)
            assert "blobs" in await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/stats")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.root
@pytest.mark.trio
async def test_what_curl_sends_works_too(store: Store, tmp_path: Path) -> None:
    """`curl --unix-socket DIR/control.sock -d '{...}' http://x/unpin` sends a form content type,
    HTTP/1.0 clients send no Host, and bodies may come chunked: all are read as before."""
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        sock = socket_path(cache_dir)
        body = json.dumps({"blob": BLOB, "holder": "h"}).encode()
        answer = await raw(sock, post("/unpin", body, ctype="application/x-www-form-urlencoded"))
        assert status_of(answer) == 200 and body_of(answer)["removed"] is False, answer
        answer = await raw(sock, b"GET /stats?pretty=1 HTTP/1.0\r\n\r\n")
        assert status_of(answer) == 200 and "blobs" in body_of(answer)
        chunked = (b"POST /unpin HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        answer = await raw(sock, chunked)
        assert status_of(answer) == 200 and body_of(answer)["holder"] == "h", answer
        # One request per connection, as before: the answer says so and the server closes.
        assert b"\r\nconnection: close\r\n" in (await raw(sock, b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")).lower()
        # An empty body is {}.
        answer = await raw(sock, post("/cache/verify", b""))
        assert status_of(answer) == 200 and body_of(answer)["checked"] == 0, answer


@pytest.mark.root
@pytest.mark.trio
async def test_the_openapi_document_describes_every_route(store: Store, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        doc = await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/openapi.json")
    got = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert got == {("GET", "/stats"), ("GET", "/metrics"), ("GET", "/cache"), ("POST", "/cache/verify"),
                   ("POST", "/cache/evict"), ("POST", "/cache/gc"), ("POST", "/prefetch"), ("POST", "/pin"),
                   ("POST", "/unpin"), ("POST", "/attach"), ("POST", "/detach")}
    schema = doc["paths"]["/prefetch"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {"blob", "chunks", "ranges", "all", "wait"}
    assert schema["required"] == ["blob"]


@pytest.mark.root
@pytest.mark.trio
async def test_answers_keep_their_content_types_and_errors_their_class(store: Store, tmp_path: Path) -> None:
    cmap = put_blob(store, bytes(range(256)) * 64)
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        ctype, text = await trio.to_thread.run_sync(request, cache_dir, "GET", "/metrics")
        assert ctype == apimod.PROMETHEUS_TEXT and b"layerstore_fuse_corrupt_chunks_total" in text
        ctype, _ = await trio.to_thread.run_sync(request, cache_dir, "GET", "/cache")
        assert ctype == "application/json"
        res = await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/prefetch",
                                            {"blob": cmap.blob, "all": True, "wait": True})
        assert res == {"blob": cmap.blob, "queued": len(cmap.chunks), "done": len(cmap.chunks), "failed": 0}
        with pytest.raises(BadInput, match="out of range"):
            await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/prefetch",
                                          {"blob": cmap.blob, "chunks": [99]})
        with pytest.raises(LayerstoreError, match="no route GET /pin"):
            await trio.to_thread.run_sync(request, cache_dir, "GET", "/pin")


@pytest.mark.trio
async def test_a_refused_peer_gets_no_answer_and_the_client_says_permission_denied(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(As root or not: the peer check is made to refuse everyone, root included.)"""
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir) as server:
        monkeypatch.setattr(server, "allowed", lambda uid, gid, groups: False)
        assert await raw(socket_path(cache_dir), b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        with pytest.raises(PermissionDenied, match="closed the connection without an answer"):
            await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/stats")
        assert server.refused == 2


@pytest.mark.root
@pytest.mark.trio
async def test_a_connection_that_fails_inside_the_http_server_does_not_stop_the_daemon(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = servermod.TCPServer
    failures = [RuntimeError("a bug in the HTTP server")]

    def flaky(*args: object) -> object:
        if failures:
            raise failures.pop()
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(servermod, "TCPServer", flaky)
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        assert await raw(socket_path(cache_dir), b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert "blobs" in await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/stats")
    assert "a connection failed" in caplog.text and not failures


CLIENT = """
import sys
from fuse_client.control import request_json
res = request_json(sys.argv[1], "GET", "/stats")
print("blobs" in res, "trio" in sys.modules)
"""


@pytest.mark.root
@pytest.mark.trio
async def test_the_blocking_client_talks_without_importing_trio(store: Store, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        p = await trio.run_process([sys.executable, "-c", CLIENT, str(cache_dir)], capture_stdout=True,
                                   capture_stderr=True)
    assert p.stdout.decode().split() == ["True", "False"], p.stderr


def test_no_http_of_our_own_in_the_control_package() -> None:
    """No request or status line, header block or socket I/O written by hand: HTTP is hypercorn's
    (h11) on the server and the standard library's `http.client` in the client."""
    found = []
    for path in sorted(Path(controlpkg.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes) and id(node) not in docstrings:
                text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
                if "\r\n" in text or "HTTP/1." in text or text.lower().startswith("content-length:"):
                    found.append(f"{path.name}:{node.lineno} {text[:40]!r}")
            if isinstance(node, ast.Attribute) and node.attr in (
                    "recv", "recv_into", "sendall", "send", "receive_some", "send_all", "makefile"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_client_parses_nothing_itself_when_the_answer_is_not_http(tmp_path: Path) -> None:
    """A socket that answers garbage: the standard library's parser refuses it, the client says
    so as a project error (no traceback, no hang)."""
    import socket
    import threading

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(socket_path(cache_dir)))
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"NOT-HTTP garbage\r\n\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(LayerstoreError, match="malformed answer"):
            request(cache_dir, "GET", "/stats", timeout=10)
    finally:
        t.join(10)
        srv.close()


# -- property: whatever the body, a clear answer -----------------------------------------------------
@dataclass
class Running:
    cache_dir: Path
    blob: str


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """One control server on a trio thread for the whole module (hypothesis calls in many times)."""
    tmp = tmp_path_factory.mktemp("control")
    store = Store.open(str(tmp / "store"))
    store.init()
    cmap = put_blob(store, bytes(range(256)) * 300)
    cache_dir = tmp / "cache"
    ready, stop = threading.Event(), trio.Event()
    token: list[trio.lowlevel.TrioToken] = []
    errors: list[BaseException] = []

    async def main() -> None:
        async with serving(store, cache_dir):
            token.append(trio.lowlevel.current_trio_token())
            ready.set()
            await stop.wait()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as e:  # handed to the test's thread
            errors.append(e)
            ready.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    ready.wait(60)
    try:
        assert token and not errors, errors
        yield Running(cache_dir, cmap.blob)
    finally:
        if token:
            trio.from_thread.run_sync(stop.set, trio_token=token[0])
        t.join(60)
        store.close()
    assert not errors, errors


KEYS = ("blob", "holder", "chunks", "ranges", "all", "wait", "to_bytes", "older_than", "dry_run")


def json_values(blob: str) -> st.SearchStrategy[object]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=40), st.sampled_from([blob, "b3:" + "0" * 64, "h", "", "../x"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.mark.root
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_body_on_any_route_gets_an_answer_below_500(running: Running, data: st.DataObject) -> None:
    method, path = data.draw(st.sampled_from([("POST", "/prefetch"), ("POST", "/pin"), ("POST", "/unpin"),
                                              ("POST", "/cache/evict"), ("POST", "/cache/verify"),
                                              ("POST", "/cache/gc"),
                                              ("GET", "/stats"), ("GET", "/cache")]))
    if data.draw(st.booleans()):
        body = json.dumps(data.draw(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8),
                                                    json_values(running.blob), max_size=6))).encode()
    else:
        body = data.draw(st.binary(max_size=200))
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(socket_path(running.cache_dir)))
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status = status_of(answer)
    assert 200 <= status < 500, (method, path, body[:200], answer[:500])
    if status != 200:
        assert "error" in body_of(answer), answer[:500]
