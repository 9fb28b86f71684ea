"""The registry client against a real registry (Debian's docker-registry on loopback): references,
credentials, pull and push anonymously, with Bearer token auth and with Basic (htpasswd) auth,
chunked uploads, and an image pulled through `docker://` into the same layers as its OCI layout."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.oci_registry import Registry, needs_registry, oci_registry
from testkit.registry_images import busybox_layout, push_layout

from erofs_builder.sources.registry import (
    OCI_MANIFEST,
    Credentials,
    Reference,
    RegistryClient,
    credentials_for,
    is_insecure,
)
from erofs_builder.sources.source_oci import image_layers
from erofs_builder.sources.source_registry import registry_image
from layerstore.errors import BadInput, ConfigError, NotFound, PermissionDenied, StoreUnavailable


# -- pure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    ("127.0.0.1:5000/busybox", ("127.0.0.1:5000", "busybox", "latest", None)),
    ("registry.example.org/team/tools:v1.2-rc_3", ("registry.example.org", "team/tools", "v1.2-rc_3", None)),
    ("localhost/a/b/c@sha256:" + "a" * 64, ("localhost", "a/b/c", None, "sha256:" + "a" * 64)),
    ("[::1]:5000/x:1@sha256:" + "b" * 64, ("[::1]:5000", "x", "1", "sha256:" + "b" * 64)),
])
def test_reference_parse(text: str, want: tuple[str, str, str | None, str | None]) -> None:
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == want
    assert Reference.parse(str(ref)) == ref
    assert ref.reference == (want[3] or want[2])


@pytest.mark.parametrize("text", [
    "busybox", "busybox:1", "library/busybox",  # no registry: never an implicit Docker Hub
    "r.io/Busybox", "r.io/a/../b", "r.io/a:b:c", "r.io/a:" + "t" * 129, "r.io/a@sha256:abc",
    "r.io/a@md5:" + "0" * 32, "r_io:5000/a", "r.io/a b", "r.io/" + "a/" * 200 + "a", "r.io/a%2f..",
])
def test_reference_parse_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        Reference.parse(text)


def test_insecure_only_for_loopback_or_listed() -> None:
    assert is_insecure("127.0.0.1:5000", {}) and is_insecure("localhost", {}) and is_insecure("[::1]:80", {})
    assert not is_insecure("registry.example.org", {}) and not is_insecure("10.0.0.1:5000", {})
    listed = {"LAYERSTORE_INSECURE_REGISTRIES": "10.0.0.1:5000, reg.lan"}
    assert is_insecure("10.0.0.1:5000", listed) and is_insecure("reg.lan:443", listed)
    assert not is_insecure("10.0.0.1:5001", listed)
    assert RegistryClient("registry.example.org", auth=None).base == "https://registry.example.org"


def test_credentials_from_env_then_docker_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"auths": {
        "r.example:5000": {"auth": base64.b64encode(b"alice:pa:ss").decode()},
        "https://old.example/v1/": {"username": "bob", "password": "pw"}}}))
    env = {"DOCKER_CONFIG": str(tmp_path)}
    assert credentials_for("r.example:5000", env) == Credentials("alice", "pa:ss")
    assert credentials_for("old.example", env) == Credentials("bob", "pw")
    assert credentials_for("other.example", env) is None
    assert credentials_for("r.example:5000", {**env, "LAYERSTORE_REGISTRY_USER": "carol",
                                              "LAYERSTORE_REGISTRY_PASSWORD": "x"}) == Credentials("carol", "x")
    assert credentials_for("r.example:5000", {"REGISTRY_AUTH_FILE": str(cfg)}) == Credentials("alice", "pa:ss")
    assert "pa:ss" not in repr(credentials_for("r.example:5000", env))
    assert credentials_for("r.example:5000", {"DOCKER_CONFIG": str(tmp_path / "none")}) is None
    cfg.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a registry auth file"):
        credentials_for("r.example:5000", env)


# -- against a real registry --------------------------------------------------------------------
@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The testkit's three-layer busybox image as an OCI layout."""
    root = tmp_path_factory.mktemp("image")
    busybox_layout(root / "layout", root / "work")
    return root / "layout"


@pytest.fixture(scope="module")
def anon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if not os.path.exists("/usr/bin/docker-registry"):
        pytest.skip("needs docker-registry")
    with oci_registry(tmp_path_factory.mktemp("anon")) as reg:
        yield reg


def _manifest(layout: Path) -> tuple[bytes, dict]:
    digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    body = (layout / "blobs/sha256" / digest.split(":")[1]).read_bytes()
    return body, json.loads(body)


