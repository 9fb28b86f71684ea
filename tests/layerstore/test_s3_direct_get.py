"""The S3 backend's direct GET (layerstore/backends/s3_get.py): used where it can be, the same
answers as botocore's path, and every hostile or broken answer refused as before. Against RGW on
the real single-node Ceph, and against a small fake S3 endpoint that answers whatever a test
wants (a store cannot be made to lie about its lengths otherwise)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from testkit.ceph_cluster import CephCluster

from layerstore.backends.s3 import S3Backend
from layerstore.backends.s3_get import usable
from layerstore.errors import CorruptObject, NotFound, StoreUnavailable

MiB = 1 << 20
Answer = Callable[[str], bytes]  # the request's first line -> the raw HTTP response


class FakeS3:
    """A loopback HTTP endpoint: each request is answered by `answer`, raw bytes, then the
    connection is closed; every request line is recorded."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    more = conn.recv(65536)
                    if not more:
                        break
                    head += more
                line = head.split(b"\r\n", 1)[0].decode()
                self.requests.append(line)
                with contextlib.suppress(OSError):  # the client hung up first (as on a too-long body)
                    conn.sendall(self.answer(line))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Answer], tuple[FakeS3, S3Backend]]]:
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    made: list[tuple[FakeS3, S3Backend]] = []

    def factory(answer: Answer) -> tuple[FakeS3, S3Backend]:
        server = FakeS3(answer)
        backend = S3Backend("bucket", "p", endpoint=server.endpoint, max_attempts=2, read_timeout=5)
        made.append((server, backend))
        return server, backend

    yield factory
    for server, backend in made:
        backend.close()
        server.close()


def _response(status: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "Connection: close", "", ""]
    return "\r\n".join(lines).encode() + body


def test_declared_length_above_the_limit_is_refused_before_the_body(fake: Any) -> None:
    # 8 GiB declared, 10 bytes sent: refused from the headers, no attempt to read 8 GiB.
    server, b = fake(lambda _: _response("200 OK", {"Content-Length": str(8 << 30)}, b"x" * 10))
    with pytest.raises(CorruptObject, match="more than such an object can have"):
        b.load("k", max_size=MiB)
    assert len(server.requests) == 1  # not retried, not asked through botocore again


def test_ranged_answer_whose_object_is_above_the_limit_is_refused(fake: Any) -> None:
    server, b = fake(lambda _: _response("206 Partial Content", {"Content-Length": "4",
                                                                  "Content-Range": f"bytes 0-3/{8 << 30}"}, b"abcd"))
    with pytest.raises(CorruptObject):
        b.load("k", 0, 4, max_size=MiB)


def test_undeclared_body_longer_than_the_limit_is_refused(fake: Any) -> None:
    def chunked(_: str) -> bytes:
        piece = b"y" * 65536
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        return _response("200 OK", {"Transfer-Encoding": "chunked"}, chunk * 20 + b"0\r\n\r\n")

    _server, b = fake(chunked)
    with pytest.raises(CorruptObject):
        b.load("k", max_size=MiB)
    assert len(b.load("k", max_size=2 * MiB)) == 20 * 65536  # within the limit: read whole


def test_body_that_ends_early_is_retried_then_unavailable(fake: Any) -> None:
    server, b = fake(lambda _: _response("200 OK", {"Content-Length": "1000"}, b"z" * 10))
    with pytest.raises(StoreUnavailable):
        b.load("k", max_size=MiB)
    assert len(server.requests) == 2  # max_attempts: a broken body is temporary


def test_error_status_is_answered_by_botocore(fake: Any) -> None:
    # A 404 from the direct GET: botocore asks again and its answer is translated as before.
    xml = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>no</Message></Error>"
    server, b = fake(lambda _: _response("404 Not Found", {"Content-Length": str(len(xml)),
                                                           "Content-Type": "application/xml"}, xml))
    with pytest.raises(NotFound, match="object k: not found"):
        b.load("k")
    assert len(server.requests) == 2
    assert all(r.startswith("GET /bucket/p/k ") for r in server.requests)


def test_server_errors_are_retried_and_unavailable(fake: Any) -> None:
    xml = b"<Error><Code>SlowDown</Code><Message>slow down</Message></Error>"
    server, b = fake(lambda _: _response("503 Slow Down", {"Content-Length": str(len(xml))}, xml))
    with pytest.raises(StoreUnavailable, match="slow down"):
        b.load("k")
    assert len(server.requests) == 2  # 2 attempts, each one request: no more load on a throttling store


def test_server_error_without_a_document_is_unavailable(fake: Any) -> None:
    server, b = fake(lambda _: _response("500 Internal Server Error", {"Content-Length": "0"}, b""))
    with pytest.raises(StoreUnavailable, match="Internal Server Error"):
        b.load("k")
    assert len(server.requests) == 2


def test_client_config_checks_no_transport_checksum(fake: Any) -> None:
    _server, b = fake(lambda _: b"")
    config = b.client.meta.config
    assert config.response_checksum_validation == "when_required"
    assert config.request_checksum_calculation == "when_required"


@pytest.mark.ceph
def test_reads_from_rgw_go_direct_and_match(ceph: CephCluster, s3_env: dict[str, str], s3_client: Any,
                                            s3_bucket_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    s3_client.create_bucket(Bucket=s3_bucket_name)
    data = random.Random(7).randbytes(MiB + 17)
    with S3Backend(s3_bucket_name, "p", endpoint=ceph.endpoint) as b:
        assert b.store_once("k/obj", data)
        sent: list[str] = []
        b.client.meta.events.register("before-send.s3.GetObject", lambda request, **_: sent.append(request.url))
        assert b.load("k/obj", max_size=2 * MiB) == data
        assert b.load("k/obj", 100, 1000) == data[100:1100]
        assert b.load("k/obj", MiB, 1000) == data[MiB:]  # past the end: cut like a POSIX read
        assert sent == []  # all three went direct (SigV4 accepted by RGW)
        assert b.load("k/obj", len(data) + 5, 10) == b""  # 416: botocore's path, as before
        with pytest.raises(CorruptObject):
            b.load("k/obj", max_size=MiB)
        with pytest.raises(NotFound):
            b.load("k/none")
        assert len(sent) == 2
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # a proxy: botocore's path (it knows proxies)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with S3Backend(s3_bucket_name, "p", endpoint=ceph.endpoint) as b:
        sent2: list[str] = []
        b.client.meta.events.register("before-send.s3.GetObject", lambda request, **_: sent2.append(request.url))
        assert b.load("k/obj") == data
        assert len(sent2) == 1


def test_direct_get_only_where_its_request_is_botocores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    assert usable("http://127.0.0.1:7480", True, "s3v4")
    assert usable("https://rgw.example:443", True, None)
    assert not usable(None, True, None)  # AWS's own endpoints: botocore resolves them
    assert not usable("http://127.0.0.1:7480", False, None)  # virtual-hosted addressing
    assert not usable("http://127.0.0.1:7480", True, "s3")  # SigV2
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not usable("http://127.0.0.1:7480", True, None)
