"""S3-specific behaviour of `S3Backend`, against radosgw on the real single-node Ceph. The
behaviour every backend shares is in tests/test_backend_conformance.py."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ResponseStreamingError
from testkit.ceph_cluster import CephCluster

from layerstore.backends import open_backend
from layerstore.backends.s3 import S3Backend
from layerstore.errors import ConfigError, NotFound, PermissionDenied, StoreUnavailable
from layerstore.store import Store

pytestmark = pytest.mark.ceph

MiB = 1 << 20


@pytest.fixture
def bucket(s3_client: Any, s3_bucket_name: str) -> str:
    s3_client.create_bucket(Bucket=s3_bucket_name)
    return s3_bucket_name


@pytest.fixture
def make(ceph: CephCluster, s3_env: dict[str, str]) -> Iterator[Any]:
    """Build S3Backends on the test cluster; all are closed at the end of the test."""
    made: list[S3Backend] = []

    def factory(bucket: str, **kw: Any) -> S3Backend:
        kw.setdefault("endpoint", ceph.endpoint)
        b = S3Backend(bucket=bucket, prefix=kw.pop("prefix", "p"), **kw)
        made.append(b)
        return b

    yield factory
    for b in made:
        b.close()


def _data(n: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


class _Raw:
    """The raw body of a canned response."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def _canned(request: Any, status: int, code: str, message: str) -> AWSResponse:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- location ---------------------------------------------------------------------------
def test_missing_bucket_is_not_found_until_created(make: Any, s3_bucket_name: str) -> None:
    b = make(s3_bucket_name)
    with pytest.raises(NotFound, match=f"no bucket {s3_bucket_name}.*store init"):
        b.check()
    with pytest.raises(NotFound):
        b.load("k")
    with pytest.raises(NotFound):
        b.store_once("k", b"x")
    b.create()
    b.create()  # idempotent
    b.check()
    assert b.store_once("k", b"x") is True


def test_uninitialised_store_names_the_fix(ceph: CephCluster, s3_env: dict[str, str], s3_bucket_name: str) -> None:
    with Store.open(f"s3://{s3_bucket_name}/s?endpoint={ceph.endpoint}") as s:
        with pytest.raises(NotFound, match="store init"):
            s.check()
        assert s.init() is True
        s.check()


def test_url_round_trips_through_open_backend(make: Any, bucket: str) -> None:
    b = make(bucket, prefix="a/b", region="us-east-1")
    again = open_backend(b.url)
    assert isinstance(again, S3Backend)
    assert (again.bucket, again.prefix, again.endpoint, again.region) == (bucket, "a/b", b.endpoint, "us-east-1")
    again.close()


@pytest.mark.parametrize("url", [
    "s3://Upper/x?endpoint=http://127.0.0.1:1",
    "s3://ab/x?endpoint=http://127.0.0.1:1",
    "s3://bucket/x?endpoint=ftp://127.0.0.1:1",
    "s3://bucket/../x?endpoint=http://127.0.0.1:1",
])
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(url)


# -- create-once ------------------------------------------------------------------------
def test_store_once_is_a_conditional_put(make: Any, bucket: str, s3_client: Any) -> None:
    b = make(bucket)
    sent: list[dict[str, str]] = []
    b.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
    assert b.store_once("obj", b"first") is True
    assert b.store_once("obj", memoryview(b"second")) is False
    assert [h.get("If-None-Match") for h in sent] == [b"*", b"*"]
    assert s3_client.get_object(Bucket=bucket, Key="p/obj")["Body"].read() == b"first"
    b.replace("obj", b"third")
    assert b.load("obj") == b"third"


