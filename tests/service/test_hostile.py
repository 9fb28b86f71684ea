"""Malformed and hostile requests get a clear 4xx, never a 500 and never a hang: bad digests and
keys, bodies that are not what their key says, huge or lying Content-Length, ranges past the end,
path tricks, slow clients. Raw sockets where a well-behaved client library would refuse to send
the request."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from layerstore import chunkmap, chunkobj, keys
from layerstore import digest as digestmod

from .conftest import Served

DEADLINE = 20.0  # seconds any answer may take (the service's body timeout is 3 s)


def _raw(served: Served, data: bytes, *, pause_after: int | None = None, trickle: float = 0.0) -> tuple[int, bytes]:
    """Send `data` on a fresh connection (optionally the bytes after `pause_after` one at a time,
    `trickle` seconds apart); return the answer's status and head."""
    u = urlsplit(served.url)
    with socket.create_connection((u.hostname, u.port), timeout=DEADLINE) as s:
        if pause_after is None:
            s.sendall(data)
        else:
            s.sendall(data[:pause_after])
            for i in range(pause_after, len(data)):
                try:
                    s.sendall(data[i : i + 1])
                except OSError:
                    break  # the service answered and closed: what we want to see
                time.sleep(trickle)
        start = time.monotonic()
        buf = b""
        while b"\r\n" not in buf:
            assert time.monotonic() - start < DEADLINE, "no answer: the service hangs"
            part = s.recv(65536)
            if not part:
                break
            buf += part
    assert buf.startswith(b"HTTP/1.1 "), buf[:200]
    return int(buf[9:12]), buf


