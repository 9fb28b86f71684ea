"""The CRI path's pointer resolution (snapshotter.cri) against a real registry: which layers of an
image the CRI plugin pulls are layerstore pointers, read from the manifest the reference names."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.oci_registry import needs_registry, oci_registry
from testkit.registry_images import push_busybox

from erofs_builder.sources.registry import RegistryClient
from layerstore.errors import BadInput
from snapshotter.cri import LABEL_CRI_DIGEST, LABEL_CRI_LAYERS, LABEL_CRI_REF, CriPointers, _runs_in
from snapshotter.image import POINTER_MEDIA_TYPE, image_of_environment, pointer_layers

BLOB_A, BLOB_B = "b3:" + "a" * 64, "b3:" + "b" * 64
ENV = "sha256:" + "e" * 64


def test_pointer_media_type_is_an_oci_layer_type() -> None:
    # containerd's unpacker and the CRI's labels only consider these prefixes layers
    assert POINTER_MEDIA_TYPE.startswith("application/vnd.oci.image.layer.")


def test_pointer_layers_of_an_environment_image() -> None:
    img = image_of_environment(ENV, [(BLOB_A, 10, "base"), (BLOB_B, 20, "toolkit")], {})
    env, layers = pointer_layers(img.manifest.data)
    assert env == ENV
    assert layers == {img.layers[0].digest: BLOB_A, img.layers[1].digest: BLOB_B}


def test_runs_in() -> None:
    assert _runs_in(["a", "b", "c"], ["b", "c"]) and _runs_in(["a", "b", "c"], ["a", "b"]) and _runs_in(["a"], [])
    assert not _runs_in(["a", "b", "c"], ["b", "a"]) and not _runs_in(["a", "b"], ["x"])


@needs_registry
def test_lookup_reads_the_manifest_once_and_tells_pointers_from_ordinary_layers(tmp_path: Path) -> None:
    img = image_of_environment(ENV, [(BLOB_A, 10, "base"), (BLOB_B, 20, "toolkit")], {})
    with oci_registry(tmp_path / "reg") as reg:
        with RegistryClient(reg.host) as rc:
            for b in [*img.layers, img.config]:
                rc.push_blob("envs/x", b.data, b.digest)
            rc.put_manifest("envs/x", "1", img.manifest.data, img.manifest.media_type)
        push_busybox(tmp_path / "bb", reg.host, "test/busybox", "1")
        made: list[str] = []

        def open_registry(host: str) -> RegistryClient:
            made.append(host)
            return RegistryClient(host)

        cri = CriPointers(open_registry)
        digests = [b.digest for b in img.layers]
        for i, d in enumerate(digests):
            p = cri.lookup({LABEL_CRI_REF: reg.ref("envs/x", "1"), LABEL_CRI_DIGEST: d,
                            LABEL_CRI_LAYERS: ",".join(digests[i:])})
            assert p is not None and p.blob == [BLOB_A, BLOB_B][i] and p.environment == ENV
        assert cri.manifests_read == 1
        # an ordinary image: no pointer
        with RegistryClient(reg.host) as rc:
            import json
            body, _, _ = rc.get_manifest("test/busybox", "1")
        first = json.loads(body)["layers"][0]["digest"]
        p = cri.lookup({LABEL_CRI_REF: reg.ref("test/busybox", "1"), LABEL_CRI_DIGEST: first})
        assert p is not None and p.blob == ""
        # a layer the manifest does not have (the tag moved under the pull): refused
        with pytest.raises(BadInput):
            cri.lookup({LABEL_CRI_REF: reg.ref("test/busybox", "1"), LABEL_CRI_DIGEST: "sha256:" + "0" * 64})
        # no CRI labels: nothing to say
        assert cri.lookup({}) is None
        assert made == [reg.host]  # one client for the host, kept across images (a manifest read is a round trip)
    # the registry gone: known digests still answer, unknown ones take the ordinary path
    assert cri.lookup({LABEL_CRI_REF: reg.ref("envs/x", "1"), LABEL_CRI_DIGEST: digests[0]}).blob == BLOB_A
    assert cri.lookup({LABEL_CRI_REF: reg.ref("envs/y", "1"), LABEL_CRI_DIGEST: "sha256:" + "1" * 64}) is None
    cri.close()


def test_one_tls_context_per_ca_bundle_version(tmp_path: Path) -> None:
    import shutil

    import certifi

    from erofs_builder.sources.registry_auth import CA_ENV, tls_verify

    bundle = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), bundle)
    env = {CA_ENV: str(bundle)}
    first = tls_verify(env)
    assert tls_verify(env) is first  # (loading a bundle costs ~30 ms of CPU)
    bundle.write_bytes(bundle.read_bytes() + b"\n")  # a new version of the bundle: loaded again
    assert tls_verify(env) is not first