def test_store_once_falls_back_when_the_header_is_rejected(make: Any, bucket: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    b = make(bucket)

    def reject(request: Any, **_: Any) -> AWSResponse | None:
        if "If-None-Match" in request.headers:
            return _canned(request, 501, "NotImplemented", "A header you provided implies functionality that "
                           "is not implemented: If-None-Match")
        return None

    b.client.meta.events.register("before-send.s3.PutObject", reject)
    with caplog.at_level(logging.WARNING, logger="layerstore.backends.s3"):
        assert b.store_once("obj", b"first") is True
        assert b.store_once("obj", b"second") is False
        assert b.store_once("other", b"x") is True
    assert b.load("obj") == b"first"
    assert sum("If-None-Match" in r.getMessage() for r in caplog.records) == 1


# -- ranged reads and multipart ---------------------------------------------------------
def test_ranged_reads_behave_like_posix(make: Any, bucket: str) -> None:
    b = make(bucket)
    data = _data(10_000)
    b.store_once("r", data)
    assert b.load("r", 9_990, 100) == data[9_990:]
    assert b.load("r", 10_000, 5) == b""
    assert b.load("r", 10_000) == b""
    assert b.load("r", 5) == data[5:]
    b.store_once("empty", b"")
    assert b.load("empty") == b"" and b.load("empty", 0, 10) == b"" and b.load("empty", 3) == b""
    for args in [(0, None), (5, 5), (0, 0)]:
        with pytest.raises(NotFound):
            b.load("missing", *args)


def test_multipart_keeps_create_once(make: Any, bucket: str, s3_client: Any) -> None:
    b = make(bucket, multipart_threshold=6 * MiB, part_size=5 * MiB)
    completes: list[dict[str, str]] = []
    b.client.meta.events.register("before-send.s3.CompleteMultipartUpload",
                                  lambda request, **_: completes.append(dict(request.headers)))
    data = _data(12 * MiB + 123, 1)
    assert b.store_once("big", memoryview(data)) is True
    head = s3_client.head_object(Bucket=bucket, Key="p/big")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")  # three parts: it did go up in parts
    assert completes[0].get("If-None-Match") == b"*"
    assert b.load("big") == data
    assert b.load("big", 5 * MiB - 10, 20) == data[5 * MiB - 10 : 5 * MiB + 10]
    assert b.store_once("big", data) is False
    assert len(completes) == 1  # the second call looked first and uploaded nothing
    other = _data(11 * MiB, 2)
    b.replace("big", other)
    assert b.load("big") == other
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_failed_multipart_upload_is_aborted(make: Any, bucket: str, s3_client: Any) -> None:
    b = make(bucket, multipart_threshold=5 * MiB, part_size=5 * MiB, max_attempts=1)

    def fail_second_part(request: Any, **_: Any) -> AWSResponse | None:
        if "partNumber=2" in request.url:
            return _canned(request, 500, "InternalError", "injected")
        return None

    b.client.meta.events.register("before-send.s3.UploadPart", fail_second_part)
    with pytest.raises(StoreUnavailable, match="injected"):
        b.store_once("big", _data(11 * MiB, 3))
    assert not b.exists("big")
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# -- failures ---------------------------------------------------------------------------
def test_unreachable_endpoint_is_store_unavailable_quickly(s3_env: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    b = S3Backend("nobody-home", "p", endpoint=endpoint, max_attempts=2, connect_timeout=1)
    t0 = time.monotonic()
    for call in (b.check, lambda: b.load("k"), lambda: b.store_once("k", b"x"), lambda: list(b.list())):
        with pytest.raises(StoreUnavailable, match="unreachable") as info:
            call()
        assert "\n" not in str(info.value) and endpoint in str(info.value)
    assert time.monotonic() - t0 < 15
    b.close()
    # the standard boto3 setting works too
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    t0 = time.monotonic()
    with open_backend(f"s3://nobody-home/p?endpoint={endpoint}") as b2, pytest.raises(StoreUnavailable):
        b2.check()
    assert time.monotonic() - t0 < 3


def test_store_down_and_back(ceph: CephCluster, make: Any, bucket: str) -> None:
    b = make(bucket, max_attempts=2, connect_timeout=1)
    b.store_once("survivor", b"still here")
    ceph.stop_rgw()
    try:
        with pytest.raises(StoreUnavailable, match="unreachable"):
            b.load("survivor")
        with pytest.raises(StoreUnavailable):
            b.store_once("new", b"x")
    finally:
        ceph.start_rgw()
    assert b.load("survivor") == b"still here"
    assert b.store_once("new", b"x") is True


def test_broken_body_is_read_again(make: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b = make(bucket, direct_get=False)  # botocore's path (the direct GET's: test_s3_direct_get.py)
    b.store_once("k", b"payload")
    real = b.client.get_object
    calls = []

    class Broken:
        def read(self) -> bytes:
            raise ResponseStreamingError(error="connection reset mid-body")

        def close(self) -> None:
            pass

    def flaky(**kw: Any) -> Any:
        calls.append(kw)
        return {"Body": Broken()} if len(calls) == 1 else real(**kw)

    monkeypatch.setattr(b.client, "get_object", flaky)
    assert b.load("k") == b"payload"
    assert len(calls) == 2


def test_access_denied_is_permission_denied(ceph: CephCluster, make: Any, bucket: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    access, secret = ceph.create_s3_user(f"other-{bucket[:20]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    b = make(bucket)  # someone else's bucket
    with pytest.raises(PermissionDenied, match="access denied"):
        b.store_once("k", b"x")
    with pytest.raises(PermissionDenied):
        b.check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PermissionDenied):
        make(bucket).load("k")


def test_missing_credentials_are_named(make: Any, bucket: str, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Any) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(PermissionDenied, match="no S3 credentials"):
        make(bucket).check()


def test_unknown_profile_is_a_config_error(make: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(ConfigError, match="no-such-profile"):
        make(bucket).check()


# -- listing and concurrency ------------------------------------------------------------
def test_list_pages_through_small_pages(make: Any, bucket: str, s3_client: Any) -> None:
    b = make(bucket, page_size=7)
    names = [f"k/{i % 3}/n{i:03d}" for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda k: b.store_once(k, b"v"), names))
    s3_client.put_object(Bucket=bucket, Key="p/k/.foreign", Body=b"not a valid key")
    s3_client.put_object(Bucket=bucket, Key="elsewhere/k/x", Body=b"outside the prefix")
    pages: list[int] = []
    b.client.meta.events.register("before-call.s3.ListObjectsV2", lambda **_: pages.append(1))
    assert sorted(b.list()) == sorted(names)
    assert len(pages) >= 40 // 7
    assert sorted(b.list("k/1/")) == sorted(n for n in names if n.startswith("k/1/"))
    assert list(b.list("nothing/")) == []


def test_one_client_shared_by_threads(make: Any, bucket: str) -> None:
    b = make(bucket, max_pool_connections=4)
    blobs = {f"t/{i}": _data(1000 + i, i) for i in range(64)}
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda kv: b.store_once(*kv), blobs.items()))
        loaded = dict(zip(blobs, pool.map(b.load, blobs), strict=True))
    assert loaded == blobs
    assert b.client is b.client


def test_a_listing_resumes_at_the_page_that_failed(make: Any, bucket: str) -> None:
    """Pages are retried one by one (with their continuation token), not the whole listing."""
    b = make(bucket, page_size=3)
    for i in range(10):
        b.store_once(f"k{i:02d}", b"x")
    seen: list[str] = []

    def fail_third_page_once(request: Any, **_: Any) -> AWSResponse | None:
        seen.append(request.url)
        if len(seen) == 3:
            return _canned(request, 503, "SlowDown", "injected")
        return None

    b.client.meta.events.register("before-send.s3.ListObjectsV2", fail_third_page_once)
    assert sorted(b.list()) == [f"k{i:02d}" for i in range(10)]
    assert len(seen) == 5  # 4 pages, the third asked twice
    assert "continuation-token" in seen[2] and seen[2] == seen[3]