def _request(method: str, path: str, token: str, headers: dict[str, str] | None = None, body: bytes = b"",
             length: int | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: test", f"Authorization: Bearer {token}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def client(served: Served) -> httpx.Client:
    with httpx.Client(base_url=served.url, timeout=DEADLINE, headers=served.auth("admin")) as c:
        yield c


@pytest.fixture(scope="module")
def stored(served: Served) -> dict[str, object]:
    with served.local() as s:
        payload = bytes(range(256)) * 40
        chunk, _ = s.put_chunk(payload)
        return {"chunk": chunk, "key": keys.object_key("chunks", chunk), "payload": payload,
                "size": s.backend.size(keys.object_key("chunks", chunk))}


def _is_clear_4xx(r: httpx.Response, *statuses: int) -> None:
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    if r.request.method != "HEAD":
        body = r.json()
        assert body["kind"] and body["error"], body


@pytest.mark.parametrize("path", [
    "/v1/objects/chunks/zz/zz/nothex",
    "/v1/objects/chunks/ab/cd/" + "AB" * 32,
    "/v1/objects/chunks/ab/cd/" + "ab" * 32,  # the wrong fan-out
    "/v1/objects/chunks/ab/ab/" + "ab" * 31,
    "/v1/objects/blobs/" + "ab" * 32,
    "/v1/objects/tags/NotAName:v1",
    "/v1/objects/" + "a/" * 600 + "x",
    "/v1/objects/a%00b",
    "/v1/objects/.tmp-x",
    "/v1/objects/chunks/..%2F..%2Fetc%2Fpasswd",
    "/v1/objects/chunks/%2e%2e/%2e%2e/config",
    "/v1/objects/a//b",
    "/v1/objects/a\\b",
    "/v1/list?prefix=../",
    "/v1/list?prefix=%00",
    "/v1/list?prefix=a&info=7",
])
def test_bad_keys_and_digests(client: httpx.Client, path: str) -> None:
    for method in ("GET", "PUT", "DELETE"):
        r = client.request(method, path, content=b"x" if method == "PUT" else None)
        if path.startswith("/v1/list") and method != "GET":
            assert r.status_code == 405, r.text
            continue
        _is_clear_4xx(r, 400)


def test_raw_path_tricks_never_leave_the_store(served: Served, stored: dict[str, object]) -> None:
    token = served.tokens["admin"]
    for path in ("/v1/objects/../config", "/v1/objects/chunks/../../../../etc/passwd", "/v1/objects/./config",
                 "/v1/objects/%2e%2e/%2e%2e/etc/passwd", "/../../etc/passwd", "//etc/passwd",
                 "/v1/objects/tags/a:b/../../../config"):
        status, head = _raw(served, _request("GET", path, token))
        assert 400 <= status < 500, (path, head[:300])
        assert b"root:" not in head


def test_bodies_that_are_not_what_their_key_says(client: httpx.Client, stored: dict[str, object]) -> None:
    ident, obj = chunkobj.encode(b"honest payload " * 100)
    key = keys.object_key("chunks", ident)
    other_key = keys.object_key("chunks", digestmod.of(b"another payload"))
    flipped = bytearray(obj)
    flipped[-3] ^= 1
    for target, body in ((other_key, obj), (key, bytes(flipped)), (key, obj[:10]), (key, b""),
                         (key, b"LSCK" + b"\xff" * 40)):
        r = client.put("/v1/objects/" + target, content=body, headers={"If-None-Match": "*"})
        _is_clear_4xx(r, 422)
        assert r.json()["kind"] == "RejectedObject"
        assert client.head("/v1/objects/" + target).status_code == 404
    # a chunk map that names chunks the store does not have
    cm = chunkmap.ChunkMap.build([chunkmap.ChunkRef(0, 5, digestmod.of(b"never stored"))])
    r = client.put("/v1/objects/" + keys.object_key("blobs", cm.blob), content=cm.encode())
    _is_clear_4xx(r, 404)
    # a map under another blob's id
    good = chunkmap.ChunkMap.build([chunkmap.ChunkRef(0, len(stored["payload"]), stored["chunk"])])  # type: ignore[arg-type]
    r = client.put("/v1/objects/" + keys.object_key("blobs", digestmod.of(b"x")), content=good.encode())
    _is_clear_4xx(r, 422)
    # tags: not a digest, a manifest that is not there
    _is_clear_4xx(client.put("/v1/objects/tags/env:v1", content=b"not a digest"), 422)
    _is_clear_4xx(client.put("/v1/objects/tags/env:v1", content=digestmod.of(b"nothing").encode()), 404)
    _is_clear_4xx(client.put("/v1/objects/config", content=b"{not json"), 422)


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_huge_and_lying_content_length(served: Served) -> None:
    token = served.tokens["admin"]
    chunk_path = "/v1/objects/" + keys.object_key("chunks", digestmod.of(b"big"))
    # announced far beyond any chunk: refused before a byte of the body is read
    status, _ = _raw(served, _request("PUT", chunk_path, token, length=1 << 40))
    assert status == 413
    status, _ = _raw(served, _request("PUT", "/v1/objects/tags/env:v1", token, length=1 << 20))
    assert status == 413
    status, _ = _raw(served, _request("PUT", chunk_path, token, length=10 ** 30))
    assert 400 <= status < 500
    status, _ = _raw(served, _request("PUT", chunk_path, token, headers={"Transfer-Encoding": "chunked"}, length=-1))
    assert 400 <= status < 500
    # announces more than it sends, then stops: the body deadline ends it
    start = time.monotonic()
    status, _ = _raw(served, _request("PUT", "/v1/objects/leases/x/head", token, body=b"{}", length=1000))
    assert status == 408
    assert time.monotonic() - start < DEADLINE
    # announces less than it sends: the announced bytes are the body, the rest is not a request
    status, _ = _raw(served, _request("PUT", "/v1/objects/tags/env:v1", token, body=b"b3:" + b"0" * 2000, length=10))
    assert status == 422
    # chunked, without a length, past the key's limit
    big = b"x" * 4000
    raw = (f"PUT /v1/objects/tags/env:v1 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
           "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    raw += f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n"
    status, _ = _raw(served, raw)
    assert status == 413


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_slow_client_gets_408_and_others_are_served(served: Served) -> None:
    token = served.tokens["admin"]
    body = b"{" + b" " * 40 + b"}"
    data = _request("PUT", "/v1/objects/leases/slow/head", token, body=body)
    import threading

    result: dict[str, object] = {}

    def slow() -> None:
        result["answer"] = _raw(served, data, pause_after=len(data) - len(body), trickle=0.25)

    t = threading.Thread(target=slow)
    t.start()
    try:
        with httpx.Client(base_url=served.url, timeout=5, headers=served.auth("read")) as c:
            for _ in range(5):  # the slow upload does not hold anyone else up
                assert c.get("/v1/store").status_code == 200
                time.sleep(0.2)
    finally:
        t.join(DEADLINE + 5)
    assert not t.is_alive()
    assert result["answer"][0] == 408  # type: ignore[index]


def test_ranges(client: httpx.Client, stored: dict[str, object]) -> None:
    path = "/v1/objects/" + str(stored["key"])
    size = int(stored["size"])  # type: ignore[call-overload]
    whole = client.get(path).content
    assert len(whole) == size
    r = client.get(path, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == whole[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{size}"
    r = client.get(path, headers={"Range": f"bytes={size - 5}-{size + 100}"})
    assert r.status_code == 206 and r.content == whole[-5:]
    r = client.get(path, headers={"Range": "bytes=-7"})
    assert r.status_code == 206 and r.content == whole[-7:]
    for past in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
        r = client.get(path, headers={"Range": past})
        assert r.status_code == 416, past
        assert r.headers["content-range"] == f"bytes */{size}"
    for bad in ("bytes=abc", "bytes=5-2", "bytes=0-1,4-5", "items=0-1", "bytes=" + "9" * 40 + "-", "bytes=-"):
        _is_clear_4xx(client.get(path, headers={"Range": bad}), 400)


def test_conditional_headers(client: httpx.Client, stored: dict[str, object]) -> None:
    path = "/v1/objects/" + str(stored["key"])
    r = client.get(path)
    assert r.headers["etag"] == f'"{stored["chunk"]}"'
    assert "immutable" in r.headers["cache-control"]
    assert client.get(path, headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    _is_clear_4xx(client.put("/v1/objects/t/x", content=b"x", headers={"If-None-Match": '"abc"'}), 400)
    _is_clear_4xx(client.put("/v1/objects/t/x", content=b"x", headers={"If-None-Match": "*", "If-Match": "*"}), 400)


def test_malformed_batches(client: httpx.Client) -> None:
    for body in (b"", b"{", b"[]", b'{"keys": "x"}', b'{"keys": [1]}', b'{"nokeys": []}'):
        _is_clear_4xx(client.post("/v1/delete", content=body), 400)
    _is_clear_4xx(client.post("/v1/delete", content=json.dumps({"keys": ["../x"]}).encode()), 400)
    _is_clear_4xx(client.post("/v1/delete", content=json.dumps({"keys": ["k"] * 20_000}).encode()), 413)


def test_garbage_on_the_wire(served: Served) -> None:
    for data in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /v1/store HTTP/1.1\r\n" + b"X: " +
                 b"a" * 100_000 + b"\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64):
        status, _ = _raw(served, data)
        assert 400 <= status < 500, data[:40]


def test_no_request_got_a_500(served: Served) -> None:
    """Runs last in this module: nothing above made the service fail (its own count)."""
    text = httpx.get(served.url + "/metrics", timeout=DEADLINE).text
    five = [ln for ln in text.splitlines() if ln.startswith("layerstore_service_requests_total")
            and 'status="5' in ln and not ln.endswith(" 0.0")]
    assert five == []


def test_keys_that_name_a_prefix_are_no_objects(client: httpx.Client, stored: dict[str, object]) -> None:
    """On a POSIX store a prefix of keys is a directory: the backend's CorruptObject (502) or
    failure (503) would blame the store for a request's mistake."""
    for key in ("chunks", "chunks/" + str(stored["key"]).split("/")[1], "leases"):
        for method in ("GET", "HEAD", "DELETE"):
            assert client.request(method, "/v1/objects/" + key).status_code in (400, 404), (method, key)
        assert client.put("/v1/objects/" + key, content=b"x").status_code == 400, key
    client.put("/v1/objects/t/p/head", content=b"{}")
    assert client.get("/v1/objects/t/p").status_code == 404
    assert client.put("/v1/objects/t/p", content=b"{}").status_code == 400
    assert client.put("/v1/objects/leases/p", content=b"{}").status_code == 400  # not a lease key
