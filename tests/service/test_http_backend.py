"""The http backend as a client: against a fake service (what the Backend contract asks when the
service misbehaves: lengths, broken streams, retries, errors by class), and against the real
one (tokens from the environment and the credentials file, a Unix socket, two instances and a
client that switches between them mid-push, compare-and-swap, the CLI)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.store_service import make_tokens, running_service

from layerstore import chunkmap, keys
from layerstore import digest as digestmod
from layerstore.backends import open_backend
from layerstore.backends.http import HttpBackend
from layerstore.backends.http_wire import PreconditionFailed, Unauthenticated
from layerstore.errors import CorruptObject, NotFound, PermissionDenied, StoreUnavailable
from layerstore.store import Store

from .conftest import Served


# -- against a fake service ---------------------------------------------------------------------
def _fake(handler: Callable[[httpx.Request], httpx.Response]) -> tuple[HttpBackend, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    b = HttpBackend("http://fake.invalid", token="t", transport=httpx.MockTransport(record))
    b.policy = type(b.policy)(first=0.0, cap=0.0, attempts=5)  # no waiting in tests
    return b, seen


class Lazy(httpx.SyncByteStream):
    """A body that records whether anyone read it."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.read = False

    def __iter__(self) -> Iterator[bytes]:
        self.read = True
        yield from self.parts


def test_a_length_past_max_size_is_refused_before_the_body_is_read() -> None:
    body = Lazy([b"x" * 100])
    b, _ = _fake(lambda r: httpx.Response(200, headers={"content-length": str(8 << 30)}, stream=body))
    with pytest.raises(CorruptObject, match="more than"):
        b.load("chunks/x", max_size=1 << 20)
    assert not body.read
    ranged = Lazy([b"x"])
    b, _ = _fake(lambda r: httpx.Response(206, headers={"content-length": "1", "content-range": "bytes 0-0/999999"},
                                          stream=ranged))
    with pytest.raises(CorruptObject):
        b.load("chunks/x", 0, 1, max_size=1000)
    assert not ranged.read


def test_bodies_unlike_their_headers_are_broken_streams() -> None:
    b, seen = _fake(lambda r: httpx.Response(200, headers={"content-length": "4"}, stream=Lazy([b"12345678"])))
    with pytest.raises(StoreUnavailable, match="more than it announced"):
        b.load("t/x")
    assert len(seen) == 5  # retried, then given up
    answers = iter([httpx.Response(200, headers={"content-length": "8"}, stream=Lazy([b"1234"])),
                    httpx.Response(200, content=b"12345678")])
    b, seen = _fake(lambda r: next(answers))
    assert b.load("t/x") == b"12345678"
    assert len(seen) == 2


def test_temporary_answers_are_retried_and_final_ones_are_not() -> None:
    answers = iter([httpx.Response(503, json=StoreUnavailable("busy").to_wire()), httpx.Response(502, text="<html>"),
                    httpx.Response(200, content=b"ok")])
    b, seen = _fake(lambda r: next(answers))
    assert b.load("t/x") == b"ok" and len(seen) == 3
    b, seen = _fake(lambda r: httpx.Response(502, json=CorruptObject("bad bytes").to_wire()))
    with pytest.raises(CorruptObject, match="bad bytes"):
        b.load("t/x")
    assert len(seen) == 1
    b, seen = _fake(lambda r: httpx.Response(404, json=NotFound("object t/x: not found").to_wire()))
    with pytest.raises(NotFound):
        b.load("t/x")
    assert not b.exists("t/x") and len(seen) == 2
    b, _ = _fake(lambda r: httpx.Response(401, json=Unauthenticated("unknown token").to_wire()))
    with pytest.raises(PermissionDenied) as info:
        b.size("t/x")
    assert type(info.value) is Unauthenticated and info.value.exit_code == 6
    b, seen = _fake(lambda r: httpx.Response(500, text="proxy error"))
    with pytest.raises(StoreUnavailable, match="HTTP 500"):
        b.delete("t/x")
    assert len(seen) == 5


