"""OCI layouts and `docker save` archives: layers built into EROFS, stacked with overlayfs, equal
to the image unpacked with OCI semantics; whiteout conversion; refs; runtime config."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import archive_factory as af
from testkit.erofs_helpers import assert_trees_equal, fsck_erofs, mounted_erofs, snapshot_tree

from erofs_builder.build import BuiltLayer, build_layer
from erofs_builder.sources.image_config import runtime_config
from erofs_builder.sources.source_oci import image_layers, whiteouts
from erofs_builder.tree import Entry, Kind
from layerstore.errors import BadInput, NotFound
from layerstore.linux import MS_RDONLY, mount, umount

BASE = [
    ("dir", ".", 0o755), ("dir", "etc", 0o755), ("file", "etc/os-release", b"base\n"),
    ("file", "etc/remove-me", b"x"), ("file", "etc/keep", b"k"),
    ("dir", "usr", 0o755), ("dir", "usr/bin", 0o755), ("file", "usr/bin/tool", b"\x7fELF" * 1000),
    ("link", "usr/bin/tool-link", "usr/bin/tool"), ("symlink", "usr/bin/sh", "tool"),
    ("dir", "usr/lib", 0o755), ("file", "usr/lib/libold", b"old lib"),
    ("dir", "opq", 0o755), ("file", "opq/old1", b"o1"), ("dir", "opq/sub", 0o755), ("file", "opq/sub/old2", b"o2"),
    ("dir", "gone", 0o755), ("file", "gone/inner", b"i"),
    ("file", "replaced", b"a file, later a directory"),
    ("dir", "var", 0o755), ("dir", "var/log", 0o755), ("file", "var/log/x", b"log"),
]
MID = [
    ("dir", ".", 0o755), ("dir", "etc", 0o755), ("file", "etc/.wh.remove-me", b""),
    ("file", "etc/os-release", b"mid\n"),
    ("file", ".wh.gone", b""),
    ("file", "opq/.wh..wh..opq", b""),  # the marker before its directory's entry
    ("dir", "opq", 0o750), ("file", "opq/new1", b"n1"),
    ("dir", "newdir", 0o755), ("file", "newdir/file", b"nf"),
]
TOP = [
    ("dir", ".", 0o755), ("dir", "usr", 0o755), ("dir", "usr/lib", 0o755),
    ("file", "usr/lib/.wh..wh..opq", b""),  # the marker after its directory's entry
    ("file", "usr/lib/libnew", b"new lib"),
    ("dir", "newdir", 0o755), ("file", "newdir/.wh.file", b""),
    ("dir", "replaced", 0o700), ("file", "replaced/inside", b"in"),
    ("dir", "etc", 0o755), ("xfile", "etc/motd", (b"hello\n", {"user.m": b"v"})),
    ("dir", "gone", 0o755), ("file", "gone/again", b"back"),
]


def image_spec() -> af.ImageSpec:
    return af.ImageSpec([af.Layer(af.layer_tar(BASE), "gzip"), af.Layer(af.layer_tar(MID), "zstd"),
                         af.Layer(af.layer_tar(TOP), "none")])


@contextlib.contextmanager
def stacked(images: list[Path]) -> Iterator[Path]:
    """The images mounted and stacked with overlayfs, the last one on top (read-only)."""
    with contextlib.ExitStack() as stack:
        lowers = [stack.enter_context(mounted_erofs(img)) for img in images]
        target = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overlay-")))
        mount("overlay", target, "overlay", MS_RDONLY,
              "xino=on,lowerdir=" + ":".join(str(p) for p in reversed(lowers)))
        try:
            yield target
        finally:
            umount(target, lazy=True)


def build_all(spec: str, out: Path) -> list[BuiltLayer]:
    image = image_layers(spec)
    return [build_layer(layer.entries(), out / f"layer{i}.erofs") for i, layer in enumerate(image.layers)]


@pytest.mark.root
def test_oci_layout_stacks_to_the_reference_tree(tmp_path: Path) -> None:
    spec = image_spec()
    af.write_oci_layout(tmp_path / "oci", spec)
    built = build_all(f"oci:{tmp_path / 'oci'}", tmp_path)
    assert len(built) == 3
    for layer in built:
        fsck_erofs(layer.path)
    ref = af.apply_layers(tmp_path / "ref", [layer.tar for layer in spec.layers])
    want = snapshot_tree(ref)
    assert b"opq/old1" not in want and b"gone/inner" not in want and b"usr/lib/libold" not in want
    with stacked([layer.path for layer in built]) as merged:
        assert_trees_equal(want, snapshot_tree(merged))


@pytest.mark.root
def test_whiteouts_in_a_single_layer_image(tmp_path: Path) -> None:
    af.write_oci_layout(tmp_path / "oci", image_spec())
    built = build_all(f"oci:{tmp_path / 'oci'}", tmp_path)
    with mounted_erofs(built[1].path) as mid:
        snap = snapshot_tree(mid)
        assert snap[b"etc/remove-me"]["type"] == "c" and snap[b"etc/remove-me"]["rdev"] == (0, 0)
        assert snap[b"etc/remove-me"]["mode"] == "0o0"
        assert snap[b"gone"]["type"] == "c"
        assert snap[b"opq"]["xattrs"] == {"trusted.overlay.opaque": b"y"} and snap[b"opq"]["mode"] == "0o750"
        assert b"opq/.wh..wh..opq" not in snap and b"etc/.wh.remove-me" not in snap
    with mounted_erofs(built[2].path) as top:
        snap = snapshot_tree(top)
        assert snap[b"usr/lib"]["xattrs"] == {"trusted.overlay.opaque": b"y"}
        assert snap[b"newdir/file"]["type"] == "c"


@pytest.mark.root
def test_docker_archive_gives_the_same_layers(tmp_path: Path) -> None:
    spec = image_spec()
    for layer in spec.layers:
        layer.codec = "none"  # docker save stores layers uncompressed
    af.write_oci_layout(tmp_path / "oci", spec)
    af.write_docker_archive(tmp_path / "image.tar", spec)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from_oci = build_all(f"oci:{tmp_path / 'oci'}", tmp_path / "a")
    from_docker = build_all(f"docker-archive:{tmp_path / 'image.tar'}", tmp_path / "b")
    assert [b.blob for b in from_oci] == [b.blob for b in from_docker]
    ref = af.apply_layers(tmp_path / "ref", [layer.tar for layer in spec.layers])
    with stacked([layer.path for layer in from_docker]) as merged:
        assert_trees_equal(snapshot_tree(ref), snapshot_tree(merged))


def test_docker_archive_repeated_layer_and_tags(tmp_path: Path) -> None:
    base = af.Layer(af.layer_tar(BASE), "none")
    spec = af.ImageSpec([base, af.Layer(af.layer_tar(MID), "none"), base])
    path = af.write_docker_archive(tmp_path / "image.tar", spec, tag="repo/img:1")
    image = image_layers(f"docker-archive:{path}")
    assert len(image.layers) == 3 and image.layers[0].diff_id == image.layers[2].diff_id
    for layer in image.layers:
        assert sum(1 for _ in layer.entries()) > 0
    assert len(image_layers(f"docker-archive:{path}:repo/img:1").layers) == 3
    with pytest.raises(NotFound, match="repo/img:2"):
        image_layers(f"docker-archive:{path}:repo/img:2")


def test_refs_and_runtime_config(tmp_path: Path) -> None:
    spec = image_spec()
    info = af.write_oci_layout(tmp_path / "oci", spec, ref="latest")
    expected = {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
                "workdir": "/home/user", "user": "1000:1000"}
    oci = f"oci:{tmp_path / 'oci'}"
    for src in (oci, f"{oci}:latest", f"{oci}:{info['manifest']}"):
        image = image_layers(src)
        assert image.config == expected
        assert [layer.digest for layer in image.layers] == info["layers"].split(",")
    with pytest.raises(NotFound, match="no image 'nope'"):
        image_layers(f"oci:{tmp_path / 'oci'}:nope")
    af.write_oci_layout(tmp_path / "two", spec, ref="a", extra_refs=["b"])
    with pytest.raises(BadInput, match="holds 2 images.*a, b"):
        image_layers(f"oci:{tmp_path / 'two'}")
    assert len(image_layers(f"oci:{tmp_path / 'two'}:b").layers) == 3


def test_runtime_config_normalisation() -> None:
    cfg = runtime_config({"config": {"Env": ["A=1", "B=2", "A=3"], "WorkingDir": "app", "Cmd": None}})
    assert cfg == {"entrypoint": [], "cmd": [], "env": ["A=3", "B=2"], "workdir": "/app", "user": ""}
    assert runtime_config({})["workdir"] == "/"
    with pytest.raises(BadInput, match="Entrypoint"):
        runtime_config({"config": {"Entrypoint": "/bin/sh"}})
    with pytest.raises(BadInput, match="user"):
        runtime_config({"config": {"User": "bad user"}})


# -- whiteout conversion on entry sequences ---------------------------------------------------
def d(path: bytes, **kw: object) -> tuple[Entry, None]:
    return Entry(path=path, kind=Kind.DIR, mode=0o755, **kw), None  # type: ignore[arg-type]


def f(path: bytes) -> tuple[Entry, None]:
    return Entry(path=path, kind=Kind.REG), None


def convert(seq: list[tuple[Entry, None]]) -> list[Entry]:
    return [e for e, _ in whiteouts(iter(seq), name="layer")]


@pytest.mark.parametrize("marker_first", [True, False])
def test_opaque_marker_gives_one_dir_entry_with_the_xattr(marker_first: bool) -> None:
    seq = [f(b"a/.wh..wh..opq"), d(b"a", uid=7), f(b"a/x")] if marker_first else \
        [d(b"a", uid=7), f(b"a/x"), f(b"a/.wh..wh..opq")]
    out = convert(seq)
    dirs = [e for e in out if e.path == b"a"]
    assert len(dirs) == 1 and dirs[0].uid == 7 and dirs[0].xattrs == {b"trusted.overlay.opaque": b"y"}
    assert [e.path for e in out] == [b"a/x", b"a"]


def test_opaque_marker_without_dir_entry_and_whiteouts() -> None:
    out = convert([f(b"x/y/.wh..wh..opq"), f(b"x/.wh.gone"), f(b".wh..wh.plnk"), f(b".wh.top")])
    by = {e.path: e for e in out}
    assert by[b"x/y"].kind is Kind.DIR and by[b"x/y"].xattrs == {b"trusted.overlay.opaque": b"y"}
    for p in (b"x/gone", b"top"):
        assert (by[p].kind, by[p].rdev, by[p].mode) == (Kind.CHR, (0, 0), 0)
    assert set(by) == {b"x/y", b"x/gone", b"top"}


@pytest.mark.parametrize("seq,match", [
    ([f(b"a"), f(b".wh.a")], "this layer also holds"),
    ([f(b".wh.a"), f(b"a/b")], "whited out in this same layer"),
    ([d(b".wh.a")], "a whiteout that is a directory"),
    ([(Entry(path=b"f", kind=Kind.REG, xattrs={b"trusted.overlay.redirect": b"/x"}), None)], "overlayfs xattr"),
    ([f(b".wh.x"), (Entry(path=b"y", kind=Kind.REG, hardlink=b".wh.x"), None)], "hard link to whiteout"),
])
def test_whiteout_conflicts_are_refused(seq: list[tuple[Entry, None]], match: str) -> None:
    with pytest.raises(BadInput, match=match):
        convert(seq)


def test_multi_platform_index_resolves_to_this_machine(tmp_path: Path) -> None:
    import hashlib
    import json

    root = tmp_path / "oci"
    af.write_oci_layout(root, image_spec(), ref=None)
    desc = json.loads((root / "index.json").read_text())["manifests"][0]
    missing = "sha256:" + "1" * 64
    nested = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {**desc, "digest": missing, "platform": {"os": "linux", "architecture": "s390x"}},
        {**desc, "platform": {"os": "linux", "architecture": "amd64"}},
        {**desc, "platform": {"os": "linux", "architecture": "arm64"}},
        {**desc, "digest": missing, "platform": {"os": "unknown", "architecture": "unknown"}},
    ]}).encode()
    digest = "sha256:" + hashlib.sha256(nested).hexdigest()
    (root / "blobs/sha256" / digest.split(":")[1]).write_bytes(nested)
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": digest, "size": len(nested)}]}))
    assert len(image_layers(f"oci:{root}").layers) == 3
