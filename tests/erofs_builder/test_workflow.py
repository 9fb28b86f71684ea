"""erofs_builder.workflow: the one path from a source to published layers (layerctl build and the
shim's commit)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from testkit import archive_factory as af

from erofs_builder.workflow import Source, build_and_push, dir_layer, resolve_source, streams
from layerstore.errors import BadInput
from layerstore.store import Store

MiB = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    yield s  # type: ignore[misc]
    s.close()


def _tree(root: Path) -> Path:
    """Enough data that a streaming build would have stored chunks before the end."""
    rnd = random.Random(3)
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02}").write_bytes(rnd.randbytes(rnd.choice([3000, 70_000, 300_000])))
    (root / "big").write_bytes(rnd.randbytes(3 * MiB))
    (root / "sub").mkdir()
    (root / "sub" / "x").write_bytes(b"x" * 5000)
    return root


def _chunks(store: Store) -> list[str]:
    return list(store.list_digests("chunks"))


def _nothing_left(store: Store, out: Path) -> None:
    assert _chunks(store) == [] and list(store.list_digests("blobs")) == []
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_a_refused_archive_stores_nothing_and_leaves_no_output(tmp_path: Path, store: Store) -> None:
    good = af.member("big", os.urandom(3 * MiB)) + af.member("small", b"s" * 9000)
    bad = af.raw_tar(good, af.member("../evil", b"x"))
    (tmp_path / "bad.tar").write_bytes(bad)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "layer.erofs"
    with pytest.raises(BadInput, match=r"\.\."):
        build_and_push(resolve_source(str(tmp_path / "bad.tar"), all_root=False), store=store, output=out)
    _nothing_left(store, out)


def test_a_refused_image_layer_publishes_no_layer(tmp_path: Path, store: Store) -> None:
    """An image whose last layer is refused: the good layers before it are neither written nor pushed."""
    from tests.erofs_builder.test_oci_source import image_spec

    spec = image_spec()
    spec.layers[-1] = af.Layer(af.raw_tar(af.member("ok", b"o" * 100), af.member("../evil", b"x")), "none")
    af.write_oci_layout(tmp_path / "oci", spec)
    out = tmp_path / "images"
    with pytest.raises(BadInput):
        build_and_push(resolve_source(f"oci:{tmp_path / 'oci'}:latest", all_root=False), store=store, output=out)
    _nothing_left(store, out)


def test_a_refused_directory_stores_nothing(tmp_path: Path, store: Store) -> None:
    """A directory can be refused half-way too (here: an mtime before 1970 on its last file), so
    it is not streamed into the store either."""
    root = _tree(tmp_path / "tree")
    late = root / "zz-last"
    late.write_bytes(b"z")
    os.utime(late, (-86400, -86400))
    source = resolve_source(str(root), all_root=False)
    assert not streams(source, store, True)
    out = tmp_path / "layer.erofs"
    with pytest.raises(BadInput):
        build_and_push(source, store=store, output=out)
    _nothing_left(store, out)


def test_commit_and_build_give_the_same_blob_and_chunks(tmp_path: Path) -> None:
    """The shim's commit (the upper streamed into the store while it is built) and `layerctl
    build DIR --push` (built, then pushed) store the same blob with the same chunks."""
    from manifest import Layer, Manifest
    from manifest.environment import create_environment, load_manifest
    from runtime_shim.nodestate.state import Sandbox
    from runtime_shim.sandbox.commit import commit

    root = _tree(tmp_path / "upper")
    with Store.open(str(tmp_path / "a")) as a, Store.open(str(tmp_path / "b")) as b:
        a.init()
        b.init()
        (built,) = build_and_push(resolve_source(str(root), all_root=False), store=a)
        assert built.pushed is not None and built.pushed.new_bytes > 0 and built.path is None
        # an environment to commit onto: one base layer (a different tree) in store b
        base_tree = tmp_path / "base"
        base_tree.mkdir()
        (base_tree / "etc").mkdir()
        base = build_and_push(resolve_source(str(base_tree), all_root=True), store=b)[0].layer
        env = create_environment(b, Manifest(layers=(Layer(base.blob, base.size, "base"),)), "env:1")
        sb = Sandbox(id="s1", env="env:1", manifest=env.manifest, layers=[base.blob], config={},
                     target=str(tmp_path / "t"), upper=str(root), work=str(tmp_path / "w"), owned=False)
        res = commit(b, sb, "env:2", workdir=tmp_path)
        assert res.layer == built.layer.blob and res.size == built.layer.size and res.files == built.layer.files
        assert b.get_chunk_map(res.layer).chunks == a.get_chunk_map(res.layer).chunks
        want = a.get_chunk_map(res.layer).unique_digests()
        assert all(b.has_chunk(d) and b.get_chunk(d) == a.get_chunk(d) for d in want)
        assert [la.blob for la in load_manifest(b, res.manifest).layers] == [base.blob, res.layer]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("layerctl-build-", ".layerctl-build-"))] == []


def test_an_upper_is_streamed_into_the_store(tmp_path: Path, store: Store) -> None:
    root = _tree(tmp_path / "upper")
    source = Source([dir_layer(root, refusable=False)], None, False)
    assert streams(source, store, True) and not streams(source, store, False) and not streams(source, None, True)
    (res,) = build_and_push(source, store=store)
    assert res.layer.chunks_in is store  # compressed and stored while it was built
    assert res.pushed is not None and res.pushed.chunks == len({r.digest for r in res.layer.refs})
    again = build_and_push(source, store=store)[0]
    assert again.layer.blob == res.layer.blob and again.pushed is not None and again.pushed.new_bytes == 0


def test_progress_tasks(tmp_path: Path, store: Store) -> None:
    root = _tree(tmp_path / "tree")
    tasks: dict[str, list[int]] = {}

    def task(description: str, total: int | None):  # type: ignore[no-untyped-def]
        tasks[description] = []
        return tasks[description].append

    (res,) = build_and_push(resolve_source(str(root), all_root=False), store=store, progress=task)
    assert set(tasks) == {"building: reading", f"pushing {res.layer.blob[:15]}"}
    assert sum(tasks["building: reading"]) == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_staging_of_dead_builds_is_swept(tmp_path: Path) -> None:
    """kill -9 of a build leaves its staging directory; the next build removes those of dead
    processes once they are old, and nothing else."""
    import subprocess
    import sys

    from erofs_builder.workflow import Staging

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"layerctl-build-{dead_pid}-abc"
    young = tmp_path / f"layerctl-build-{dead_pid}-def"
    alive = tmp_path / f"layerctl-build-{os.getpid()}-ghi"
    other = tmp_path / "unrelated"
    for d in (stale, young, alive, other):
        d.mkdir()
        (d / "layer-0.erofs").write_bytes(b"x")
    for d in (stale, alive, other):
        os.utime(d, (1, 1))
    with Staging(None, multi=True, workdir=tmp_path) as staging:
        assert staging.tmp is not None and staging.tmp.name.startswith(f"layerctl-build-{os.getpid()}-")
        assert not stale.exists()
        assert young.exists() and alive.exists() and other.exists()