def test_unreachable_service() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    b, seen = _fake(refuse)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        b.load("t/x")
    assert len(seen) == 5


def test_a_service_that_ignores_the_range() -> None:
    b, _ = _fake(lambda r: httpx.Response(200, content=b"0123456789"))
    assert b.load("t/x", 3, 4) == b"3456"
    assert b.load("t/x", 8) == b"89"
    b, _ = _fake(lambda r: httpx.Response(416, headers={"content-range": "bytes */10"}))
    assert b.load("t/x", 10, 5) == b""


def test_a_listing_broken_mid_stream_resumes_without_duplicates() -> None:
    lines = [json.dumps({"k": f"l/k{i}", "s": i, "m": 1.5}).encode() + b"\n" for i in range(6)]
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(200, stream=Lazy([*lines[:3], b'{"k": "l/k3"']))  # cut mid-line
        return httpx.Response(200, stream=Lazy(lines))

    b, _ = _fake(handler)
    got = list(b.list_info("l/"))
    assert [i.key for i in got] == [f"l/k{i}" for i in range(6)]
    assert got[2].size == 2 and got[2].mtime == 1.5
    b, _ = _fake(lambda r: httpx.Response(200, stream=Lazy([b'{"k": "other/x"}\n'])))
    with pytest.raises(StoreUnavailable):
        list(b.list("l/"))


def test_a_conditional_write_whose_answer_was_lost() -> None:
    stored: dict[str, bytes] = {}
    answers = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            if "t/x" in stored:
                return httpx.Response(412, json=PreconditionFailed("exists").to_wire())
            stored["t/x"] = request.read()
            answers.append("lost")
            raise httpx.ReadError("connection reset", request=request)  # landed, answer lost
        return httpx.Response(200, content=stored["t/x"])

    b, _ = _fake(handler)
    assert b.store_once("t/x", b"mine") is True
    assert b.store_once("t/x", b"other") is False