@needs_registry
def test_push_and_pull_anonymously(anon: Registry, image: Path, tmp_path: Path) -> None:
    digest = push_layout(image, anon.host, "t/anon", "1")
    body, manifest = _manifest(image)
    with RegistryClient(anon.host) as reg:
        assert reg.get_manifest("t/anon", "1") == (body, OCI_MANIFEST, digest)
        assert reg.get_manifest("t/anon", digest) == (body, OCI_MANIFEST, digest)
        layer = manifest["layers"][0]
        assert reg.blob_exists("t/anon", layer["digest"])
        assert not reg.blob_exists("t/anon", "sha256:" + "0" * 64)
        size = reg.fetch_blob("t/anon", layer["digest"], tmp_path / "layer", layer["size"],
                              expected_size=layer["size"])
        assert size == layer["size"]
        assert (tmp_path / "layer").read_bytes() == (image / "blobs/sha256" / layer["digest"][7:]).read_bytes()
        with pytest.raises(NotFound, match="not found"):
            reg.get_manifest("t/anon", "2")
        with pytest.raises(NotFound):
            reg.fetch_blob("t/anon", "sha256:" + "0" * 64, tmp_path / "missing", 10)
        assert not (tmp_path / "missing").exists()
        # the same push again uploads nothing new and gives the same digest
        assert push_layout(image, anon.host, "t/anon", "1") == digest


@needs_registry
def test_fetch_refuses_a_blob_over_its_limit_and_keeps_nothing(anon: Registry, image: Path, tmp_path: Path) -> None:
    push_layout(image, anon.host, "t/limit", "1")
    layer = _manifest(image)[1]["layers"][0]
    with RegistryClient(anon.host) as reg:
        with pytest.raises(BadInput, match="more than the limit of 1000 bytes"):
            reg.fetch_blob("t/limit", layer["digest"], tmp_path / "x", 1000)
        with pytest.raises(BadInput, match="over the limit"):
            reg.fetch_blob("t/limit", layer["digest"], tmp_path / "x", 1000, expected_size=layer["size"])
        with pytest.raises(BadInput, match="size mismatch"):
            reg.fetch_blob("t/limit", layer["digest"], tmp_path / "x", 1 << 30, expected_size=layer["size"] + 1)
    assert list(tmp_path.iterdir()) == []


@needs_registry
def test_chunked_push_round_trips(anon: Registry, tmp_path: Path) -> None:
    data = os.urandom(300_001)
    path = tmp_path / "blob"
    path.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with RegistryClient(anon.host, chunk_size=64 << 10) as reg:
        assert reg.push_blob("t/chunks", path) == digest
        assert reg.push_blob("t/chunks", data, digest) == digest  # exists: skipped
        out = io.BytesIO()
        assert reg.fetch_blob("t/chunks", digest, out, len(data)) == len(data)
        assert out.getvalue() == data
        with pytest.raises(BadInput):  # the registry checks the digest it is told
            reg.push_blob("t/chunks", b"other bytes", "sha256:" + "1" * 64)


@needs_registry
def test_pull_of_a_registry_image_gives_the_layouts_layers(anon: Registry, image: Path) -> None:
    digest = push_layout(image, anon.host, "t/image", "2")
    pulled = registry_image(f"docker://{anon.ref('t/image', '2')}")
    local = image_layers(f"oci:{image}")
    assert pulled.source.endswith("@" + digest)
    assert pulled.config == local.config
    assert [(la.digest, la.diff_id, la.size) for la in pulled.layers] == \
        [(la.digest, la.diff_id, la.size) for la in local.layers]
    for a, b in zip(pulled.layers, local.layers, strict=True):
        assert [(e.path, e.kind, e.mode) for e, _ in a.entries()] == [(e.path, e.kind, e.mode) for e, _ in b.entries()]


@needs_registry
def test_token_auth_flow(tmp_path: Path, image: Path) -> None:
    with oci_registry(tmp_path / "reg", auth="token") as reg:
        creds = Credentials(reg.user, reg.password)
        digest = push_layout(image, reg.host, "t/tok", "1", auth=creds)
        asked = {(who, scope.rsplit(":", 1)[0], frozenset(scope.rsplit(":", 1)[1].split(",")))
                 for who, scope in reg.token_requests}
        assert (reg.user, "repository:t/tok", frozenset({"pull", "push"})) in asked
        with RegistryClient(reg.host, auth=creds) as c:
            assert c.get_manifest("t/tok", "1")[2] == digest
        with RegistryClient(reg.host, auth=None) as c, pytest.raises(PermissionDenied):
            c.get_manifest("t/tok", "1")  # anonymous: a token without pull rights, then 401
        with RegistryClient(reg.host, auth=Credentials(reg.user, "wrong")) as c, \
                pytest.raises(PermissionDenied, match="refused the credentials"):
            c.get_manifest("t/tok", "1")
        # credentials from a docker config file, as `layerctl build docker://` finds them
        reg.docker_config(tmp_path / "docker" / "config.json")
        os.environ["DOCKER_CONFIG"] = str(tmp_path / "docker")
        try:
            assert registry_image(f"docker://{reg.ref('t/tok', '1')}").source.endswith(digest)
        finally:
            del os.environ["DOCKER_CONFIG"]


