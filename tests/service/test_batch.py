"""Batched reads (`POST /v1/batch`, `HttpBackend.load_many`): the same objects and the same errors
as single GETs, item by item; hostile batches refused whole before anything is read (too many
items, repeated items, keys that are not content-addressed, private names, tokens that may not
read); a client that trusts no frame of the answer (lying lengths, frames out of order, cut
answers, an object larger than its kind allows) and falls back to single GETs where a batch does
not help."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from layerstore import chunkobj, keys
from layerstore.backends import http_wire as wire
from layerstore.backends.http import HttpBackend
from layerstore.backends.posix import PosixBackend
from layerstore.errors import BadKey, CorruptObject, NotFound, PermissionDenied
from layerstore.store import MAX_OBJECT_SIZE, Store
from service.cached_reads import CachedReader

from .conftest import Served

MAX_CHUNK = MAX_OBJECT_SIZE["chunks"]


@pytest.fixture(scope="module")
def chunks(served: Served) -> list[tuple[str, bytes]]:
    """(key, object bytes) of a few chunks in the store behind the service, and a private tag."""
    with served.local() as s:
        out = []
        for i in range(5):
            digest, _ = s.put_chunk(bytes([i]) * (3000 + i) + b"tail")
            key = keys.object_key("chunks", digest)
            out.append((key, s.backend.load(key)))
        s.set_tag("secret/app:v1", s.put_manifest(b"{}"))
        return out


def _frames(body: bytes, asked: list[str]) -> list[tuple[str, int, bytes]]:
    frames = wire.BatchFrames(asked, MAX_CHUNK)
    out = frames.feed(body)
    frames.check_done()
    assert len(out) == len(asked)
    return out


def _batch(served: Served, who: str | None, keys_: list[str]) -> httpx.Response:
    return httpx.post(served.url + wire.BATCH, content=json.dumps({"keys": keys_}), headers=served.auth(who),
                      timeout=20.0)


# -- the service ---------------------------------------------------------------------------------
def test_a_batch_answers_every_item_as_a_get_would(served: Served, chunks: list[tuple[str, bytes]]) -> None:
    missing = keys.object_key("chunks", "b3:" + "ab" * 32)
    asked = [chunks[2][0], missing, chunks[0][0], chunks[4][0]]
    r = _batch(served, "read", asked)
    assert r.status_code == 200 and r.headers["content-type"] == wire.BATCH_TYPE
    got = _frames(r.content, asked)
    assert [(k, s) for k, s, _ in got] == [(asked[0], 200), (missing, 404), (asked[2], 200), (asked[3], 200)]
    assert got[0][2] == chunks[2][1] and got[2][2] == chunks[0][1] and got[3][2] == chunks[4][1]
    err = json.loads(got[1][2])
    assert err["kind"] == "NotFound"
    single = httpx.get(served.url + wire.OBJECTS + missing, headers=served.auth("read"))
    assert single.status_code == 404 and single.json()["kind"] == err["kind"]
    assert r.headers.get("transfer-encoding") == "chunked"  # an item not in the page cache: streamed
    present = [k for k, _ in chunks]
    r = _batch(served, "read", present)
    if CachedReader.for_backend(PosixBackend(served.store_dir)) is not None:  # all in the page cache: whole
        assert int(r.headers["content-length"]) == len(r.content)
    else:
        assert r.headers.get("transfer-encoding") == "chunked"
    assert [body for _, _, body in _frames(r.content, present)] == [d for _, d in chunks]


@pytest.mark.parametrize(("who", "status"), [(None, 401), ("nothing", 403)])
def test_a_token_that_may_not_read_gets_nothing(served: Served, chunks: list[tuple[str, bytes]], who: str | None,
                                                status: int) -> None:
    r = _batch(served, who, [chunks[0][0]])
    assert r.status_code == status and r.json()["kind"] and chunks[0][1] not in r.content


def test_hostile_batches_are_refused_whole(served: Served, chunks: list[tuple[str, bytes]]) -> None:
    key = chunks[0][0]
    many = [keys.object_key("chunks", f"b3:{i:064x}") for i in range(wire.MAX_BATCH_KEYS + 1)]
    cases: list[tuple[object, int]] = [
        ([key, key], 400),  # the same item twice
        (many, 413),  # too many items
        ([key, "tags/secret/app:v1"], 400),  # a private name: not a content-addressed object, nothing told
        ([key, "tags/team/app:v1"], 400),
        ([key, "config"], 400),
        ([key, "chunks/../../etc/passwd"], 400),
        ([key, keys.object_key("chunks", "b3:" + "ab" * 32).upper()], 400),
        ([key, 7], 400),
        ({"key": key}, 400),
    ]
    for body, status in cases:
        r = httpx.post(served.url + wire.BATCH, content=json.dumps(body if isinstance(body, dict) else
                                                                   {"keys": body}), headers=served.auth("admin"))
        assert r.status_code == status, (body, r.text[:200])
        assert r.json()["kind"] and chunks[0][1] not in r.content
    for raw in (b"", b"{", b"[]", b"x" * (wire.MAX_BATCH_BODY + 1)):
        r = httpx.post(served.url + wire.BATCH, content=raw, headers=served.auth("read"))
        assert r.status_code in (400, 413) and r.json()["kind"], raw[:20]
    # a private tag is answered as the one of a name that does not exist
    r1 = _batch(served, "read", [key, "tags/secret/app:v1"])
    r2 = _batch(served, "read", [key, "tags/secret/nothing:v1"])
    assert (r1.status_code, r1.json()["kind"]) == (r2.status_code, r2.json()["kind"]) == (400, "BadKey")
    assert r1.json()["error"].replace("app", "nothing") == r2.json()["error"]


def test_the_node_scope_reads_batches(served: Served, chunks: list[tuple[str, bytes]]) -> None:
    with HttpBackend(served.url, token=served.tokens["node"]) as b:
        asked = [k for k, _ in chunks]
        got = list(b.load_many([*asked, asked[1]], max_size=MAX_CHUNK))
    assert [k for k, _ in got] == [*asked, asked[1]]
    assert [d for _, d in got] == [d for _, d in chunks] + [chunks[1][1]]


def test_load_many_is_load_item_by_item(served: Served, chunks: list[tuple[str, bytes]]) -> None:
    missing = keys.object_key("chunks", "b3:" + "cd" * 32)
    asked = [chunks[0][0], missing, "tags/secret/app:v1", chunks[3][0], "tags/NotAName:v1", "chunks/../x"]
    with HttpBackend(served.url, token=served.tokens["read"]) as b, served.local() as direct:
        got = dict(b.load_many(asked, max_size=MAX_CHUNK))
        assert got[chunks[0][0]] == chunks[0][1] and got[chunks[3][0]] == chunks[3][1]
        assert isinstance(got[missing], NotFound)
        assert isinstance(got["tags/secret/app:v1"], NotFound)  # private: as if it did not exist
        assert isinstance(got["tags/NotAName:v1"], BadKey) and isinstance(got["chunks/../x"], BadKey)
        assert set(got) == set(asked)
        want = dict(direct.backend.load_many(asked, max_size=MAX_CHUNK))  # the base class: a load each
        assert {k: type(v) if isinstance(v, Exception) else v for k, v in got.items() if k.startswith("chunks")} == {
            k: type(v) if isinstance(v, Exception) else v for k, v in want.items() if k.startswith("chunks")}


def test_an_item_is_checked_against_its_key_by_the_reader(served: Served) -> None:
    """The service sends what the store holds; the reader checks it, as after a GET."""
    with served.local() as s:
        digest, _ = s.put_chunk(b"to be damaged" * 100)
        key = keys.object_key("chunks", digest)
        other = s.backend.load(keys.object_key("chunks", s.put_chunk(b"another" * 100)[0]))
        (served.store_dir / key).write_bytes(other)
    with Store(HttpBackend(served.url, token=served.tokens["read"])) as st:
        [(_, data)] = [(k, d) for k, d in st.backend.load_many([key, key], max_size=MAX_CHUNK)][:1]
        assert isinstance(data, bytes)
        with pytest.raises(CorruptObject):
            chunkobj.decode(data, digest)
        with pytest.raises(CorruptObject):
            st.get_chunk(digest)


# -- the client against a fake service --------------------------------------------------------------
KEYS = [keys.object_key("chunks", "b3:" + f"{i:02x}" * 32) for i in range(3)]
DATA = {k: f"object {i}".encode() * 10 for i, k in enumerate(KEYS)}


def _frame(key: str, status: int = 200, body: bytes | None = None) -> bytes:
    body = DATA[key] if body is None else body
    return wire.frame_head(status, len(body), key) + body


def _answer(parts: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": wire.BATCH_TYPE}, stream=Parts(parts))


class Parts(httpx.SyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        for p in self.parts:
            self.sent += 1
            yield p


def _fake(handler: Callable[[httpx.Request], httpx.Response]) -> tuple[HttpBackend, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET":  # the single GETs a batch falls back to
            key = request.url.path[len(wire.OBJECTS):]
            return httpx.Response(200, content=DATA[key]) if key in DATA else httpx.Response(
                404, json=NotFound("no").to_wire())
        return handler(request)

    b = HttpBackend("http://fake.invalid", token="t", transport=httpx.MockTransport(record))
    b.policy = type(b.policy)(first=0.0, cap=0.0, attempts=3)
    return b, seen


def _asked(request: httpx.Request) -> list[str]:
    return json.loads(request.content)["keys"]


def test_frames_split_anywhere_are_read_whole() -> None:
    body = b"".join(_frame(k) for k in KEYS)
    b, seen = _fake(lambda r: _answer([body[i : i + 1] for i in range(len(body))]))
    assert dict(b.load_many(KEYS)) == DATA
    assert [r.method for r in seen] == ["POST"]


def test_lying_frames_are_broken_answers_and_the_rest_is_asked_again() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        asked = _asked(r)
        if len(asked) == 3:  # the first object, then a frame announcing more than it carries, then the end
            return _answer([_frame(asked[0]), wire.frame_head(200, 500, asked[1]) + b"short"])
        return _answer([_frame(k) for k in asked])

    b, seen = _fake(handler)
    assert dict(b.load_many(KEYS)) == DATA
    assert [_asked(r) for r in seen] == [KEYS, KEYS[1:]]


@pytest.mark.parametrize("bad", [
    lambda: _frame(KEYS[1]) + _frame(KEYS[0]) + _frame(KEYS[2]),  # out of order
    lambda: _frame(KEYS[0]) + _frame(KEYS[0]),  # twice
    lambda: _frame(KEYS[0]) + b"200 x " + KEYS[1].encode() + b"\n",  # no length
    lambda: _frame(KEYS[0]) + b"999 1 " + KEYS[1].encode() + b"\nx",  # no such status
    lambda: _frame(KEYS[0]) + b"x" * 2000,  # no head at all
    lambda: b"".join(_frame(k) for k in KEYS) + _frame(KEYS[0]),  # more frames than asked
])
def test_malformed_answers_never_pass_for_objects(bad: Callable[[], bytes]) -> None:
    b, seen = _fake(lambda r: _answer([bad()]))
    got = dict(b.load_many(KEYS))
    assert got == DATA  # every object from a single GET in the end, none from the broken answer
    assert [r.method for r in seen].count("POST") == 3  # retried, then left to `load`


def test_an_object_larger_than_its_kind_is_refused_before_its_body() -> None:
    body = Parts([wire.frame_head(200, 8 << 30, KEYS[0]), b"x" * 100, b"y" * 100])

    def handler(r: httpx.Request) -> httpx.Response:
        if len(_asked(r)) == 3:
            return httpx.Response(200, headers={"content-type": wire.BATCH_TYPE}, stream=body)
        return _answer([_frame(k) for k in _asked(r)])

    b, seen = _fake(handler)
    got = dict(b.load_many(KEYS, max_size=1 << 20))
    assert isinstance(got[KEYS[0]], CorruptObject)
    assert got[KEYS[1]] == DATA[KEYS[1]] and got[KEYS[2]] == DATA[KEYS[2]]
    assert body.sent == 1  # the head only: no byte of the 8 GiB was read
    assert [_asked(r) for r in seen] == [KEYS, KEYS[1:]]


def test_item_errors_come_back_as_their_class_and_temporary_ones_from_a_get() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        return _answer([_frame(KEYS[0], 404, wire.error_body(NotFound("gone"))),
                        _frame(KEYS[1], 503, b"{}"), _frame(KEYS[2])])

    b, seen = _fake(handler)
    got = dict(b.load_many(KEYS))
    assert isinstance(got[KEYS[0]], NotFound) and got[KEYS[1]] == DATA[KEYS[1]] and got[KEYS[2]] == DATA[KEYS[2]]
    assert [(r.method, r.url.path) for r in seen] == [("POST", wire.BATCH), ("GET", wire.OBJECTS + KEYS[1])]


def test_whole_batch_refusals_are_every_items_error() -> None:
    b, seen = _fake(lambda r: httpx.Response(403, json=PermissionDenied("no").to_wire()))
    got = dict(b.load_many(KEYS))
    assert all(isinstance(v, PermissionDenied) for v in got.values()) and len(seen) == 1


def test_a_service_without_batches_is_read_a_get_a_key() -> None:
    b, seen = _fake(lambda r: httpx.Response(404, json=NotFound("no such route").to_wire()))
    assert dict(b.load_many(KEYS)) == DATA
    assert dict(b.load_many(KEYS)) == DATA
    assert [r.method for r in seen] == ["POST"] + ["GET"] * 6  # asked once, then never again


def _raw_batch(served: Served, token: str, body: bytes, length: int) -> int:
    """A batch request whose Content-Length says `length`, with `body` after it; the status."""
    u = urlsplit(served.url)
    head = (f"POST {wire.BATCH} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=20.0) as s:
        s.sendall(head + body)
        answer = b""
        while b"\r\n" not in answer:
            part = s.recv(4096)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer[9:12])


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_lying_request_lengths(served: Served, chunks: list[tuple[str, bytes]]) -> None:
    body = json.dumps({"keys": [chunks[0][0]]}).encode()
    assert _raw_batch(served, served.tokens["read"], body, 1 << 40) == 413  # refused before reading
    assert _raw_batch(served, served.tokens["read"], body, len(body) + 100) == 408  # never comes: the deadline
    assert _raw_batch(served, served.tokens["read"], body, len(body) - 5) == 400  # cut: not JSON


def test_no_batch_got_a_500(served: Served) -> None:
    """Runs last in this module: nothing above made the service fail (its own count)."""
    text = httpx.get(served.url + "/metrics", timeout=20.0).text
    five = [ln for ln in text.splitlines() if ln.startswith("layerstore_service_requests_total")
            and 'status="5' in ln and not ln.endswith(" 0.0")]
    assert five == []
    assert any(wire.BATCH in ln for ln in text.splitlines() if ln.startswith("layerstore_service_requests_total"))
