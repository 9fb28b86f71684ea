"""Sandboxes keep reading an environment whose tag was removed while they run: the node daemon's
lease holds every layer they mount, so a collection with no grace deletes none of it (it deletes
an environment nothing uses, in the same run) and every file still reads right, including files
nobody had read before (their chunks are fetched from the store after the collection). Once the
sandboxes end, the daemon's lease rotates to what is still in use, and the next collection
deletes the environment. Real node: the runtime shim, the FUSE daemon, EROFS and overlay mounts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import layergc
import pytest
from testkit.fuse_helpers import make_tree, wait_until
from testkit.node_lease import held_blobs, node_leases
from testkit.shim_support import busybox_rootfs, needs_busybox, needs_root, store_shim, store_with_env

from fuse_client.control import request_json
from layerstore import keys
from layerstore.errors import NotFound
from layerstore.store import Store
from runtime_shim.errors import ShimError
from runtime_shim.node.request import MountRequest

pytestmark = [needs_root, needs_busybox]

ROTATION = "0.3"  # seconds between the daemon's lease rotations (LAYERSTORE_NODE_LEASE_INTERVAL)


def digests(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under `root`."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def env_keys(store: Store, ref: str) -> tuple[str, set[str]]:
    """The environment's manifest key, and the keys of its layers' chunk maps and chunks."""
    from manifest import resolve_environment

    env = resolve_environment(store, ref, None)
    layer_keys: set[str] = set()
    for layer in env.layers:
        layer_keys.add(keys.object_key("blobs", layer.blob))
        layer_keys |= {keys.object_key("chunks", d) for d in store.get_chunk_map(layer.blob).unique_digests()}
    return keys.object_key("manifests", env.digest), layer_keys


def fetched_bytes(cache_dir: Path) -> int:
    """What the node daemon fetched from the store so far."""
    stats = request_json(cache_dir, "GET", "/stats")
    return sum(b["fetched_bytes"] for b in stats["blobs"].values())


def present(store: Store, wanted: set[str]) -> set[str]:
    return {k for k in wanted if store.backend.exists(k)}


def test_sandboxes_keep_an_untagged_environment_until_they_end(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERSTORE_NODE_LEASE_INTERVAL", ROTATION)  # (inherited by the daemon the shim starts)
    root = tmp_path / "src"
    base = busybox_rootfs(root / "app")
    make_tree(base / "data", small=60, big=(3 << 20, 5 << 20), seed=13)
    url = store_with_env(root, base, tag="app:1")
    old = busybox_rootfs(root / "old")
    make_tree(old / "data", small=10, big=(2 << 20,), seed=14)
    assert store_with_env(root, old, tag="old:1") == url  # (the same store)
    expected = digests(base / "data")
    with Store.open(url) as store:
        app_manifest, app_layers = env_keys(store, "app:1")
        old_manifest, old_layers = env_keys(store, "old:1")
        app_blobs = {keys.digest_of_key(k)[1] for k in app_layers if k.startswith("blobs/")}
        store.delete_tag("old:1")  # nothing uses it: garbage

        with store_shim(tmp_path, url) as shim:
            sandboxes = [shim.mount(MountRequest("app:1")), shim.mount(MountRequest("app:1"))]
            first = Path(sandboxes[0].target) / "data"
            # The sandboxes read some of it (the rest is fetched only later, after the collection).
            assert (first / "d1" / "small1.txt").read_bytes()
            assert held_blobs(store.backend) == app_blobs  # the daemon holds what the node mounted
            store.delete_tag("app:1")  # the environment loses its tag while its sandboxes run

            report = layergc.collect(store, grace=0)
            # what only the unused environment had is gone (busybox chunks are shared with app:1)
            assert report.deleted.objects > 0 and not present(store, (old_layers - app_layers) | {old_manifest})
            assert present(store, app_layers) == app_layers  # none of what the sandboxes read
            assert not store.backend.exists(app_manifest)  # (the manifest is not theirs to keep)
            fetched = fetched_bytes(shim.paths.cache)
            for sb in sandboxes:
                assert digests(Path(sb.target) / "data") == expected  # every file reads right
            assert fetched_bytes(shim.paths.cache) > fetched  # (chunks fetched after the collection)
            assert present(store, app_layers) == app_layers

            for sb in sandboxes:
                shim.unmount(sb.id)
            # The sandboxes ended: the daemon's next rotations drop their layers from its lease.
            wait_until(lambda: held_blobs(store.backend) == set(), 30, "the node lease to rotate")
            assert [info.kind for info in node_leases(store.backend)] == ["node"]  # (still running)
            report = layergc.collect(store, grace=0)
            assert not present(store, app_layers)
            assert report.deleted.objects >= len(app_layers)
            # A mount of the collected environment fails cleanly. (This shim resolved its manifest
            # before and cached it: the daemon's lookup of the layer is what says it is gone.)
            with pytest.raises(ShimError, match="No such file"):
                shim.mount(MountRequest(keys.digest_of_key(app_manifest)[1]))
            with shim.state.read() as t:
                assert list(t.sandboxes()) == []
            with pytest.raises(NotFound):
                shim.mount(MountRequest("app:1"))
        assert node_leases(store.backend) == []  # the daemon stopped: its lease was released
