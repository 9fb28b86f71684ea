"""The long-lived shim's resolver reads a tag once and then checks it with one stat(2) per
resolution (`environment.TagVersions`, on the POSIX backend's `version`): a tag moved by another
process (another store client, another host on a shared store) is seen by the very next
resolution; a deleted tag is an error again; a digest reference never looks at tags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layerstore import keys
from layerstore.errors import NotFound
from layerstore.store import Store
from manifest.environment import build_manifest, create_environment
from runtime_shim.resolve.environment import CachingResolver


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    return s


def manifest(store: Store, tmp_path: Path, name: str) -> str:
    (tmp_path / name).write_bytes(name.encode() * 1000)
    blob = store.put_blob(tmp_path / name).blob
    return create_environment(store, build_manifest(store, base=blob), f"{name}:1").manifest


MOVE = "import sys; from layerstore.store import Store; Store.open(sys.argv[1]).set_tag(sys.argv[2], sys.argv[3])"


def test_a_tag_moved_by_another_process_is_seen_by_the_next_resolution(store: Store, tmp_path: Path) -> None:
    first, second = manifest(store, tmp_path, "a"), manifest(store, tmp_path, "b")
    resolver = CachingResolver(Store.open(store.url))
    try:
        assert resolver("a:1").manifest == first
        assert resolver("a:1").manifest == first  # (from the stat: same inode, size, times)
        assert store.backend.version(keys.tag_key("a:1")) is not None  # a POSIX store has versions
        subprocess.run([sys.executable, "-c", MOVE, store.url, "a:1", second], check=True)
        moved = resolver("a:1")
        assert moved.manifest == second and moved.ref == "a:1"
        assert resolver("a:1").manifest == second
        assert resolver(first).manifest == first  # a digest reference: no tag involved
        store.delete_tag("a:1")
        with pytest.raises(NotFound):
            resolver("a:1")
        store.set_tag("a:1", first)  # back again: read, not remembered from before
        assert resolver("a:1").manifest == first
    finally:
        resolver.close()
        store.close()