# -- against the real service -------------------------------------------------------------------
def test_token_from_the_environment_and_the_credentials_file(served: Served, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAYERSTORE_TOKEN", raising=False)
    monkeypatch.setenv("LAYERSTORE_CREDENTIALS", str(tmp_path / "none.json"))
    with open_backend(served.url) as b, pytest.raises(Unauthenticated, match="token is required"):
        b.check()
    monkeypatch.setenv("LAYERSTORE_TOKEN", served.tokens["read"])
    with open_backend(served.url) as b:
        b.check()
    monkeypatch.delenv("LAYERSTORE_TOKEN")
    creds = tmp_path / "credentials.json"
    netloc = served.url.split("://", 1)[1]
    for entry in (served.url, netloc):
        creds.write_text(json.dumps({entry: served.tokens["read"]}))
        monkeypatch.setenv("LAYERSTORE_CREDENTIALS", str(creds))
        with open_backend(served.url + "/") as b:
            b.check()
    creds.write_text(json.dumps({served.url: "lst_wrong_token"}))
    with open_backend(served.url) as b, pytest.raises(Unauthenticated, match="unknown token"):
        b.check()


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_unix_socket_and_a_push_through_the_cli(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    tokens = make_tokens(tmp_path / "tokens.json", {"ci": ["push:team/"], "ro": ["read"], "gc": ["gc"]})
    with running_service(str(store_dir), tmp_path / "svc", unix=True) as svc:
        assert svc.url.startswith("http+unix://")
        with Store.open(svc.url) as s:
            assert s.init() is True
        src = tmp_path / "blob.bin"
        src.write_bytes(bytes(range(256)) * 5000)
        r = layerctl("store", "put-blob", "--store", svc.url, "--json", str(src))
        assert r.code == 0, r.err
        blob = r.json()["blob"]
        out = tmp_path / "out.bin"
        assert layerctl("store", "get-blob", "--store", svc.url, blob, str(out)).code == 0
        assert out.read_bytes() == src.read_bytes()
    # with tokens, over TCP: a read token cannot push, and says so in one line
    with running_service(str(store_dir), tmp_path / "svc2", tokens=tmp_path / "tokens.json") as svc:
        r = layerctl("store", "put-blob", "--store", svc.url, str(src), env={"LAYERSTORE_TOKEN": tokens["ro"]})
        assert_clean_failure(r, "may not write")
        assert r.code == 6
        r = layerctl("store", "put-blob", "--store", svc.url, str(src), env={"LAYERSTORE_TOKEN": tokens["ci"]})
        assert r.code == 0, r.err
        r = layerctl("store", "ls", "--store", svc.url, env={"LAYERSTORE_TOKEN": tokens["ro"]})
        assert_clean_failure(r, "needs the gc or admin scope")  # listing content (issue 27)
        r = layerctl("store", "ls", "--store", svc.url, env={"LAYERSTORE_TOKEN": tokens["gc"]})
        assert r.code == 0 and blob in r.out, r


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_two_instances_and_a_client_that_switches_mid_push(served: Served, tmp_path: Path) -> None:
    """A push starts on one instance, which dies; it goes on and ends on another; readers on
    either see the same store."""
    with running_service(str(served.store_dir), tmp_path / "b", tokens=served.tokens_file, workers=2) as other:
        payloads = [bytes([i]) * (300_000 + i) for i in range(6)]
        a = Store(HttpBackend(served.url, token=served.tokens["pushall"]))
        b = Store(HttpBackend(other.url, token=served.tokens["pushall"]))
        try:
            refs, offset = [], 0
            for i, p in enumerate(payloads):
                chunk, _ = (a if i < 3 else b).put_chunk(p)  # half on each instance
                refs.append(chunkmap.ChunkRef(offset, len(p), chunk))
                offset += len(p)
            cm = chunkmap.ChunkMap.build(refs)
            assert b.put_chunk_map(cm)  # the map, on the second, checks chunks the first stored
            manifest = a.put_manifest(json.dumps({"blobs": [cm.blob]}).encode())
            b.set_tag("team/switch:v1", manifest)
            assert a.get_tag("team/switch:v1") == manifest
            for s in (a, b):
                assert s.get_chunk_map(cm.blob).chunks == cm.chunks
                assert [s.get_chunk(r.digest) for r in cm.chunks] == payloads
        finally:
            a.close()
            b.close()
        with served.local() as local:
            assert local.verify().corrupt == []


def test_tag_compare_and_swap_over_http(served: Served) -> None:
    with served.local() as s:
        m1, m2 = s.put_manifest(b'{"cas": 1}'), s.put_manifest(b'{"cas": 2}')
    key = keys.tag_key("team/cas:v1")
    with HttpBackend(served.url, token=served.tokens["pushteam"]) as b:
        assert b.replace_if(key, (m1 + "\n").encode(), None)
        assert not b.replace_if(key, (m2 + "\n").encode(), None)
        assert not b.replace_if(key, (m2 + "\n").encode(), b"b3:" + b"0" * 64 + b"\n")
        assert b.replace_if(key, (m2 + "\n").encode(), (m1 + "\n").encode())
        assert b.load(key) == (m2 + "\n").encode()
        # the raw wire: a stale ETag is a 412 with the family's JSON
        r = b.client.put("/v1/objects/" + key, content=(m1 + "\n").encode(),
                         headers={"If-Match": f'"{digestmod.of((m1 + chr(10)).encode())}"'})
        assert r.status_code == 412 and r.json()["kind"] == "PreconditionFailed"
        etag = b.client.head("/v1/objects/" + key).headers["etag"]
        r = b.client.put("/v1/objects/" + key, content=(m1 + "\n").encode(), headers={"If-Match": etag})
        assert r.status_code == 200


def test_serve_refuses_to_listen_openly_without_tokens(tmp_path: Path) -> None:
    r = layerctl("serve", "--store", str(tmp_path / "s"), "--listen", "0.0.0.0:8471")
    assert_clean_failure(r, "--tokens is required")
    assert r.code == 2
    r = layerctl("serve", "--store", str(tmp_path / "s"), "--listen", "nonsense")
    assert_clean_failure(r, "--listen")


def test_token_commands(tmp_path: Path) -> None:
    f = str(tmp_path / "t.json")
    r = layerctl("serve", "token", "add", "--tokens", f, "--scope", "push:team/", "--scope", "lease", "ci")
    assert r.code == 0 and r.out.startswith("lst_ci_"), r
    token = r.out.strip()
    assert token not in Path(f).read_text()  # stored hashed
    assert_clean_failure(layerctl("serve", "token", "add", "--tokens", f, "--scope", "push", "x"), "bad scope")
    assert_clean_failure(layerctl("serve", "token", "add", "--tokens", f, "--scope", "read", "ci"), "exists")
    assert layerctl("serve", "token", "private", "--tokens", f, "--add", "secret/").code == 0
    ls = layerctl("serve", "token", "ls", "--tokens", f, "--json").json()
    assert ls["tokens"][0]["id"] == "ci" and ls["tokens"][0]["scopes"] == ["push:team/", "lease"]
    assert ls["private"] == ["secret/"]
    assert layerctl("serve", "token", "rm", "--tokens", f, "ci").code == 0
    assert_clean_failure(layerctl("serve", "token", "rm", "--tokens", f, "ci"), "no token")
    assert (tmp_path / "t.json").stat().st_mode & 0o077 == 0


def test_metrics_count_routes_and_bytes(served: Served) -> None:
    with HttpBackend(served.url, token=served.tokens["admin"]) as b:
        b.replace("t/metered", b"m" * 12345)
        assert b.load("t/metered") == b"m" * 12345
    text = httpx.get(served.url + "/metrics").text
    assert 'layerstore_service_requests_total{method="PUT",route="/v1/objects/{key:path}",status="200"}' in text
    received = [ln for ln in text.splitlines()
                if ln.startswith('layerstore_service_request_bytes_total{route="/v1/objects/{key:path}"}')]
    assert received and float(received[0].split()[-1]) >= 12345
    assert "layerstore_service_request_seconds_bucket" in text
    assert "t/metered" not in text  # labels are routes, never keys


def test_metrics_of_a_single_worker_service(tmp_path: Path) -> None:
    """One worker counts in its own process (no multiprocess files): /metrics still shows its
    requests (it came back empty when the one worker was told to read a directory nobody wrote)."""
    from testkit.store_service import start_service

    assert layerctl("store", "init", "--store", str(tmp_path / "store")).code == 0
    svc = start_service(str(tmp_path / "store"), tmp_path / "svc", workers=1)
    try:
        assert httpx.get(svc.url + "/healthz", timeout=30.0).status_code == 200
        text = httpx.get(svc.url + "/metrics", timeout=30.0).text
        assert 'layerstore_service_requests_total{method="GET",route="/healthz",status="200"}' in text, text[-2000:]
    finally:
        svc.stop()


def test_https(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS with --tls-cert/--tls-key; the client verifies the service (here against
    $LAYERSTORE_CA_BUNDLE) and refuses a certificate it cannot verify."""
    from testkit.oci_registry import self_signed
    from testkit.store_service import free_port, start_service

    cert, key = self_signed(tmp_path)
    port = free_port()
    svc = start_service(str(tmp_path / "store"), tmp_path / "svc", port=port, tls=(cert, key))
    try:
        url = f"https://127.0.0.1:{port}"
        monkeypatch.delenv("LAYERSTORE_CA_BUNDLE", raising=False)
        with open_backend(url) as b, pytest.raises(StoreUnavailable, match="unreachable"):
            b.policy = type(b.policy)(first=0.0, cap=0.0, attempts=1)
            b.check()
        monkeypatch.setenv("LAYERSTORE_CA_BUNDLE", str(cert))
        with Store.open(url) as s:
            s.init()
            chunk, _ = s.put_chunk(b"over tls" * 1000)
            assert s.get_chunk(chunk) == b"over tls" * 1000
    finally:
        svc.stop()
