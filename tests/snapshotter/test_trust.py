"""Which blobs a containerd client may have mounted: with the environment it came from, the
node's trust policy must accept the environment and the blob must be one of its layers; without
one, only on a node whose policy requires nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.shim_support import busybox_image, busybox_rootfs, needs_busybox, store_with_env

from layerstore import linux
from layerstore.errors import BadInput, PermissionDenied
from layerstore.store import Store
from manifest.errors import UntrustedManifest
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.resolve.environment import CachingResolver, node_policy
from snapshotter.layers import RemoteLayers

from .conftest import detach_under

KEY = "ed25519:IBqYGexjTO0isKTJtnTfANP12B/KnpdOKRw0hSAOIIo="


@needs_busybox
def test_trust_check(tmp_path: Path) -> None:
    url = store_with_env(tmp_path, busybox_rootfs(tmp_path / "base"))
    show = layerctl("env", "show", "--store", url, "bb:1", "--json").json()
    env, blob = show["manifest"], show["environment"]["layers"][0]["blob"]
    other = "b3:" + "1" * 64

    open_layers = RemoteLayers.with_blobs(tmp_path / "snap", tmp_path / "n1", DirBlobs(tmp_path / "b"),
                                          CachingResolver(Store.open(url)))
    try:
        open_layers.check(blob, env)
        open_layers.check(other, "")  # no policy on the node: any blob
        with pytest.raises(BadInput, match="not a layer of environment"):
            open_layers.check(other, env)
    finally:
        open_layers.close()

    node = tmp_path / "node"
    node.mkdir()
    (node / "policy.json").write_text(json.dumps({"require_signature": True, "trusted_keys": [KEY]}))
    strict = RemoteLayers.with_blobs(tmp_path / "snap2", tmp_path / "n2", DirBlobs(tmp_path / "b"),
                                     CachingResolver(Store.open(url), node_policy(node, None)))
    try:
        with pytest.raises(UntrustedManifest):
            strict.check(blob, env)  # unsigned
        with pytest.raises(PermissionDenied, match="needs the environment"):
            strict.check(blob, "")
    finally:
        strict.close()


@pytest.mark.root
@needs_busybox
def test_prefetch_hints_of_the_environment_go_to_the_daemon(tmp_path: Path) -> None:
    """The environment's hints for a blob go to the blob source when the snapshotter takes its
    hold on the layer (through the shim: once per chunk per node, recorded in the node state)."""
    import threading

    from runtime_shim.resolve.environment import EnvSpec, LayerSpec

    blobs, blob = busybox_image(tmp_path / "img")
    sent: list[tuple[str, list[int]]] = []
    done = threading.Event()

    class Blobs(DirBlobs):
        def prefetch(self, blob: str, chunks: list[int]) -> None:
            sent.append((blob, chunks))
            done.set()

    class Resolver:
        policy = None

        def __call__(self, ref: str) -> EnvSpec:
            return EnvSpec(ref, (LayerSpec(blob, 1, "base"),), prefetch={blob: (5, 1, 3)})

        def close(self) -> None:
            pass

    layers = RemoteLayers.with_blobs(tmp_path / "snap", tmp_path / "node", Blobs(blobs), Resolver())  # type: ignore[arg-type]
    try:
        hints = layers.check(blob, "b3:" + "3" * 64)
        assert hints == (5, 1, 3)
        layers.hold(blob, hints)
        assert done.wait(10)
        layers.release(blob)
        layers.hold(blob, hints)  # again: the node has had these hints
        layers.release(blob)
        assert not linux.is_mount(layers.mountpoint(blob))
        layers.close()  # (waits for hint senders)
        assert sent == [(blob, [5, 1, 3])]
    finally:
        layers.close()
        detach_under(tmp_path)
