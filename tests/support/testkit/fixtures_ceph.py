"""pytest fixtures for the real single-node Ceph started by `tests/support/testkit/ceph_cluster.py`.

- `ceph`: the session's cluster, started the first time a test asks for it and stopped at the end
  of the session (also when tests fail, and by an atexit hook if the session is torn down
  abnormally). If it cannot start, every test that needs it FAILS: CI machines have Ceph.
- `s3_store_url`: a fresh `s3://bucket/store?endpoint=...` per test: a new, empty bucket (so
  writes work before `create()`, as on a local directory). The S3 user's keys are set in the standard boto3
  environment variables for the duration of the test, so `open_backend`, `Store.open` and child
  processes (spawned while the test runs) all pick them up.
- `cephfs_store_url`: a fresh path on the ceph-fuse mount per test; like the local-directory
  store, the store directory itself does not exist yet, its parent does.

A test that uses these must carry the `ceph` mark (tests/conftest.py adds it to the users it can
see; a backend parameter reaching them through `request.getfixturevalue` carries it itself):
the per-test fixtures fail a test without it, on every machine, so that `make check` on a
machine without Ceph never meets a Ceph test.
"""

from __future__ import annotations

import atexit
import itertools
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.ceph_cluster import CephCluster, CephError

_counter = itertools.count()
# Anything that could point boto3 somewhere else than the test cluster.
_AWS_OVERRIDES = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                  "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
                  "AWS_REGION", "AWS_CA_BUNDLE")


@pytest.fixture(scope="session")
def ceph(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephCluster]:
    workdir = tmp_path_factory.mktemp("ceph")
    cluster = CephCluster(workdir)
    atexit.register(cluster.stop)
    failure = None
    try:
        cluster.start()
    except CephError as e:
        failure = str(e)
    if failure is not None:
        pytest.fail(f"the Ceph test cluster did not start: {failure}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)


def _isolated_aws_files(cluster: CephCluster) -> tuple[Path, Path]:
    """A config and credentials file of the test cluster's own, so a developer's ~/.aws cannot
    redirect the tests."""
    config = cluster.workdir / "aws-config"
    creds = cluster.workdir / "aws-credentials"
    if not config.exists():
        config.write_text("[default]\nregion = us-east-1\n")
        creds.write_text(f"[default]\naws_access_key_id = {cluster.access_key}\n"
                         f"aws_secret_access_key = {cluster.secret_key}\n")
    return config, creds


@pytest.fixture(scope="session")
def s3_client(ceph: CephCluster) -> Iterator[Any]:
    """A raw boto3 S3 client for the cluster's user (for set-up and for checking behind the
    backend's back)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=ceph.endpoint, aws_access_key_id=ceph.access_key,
                          aws_secret_access_key=ceph.secret_key, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}))
    yield client
    client.close()


@pytest.fixture
def s3_env(ceph: CephCluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard boto3 environment for the cluster's S3 user, set for this test."""
    config, creds = _isolated_aws_files(ceph)
    for name in _AWS_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    env = {**ceph.s3_env(), "AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(creds)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def require_ceph_mark(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("ceph") is None:
        pytest.fail(f"{request.node.nodeid} uses Ceph but is not marked `ceph`: mark the test, or the "
                    f"parameter that reaches the Ceph fixture, with pytest.mark.ceph", pytrace=False)


def _slug(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:24] or "test"


@pytest.fixture
def s3_bucket_name(s3_env: dict[str, str], request: pytest.FixtureRequest) -> str:
    """A bucket name nobody has used in this cluster (the bucket itself is not created)."""
    require_ceph_mark(request)
    return f"ls-{next(_counter)}-{secrets.token_hex(3)}-{_slug(request)}"[:63].rstrip("-")


@pytest.fixture
def s3_store_url(ceph: CephCluster, s3_client: Any, s3_bucket_name: str) -> str:
    """A fresh, empty bucket; the store lives under its `store/` prefix."""
    s3_client.create_bucket(Bucket=s3_bucket_name)
    return f"s3://{s3_bucket_name}/store?endpoint={ceph.endpoint}"


@pytest.fixture
def cephfs_store_url(ceph: CephCluster, request: pytest.FixtureRequest) -> str:
    require_ceph_mark(request)
    parent = ceph.mount_path / "tests" / f"{next(_counter)}-{secrets.token_hex(3)}-{_slug(request)}"
    parent.mkdir(parents=True)
    return str(parent / "store")