@needs_registry
def test_token_auth_anonymous_pull(tmp_path: Path, image: Path) -> None:
    with oci_registry(tmp_path / "reg", auth="token", anonymous_pull=True) as reg:
        digest = push_layout(image, reg.host, "t/pub", "1", auth=Credentials(reg.user, reg.password))
        with RegistryClient(reg.host, auth=None) as c:
            assert c.get_manifest("t/pub", "1")[2] == digest
            with pytest.raises(PermissionDenied):
                c.push_blob("t/pub", b"anonymous push")
        assert (None, "repository:t/pub:pull") in reg.token_requests


@needs_registry
def test_basic_auth(tmp_path: Path, image: Path) -> None:
    with oci_registry(tmp_path / "reg", auth="htpasswd") as reg:
        digest = push_layout(image, reg.host, "t/basic", "1", auth=Credentials(reg.user, reg.password))
        with RegistryClient(reg.host, auth=Credentials(reg.user, reg.password)) as c:
            assert c.get_manifest("t/basic", "1")[2] == digest
        with RegistryClient(reg.host, auth=None) as c, pytest.raises(PermissionDenied, match="wants credentials"):
            c.get_manifest("t/basic", "1")
        with RegistryClient(reg.host, auth=Credentials(reg.user, "nope")) as c, pytest.raises(PermissionDenied):
            c.get_manifest("t/basic", "1")


def test_unreachable_registry_is_unavailable() -> None:
    from testkit.oci_registry import free_port

    with RegistryClient(f"127.0.0.1:{free_port()}", auth=None, timeout=2) as c, \
            pytest.raises(StoreUnavailable, match="cannot reach"):
        c.get_manifest("t/x", "1")


@needs_registry
def test_an_index_in_the_registry_resolves_to_this_platform(anon: Registry, image: Path) -> None:
    digest = push_layout(image, anon.host, "t/multi", "amd64")
    body, manifest = _manifest(image)
    other = json.dumps({**manifest, "annotations": {"variant": "arm"}}).encode()
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"mediaType": OCI_MANIFEST, "digest": "sha256:" + hashlib.sha256(other).hexdigest(), "size": len(other),
         "platform": {"os": "linux", "architecture": "arm64"}},
        {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body),
         "platform": {"os": "linux", "architecture": "amd64"}}]}
    with RegistryClient(anon.host) as reg:
        reg.put_manifest("t/multi", "sha256:" + hashlib.sha256(other).hexdigest(), other, OCI_MANIFEST)
        index_digest = reg.put_manifest("t/multi", "1", json.dumps(index).encode(),
                                        "application/vnd.oci.image.index.v1+json")
    assert registry_image(f"docker://{anon.ref('t/multi', '1')}").source.endswith("@" + digest)
    pinned = registry_image(f"docker://{anon.host}/t/multi@{index_digest}")
    assert pinned.source.endswith("@" + digest)


@needs_registry
def test_https_registry_checked_against_the_given_ca(tmp_path: Path, image: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with oci_registry(tmp_path / "reg", tls=True) as reg:
        assert reg.ca is not None
        with RegistryClient(reg.host, insecure=False, auth=None) as c, \
                pytest.raises(StoreUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            c.get_manifest("t/tls", "1")  # a certificate no CA we trust signed
        monkeypatch.setenv("LAYERSTORE_REGISTRY_CA", str(reg.ca))
        digest = push_layout(image, reg.host, "t/tls", "1", insecure=False, auth=None)
        with RegistryClient(reg.host, insecure=False, auth=None) as c:
            assert c.base.startswith("https://")
            assert c.get_manifest("t/tls", "1")[2] == digest
        monkeypatch.setenv("LAYERSTORE_REGISTRY_CA", str(tmp_path / "missing.pem"))
        with pytest.raises(ConfigError, match="not a readable PEM bundle"):
            RegistryClient(reg.host, insecure=False, auth=None)
