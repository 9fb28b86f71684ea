"""A hostile registry (an httpx mock transport playing the server): whatever it sends that is not
what was asked for, or more than the limits allow, is refused with one clear error, and nothing
of it is kept or used."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from erofs_builder.sources.registry import DOCKER_LIST, OCI_INDEX, OCI_MANIFEST, Credentials, RegistryClient
from erofs_builder.sources.source_oci import MAX_CONFIG_JSON, MAX_LAYERS
from erofs_builder.sources.source_registry import MAX_LAYER_BLOB, registry_image
from layerstore.errors import BadInput, ConfigError, LayerstoreError, PermissionDenied, StoreUnavailable

HOST = "reg.example"
Handler = Callable[[httpx.Request], httpx.Response | None]


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeRegistry:
    """Serves `manifests` (ref -> (body, media type)) and `blobs` (digest -> bytes); `hook` may
    answer a request first (the hostile part). Records every request."""

    def __init__(self) -> None:
        self.manifests: dict[str, tuple[bytes, str]] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[httpx.Request] = []
        self.hook: Handler = lambda request: None

    def add_manifest(self, tag: str, doc: object, media: str = OCI_MANIFEST) -> str:
        body = json.dumps(doc).encode()
        self.manifests[tag] = self.manifests[sha(body)] = (body, media)
        return sha(body)

    def add_blob(self, data: bytes) -> dict[str, object]:
        self.blobs[sha(data)] = data
        return {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha(data), "size": len(data)}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        """An answer streamed as from the network (a response made from bytes counts as read)."""
        r = self.answer(request)
        if isinstance(r.stream, httpx.ByteStream):
            body = r.content
            r = httpx.Response(r.status_code, headers=r.headers, content=iter([body] if body else []))
        return r

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        hooked = self.hook(request)
        if hooked is not None:
            return hooked
        path = request.url.path
        if "/manifests/" in path:
            ref = path.rsplit("/", 1)[1]
            if ref in self.manifests:
                body, media = self.manifests[ref]
                return httpx.Response(200, content=body, headers={"Content-Type": media})
        if "/blobs/" in path and path.rsplit("/", 1)[1] in self.blobs:
            return httpx.Response(200, content=self.blobs[path.rsplit("/", 1)[1]])
        return httpx.Response(404, json={"errors": [{"code": "NOT_FOUND", "message": "nope"}]})

    def client(self, registry: str = HOST, **kw: object) -> RegistryClient:
        kw.setdefault("auth", None)
        return RegistryClient(registry, transport=httpx.MockTransport(self), **kw)  # type: ignore[arg-type]


@pytest.fixture
def fake() -> FakeRegistry:
    return FakeRegistry()


def _tar(name: str, data: bytes) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _image(fake: FakeRegistry, tag: str = "1", layers: int = 1, **config_extra: object) -> tuple[str, list[bytes]]:
    tars = [_tar(f"f{i}", b"x" * i) for i in range(layers)]
    config = json.dumps({"config": {"Cmd": ["/bin/sh"]}, "rootfs": {"type": "layers",
                         "diff_ids": [sha(t) for t in tars]}, **config_extra}).encode()
    fake.blobs[sha(config)] = config
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config),
                           "size": len(config)},
                "layers": [fake.add_blob(t) for t in tars]}
    return fake.add_manifest(tag, manifest), tars


def _pull(fake: FakeRegistry, ref: str = "1") -> object:
    sep = "@" if ref.startswith("sha256:") else ":"
    return registry_image(f"docker://{HOST}/t/img{sep}{ref}", connect=lambda host: fake.client(host))


def _consume(image: object) -> None:
    for layer in image.layers:  # type: ignore[attr-defined]
        for _ in layer.entries():
            pass


# -- manifests ---------------------------------------------------------------------------------
def test_an_honest_image_pulls(fake: FakeRegistry) -> None:
    digest, _ = _image(fake, layers=2)
    image = _pull(fake)
    _consume(image)
    assert image.source.endswith(digest) and image.config["cmd"] == ["/bin/sh"]  # type: ignore[attr-defined]
    assert all(r.url.scheme == "https" for r in fake.requests)  # not loopback: HTTPS only


def test_manifest_not_matching_the_digest_asked_for(fake: FakeRegistry) -> None:
    digest, _ = _image(fake)
    fake.manifests[digest] = (b'{"schemaVersion": 2, "evil": 1}', OCI_MANIFEST)
    with pytest.raises(BadInput, match="digest mismatch"):
        _pull(fake, digest)


def test_docker_content_digest_disagreeing(fake: FakeRegistry) -> None:
    _image(fake)
    body, media = fake.manifests["1"]
    fake.hook = lambda r: httpx.Response(200, content=body, headers={
        "Content-Type": media, "Docker-Content-Digest": "sha256:" + "0" * 64}) if "/manifests/" in r.url.path else None
    with pytest.raises(BadInput, match="Docker-Content-Digest"):
        _pull(fake)


def test_oversized_manifest_is_cut_off(fake: FakeRegistry) -> None:
    sent = []

    def endless() -> Iterator[bytes]:
        while True:
            sent.append(1)
            yield b" " * (1 << 16)

    fake.hook = lambda r: httpx.Response(200, content=endless(), headers={"Content-Type": OCI_MANIFEST,
                                                                           "Content-Length": "10"})
    with pytest.raises(BadInput, match="more than 4194304 bytes"):
        _pull(fake)
    assert len(sent) < 80  # stopped at the limit, not at the end of an endless stream


def test_a_compressed_body_is_never_inflated(fake: FakeRegistry) -> None:
    import gzip

    bomb = gzip.compress(b" " * (16 << 20), compresslevel=1)  # 16 MiB of spaces (4 times the cap) in ~70 KiB
    fake.hook = lambda r: httpx.Response(200, content=iter([bomb]), headers={"Content-Type": OCI_MANIFEST,
                                                                              "Content-Encoding": "gzip"})
    with pytest.raises(BadInput, match="not JSON"):  # the bytes as sent: gzip, not a manifest
        _pull(fake)
    assert all(r.headers["Accept-Encoding"] == "identity" for r in fake.requests)


@pytest.mark.parametrize(("doc", "media", "needle"), [
    ({"schemaVersion": 1, "fsLayers": []}, "application/vnd.docker.distribution.manifest.v1+prettyjws",
     "unsupported manifest media type"),
    ({"schemaVersion": 2, "manifests": [{"digest": "sha256:" + "a" * 64, "size": 1,
                                         "platform": {"os": "linux", "architecture": "s390x"}}]},
     OCI_INDEX, "no image for linux/amd64"),
    ({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"digest": "sha256:" + "a" * 64, "size": 1},
      "layers": [{"digest": "sha256:" + "b" * 64, "size": 1}] * (MAX_LAYERS + 1)},
     OCI_MANIFEST, f"at most {MAX_LAYERS}"),
    ({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
      "config": {"digest": "sha256:" + "a" * 64, "size": MAX_CONFIG_JSON + 1}, "layers": [{}]},
     OCI_MANIFEST, "over the limit"),
    ({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"digest": "sha256:" + "a" * 64, "size": 1},
      "layers": [{"digest": "sha256:" + "b" * 64, "size": MAX_LAYER_BLOB + 1}]}, OCI_MANIFEST, "over the limit"),
    ({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"digest": "sha256:" + "a" * 64, "size": 1},
      "layers": [{"digest": "sha256:" + "b" * 64, "size": 1, "mediaType": "application/x-sh"}]}, OCI_MANIFEST,
     "unsupported media type 'application/x-sh'"),
    ({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"digest": "../../etc/passwd", "size": 1},
      "layers": [{}]}, OCI_MANIFEST, "bad digest"),
    ({"schemaVersion": 2, "mediaType": OCI_INDEX, "config": {}, "layers": []}, OCI_MANIFEST,
     "not an image manifest"),
    ([1, 2, 3], OCI_MANIFEST, "not a JSON object"),
])
def test_hostile_manifests(fake: FakeRegistry, doc: object, media: str, needle: str) -> None:
    fake.add_manifest("1", doc, media)
    with pytest.raises(BadInput, match=needle):
        _pull(fake)
    assert not any("/blobs/" in r.url.path for r in fake.requests)  # refused before any blob is fetched


def test_deeply_nested_manifest(fake: FakeRegistry) -> None:
    fake.manifests["1"] = (b"[" * 100_000 + b"]" * 100_000, OCI_MANIFEST)
    with pytest.raises(BadInput, match="nested too deeply"):
        _pull(fake)


def test_index_picks_linux_amd64_and_checks_its_descriptor(fake: FakeRegistry) -> None:
    digest, _ = _image(fake, tag="amd64")
    body = fake.manifests[digest][0]
    arm = fake.add_manifest("arm", {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {}, "layers": []})
    entries = [{"mediaType": OCI_MANIFEST, "digest": arm, "size": 10,
                "platform": {"os": "linux", "architecture": "arm64"}},
               {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body),
                "platform": {"os": "linux", "architecture": "amd64"}}]
    fake.add_manifest("1", {"schemaVersion": 2, "manifests": entries}, DOCKER_LIST)
    assert _pull(fake).source.endswith(digest)  # type: ignore[attr-defined]
    entries[1]["size"] = len(body) + 1
    fake.add_manifest("1", {"schemaVersion": 2, "manifests": entries}, OCI_INDEX)
    with pytest.raises(BadInput, match="the index says"):
        _pull(fake)


def test_config_not_matching_the_layers(fake: FakeRegistry) -> None:
    _image(fake, layers=2)
    manifest = json.loads(fake.manifests["1"][0])
    manifest["layers"] = manifest["layers"][:1]
    fake.add_manifest("1", manifest)
    with pytest.raises(BadInput, match="2 diff_ids for 1 layers"):
        _pull(fake)


# -- blobs --------------------------------------------------------------------------------------
def test_layer_with_wrong_content_never_reaches_the_tar_reader(fake: FakeRegistry) -> None:
    _, tars = _image(fake)
    evil = _tar("etc/passwd", b"root::0:0::/:/bin/sh\n")[:len(tars[0])].ljust(len(tars[0]), b"\0")
    fake.blobs[sha(tars[0])] = evil
    image = _pull(fake)
    with pytest.raises(BadInput, match=f"reg.example/t/img: blob {sha(tars[0])}: digest mismatch"):
        _consume(image)  # refused by the download's check, before the tar reader's own


def test_blob_longer_than_its_descriptor_is_cut_off(fake: FakeRegistry, tmp_path: Path) -> None:
    _, tars = _image(fake)
    sent = []

    def endless() -> Iterator[bytes]:
        while True:
            sent.append(1)
            yield b"\0" * (1 << 20)

    fake.hook = lambda r: httpx.Response(200, content=endless()) if r.url.path.endswith(sha(tars[0])) else None
    with pytest.raises(BadInput, match=f"its descriptor size of {len(tars[0])} bytes"):
        _consume(_pull(fake))
    assert len(sent) <= 2
    with fake.client() as c, pytest.raises(BadInput, match="more than the limit"):
        c.fetch_blob("t/img", sha(tars[0]), tmp_path / "blob", 5 << 20)
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_layer_larger_than_the_free_space_is_refused_before_download(fake: FakeRegistry,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _, tars = _image(fake)
    manifest = json.loads(fake.manifests["1"][0])
    manifest["layers"][0]["size"] = 10 << 30
    fake.add_manifest("1", manifest)
    real = os.statvfs

    def little_free(path: str) -> os.statvfs_result:
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 1000, 1000, *st[5:]))

    monkeypatch.setattr(os, "statvfs", little_free)
    with pytest.raises(ConfigError, match="more than is free"):
        _consume(_pull(fake))
    assert not any(r.url.path.endswith(sha(tars[0])) for r in fake.requests)


def test_server_errors_are_retried_then_unavailable(fake: FakeRegistry) -> None:
    fake.hook = lambda r: httpx.Response(503)
    with fake.client() as c, pytest.raises(StoreUnavailable, match="HTTP 503"):
        c.get_manifest("t/img", "1")
    assert len(fake.requests) == 3


# -- auth and redirects -------------------------------------------------------------------------
def test_redirect_drops_credentials_and_never_downgrades(fake: FakeRegistry, tmp_path: Path) -> None:
    data = b"blob bytes"
    digest = sha(data)
    creds = Credentials("alice", "pw")

    def hook(r: httpx.Request) -> httpx.Response | None:
        if r.url.host == HOST and not r.headers.get("Authorization"):
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="x"'})
        if r.url.host == HOST:
            return httpx.Response(307, headers={"Location": "https://cdn.example/blob"})
        if r.url.host == "cdn.example":
            return httpx.Response(200, content=data)
        return None

    fake.hook = hook
    with fake.client(auth=creds) as c:
        assert c.fetch_blob("t/img", digest, tmp_path / "b", 100) == len(data)
    cdn = [r for r in fake.requests if r.url.host == "cdn.example"]
    assert cdn and all("Authorization" not in r.headers for r in cdn)
    fake.hook = lambda r: httpx.Response(302, headers={"Location": "http://cdn.example/blob"})
    with fake.client() as c, pytest.raises(BadInput, match="refused redirect"):
        c.fetch_blob("t/img", digest, tmp_path / "c", 100)


def test_token_realm_over_plain_http_is_refused(fake: FakeRegistry) -> None:
    fake.hook = lambda r: httpx.Response(401, headers={
        "WWW-Authenticate": 'Bearer realm="http://auth.example/token",service="reg"'})
    with fake.client(auth=Credentials("alice", "pw")) as c, pytest.raises(PermissionDenied, match="plain HTTP"):
        c.get_manifest("t/img", "1")
    assert not any(r.url.host == "auth.example" for r in fake.requests)


def test_token_response_without_a_token(fake: FakeRegistry) -> None:
    def hook(r: httpx.Request) -> httpx.Response | None:
        if r.url.host == "auth.example":
            return httpx.Response(200, json={"token": 17})
        return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="https://auth.example/t",service="s"'})

    fake.hook = hook
    with fake.client() as c, pytest.raises(BadInput, match="no usable token"):
        c.get_manifest("t/img", "1")


def test_upload_location_on_another_origin_is_refused(fake: FakeRegistry) -> None:
    def hook(r: httpx.Request) -> httpx.Response | None:
        if r.method == "POST":
            return httpx.Response(202, headers={"Location": "https://elsewhere.example/upload/1"})
        return None

    fake.hook = hook
    with fake.client() as c, pytest.raises(BadInput, match="another origin"):
        c.push_blob("t/img", b"data")
    assert not any(r.url.host == "elsewhere.example" for r in fake.requests)


# -- any document ------------------------------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=20)
    | st.sampled_from(["sha256:" + "a" * 64, OCI_MANIFEST, OCI_INDEX, "linux", "amd64",
                       "application/vnd.oci.image.layer.v1.tar"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["schemaVersion", "mediaType", "config", "layers", "manifests", "digest", "size",
                         "platform", "os", "architecture", "rootfs", "diff_ids"]), inner, max_size=6),
    max_leaves=30)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(doc=_json_values, media=st.sampled_from([OCI_MANIFEST, OCI_INDEX, DOCKER_LIST, "application/json", ""]))
def test_any_manifest_document_gives_a_project_error(doc: object, media: str) -> None:
    fake = FakeRegistry()
    fake.add_manifest("1", doc, media)
    fake.blobs["sha256:" + "a" * 64] = json.dumps(doc).encode()
    with contextlib.suppress(LayerstoreError):  # anything else (TypeError, KeyError, ...) fails the test
        _consume(_pull(fake))


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_almost_valid_image_gives_a_project_error_or_builds(data: st.DataObject) -> None:
    """A valid image with some descriptor fields and config values replaced."""
    fake = FakeRegistry()
    _, tars = _image(fake, layers=2)
    manifest = json.loads(fake.manifests["1"][0])
    config = json.loads(fake.blobs[manifest["config"]["digest"]])
    odd = st.one_of(_json_values, st.integers(-1, 1 << 40))
    for desc in [manifest["config"], *manifest["layers"]]:
        for key in ("digest", "size", "mediaType"):
            if data.draw(st.booleans()):
                desc[key] = data.draw(odd)
    if data.draw(st.booleans()):
        manifest["layers"] = data.draw(st.lists(st.sampled_from(manifest["layers"]), max_size=3))
    fake.add_manifest("1", manifest)
    if data.draw(st.booleans()):
        config["config"] = data.draw(odd)
    if data.draw(st.booleans()):
        config["rootfs"]["diff_ids"] = data.draw(st.lists(st.sampled_from([sha(t) for t in tars]) | odd, max_size=3))
    body = json.dumps(config).encode()
    fake.blobs[sha(body)] = body
    if data.draw(st.booleans()):
        manifest["config"] = {"digest": sha(body), "size": len(body)}
        fake.add_manifest("1", manifest)
    with contextlib.suppress(LayerstoreError):
        _consume(_pull(fake))
