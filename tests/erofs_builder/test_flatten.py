"""Flattened roots for full VMs (erofs_builder.flatten): both images, the multi-device one over
the layer blobs and the self-contained one, must show exactly what the kernel's own overlay of
the layers shows, pass fsck.erofs (with `--device=` for the layers), and the multi-device one
must point at the layers' data instead of copying it."""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.erofs_helpers import HAVE_FSCK, assert_trees_equal, mounted_erofs
from testkit.flatten_helpers import build_layers, comparable, mounted_multidevice, overlay_view

from erofs_builder.compose import compose
from erofs_builder.erofs.read import read_layer
from erofs_builder.flatten import build_flattened, build_multidevice, mount_options
from erofs_builder.tree import Entry, Hole, Kind
from layerstore.errors import BadInput

pytestmark = [pytest.mark.root, pytest.mark.skipif(not HAVE_FSCK, reason="needs fsck.erofs")]

OPAQUE = {b"trusted.overlay.opaque": b"y"}


def reg(path: bytes, data: Any, **kw: Any) -> tuple[Entry, Any]:
    size = len(data) if isinstance(data, bytes) else sum(p.length if isinstance(p, Hole) else len(p) for p in data)
    return Entry(path, Kind.REG, size=size, **kw), data


def whiteout(path: bytes) -> tuple[Entry, None]:
    return Entry(path, Kind.CHR, rdev=(0, 0)), None


def fsck(image: Path, devices: list[Path], extract: Path | None = None) -> None:
    args = ["fsck.erofs", *(f"--device={d}" for d in devices)]
    if extract is not None:
        args.append(f"--extract={extract}")
    proc = subprocess.run([*args, os.fspath(image)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def check_both(tmp: Path, layers: list[Path]) -> None:
    """Both flattened images against the overlay of `layers`, by the kernel and by fsck."""
    md = build_multidevice(layers, tmp / "md.erofs")
    flat = build_flattened(layers, tmp / "flat.erofs")
    fsck(md.path, layers)
    fsck(flat.path, [])
    with overlay_view(layers) as ov:
        want = comparable(ov)
    with mounted_multidevice(md.path, layers) as m:
        assert_trees_equal(want, comparable(m))
    with mounted_erofs(flat.path) as m:
        assert_trees_equal(want, comparable(m))
    assert md.files == flat.files == len(want)


def test_overlay_rules_and_data_left_in_place(tmp_path: Path) -> None:
    rng = random.Random(7)
    big = rng.randbytes(3 << 20)
    base = [
        (Entry(b"etc", Kind.DIR), None), reg(b"etc/a", b"A" * 10), reg(b"etc/tail", rng.randbytes(20000)),
        reg(b"etc/plain", rng.randbytes(8192)), reg(b"big", big), (Entry(b"d", Kind.DIR), None),
        reg(b"d/x", b"x"), reg(b"d/y", rng.randbytes(5000)), (Entry(b"s", Kind.SYMLINK, symlink=b"etc/a"), None),
        (Entry(b"long", Kind.SYMLINK, symlink=b"t/" * 1500), None),
        reg(b"h1", b"hello" * 1000), (Entry(b"h2", Kind.REG, hardlink=b"h1"), None),
        (Entry(b"h3", Kind.REG, hardlink=b"h1"), None), reg(b"gone", b"bye"),
        reg(b"sparse", (b"head", Hole(5 << 20), rng.randbytes(10000))),
        reg(b"xa", b"q" * 9000, xattrs={b"user.k": b"v", b"trusted.foo": b"zz"}),
        (Entry(b"dev", Kind.BLK, rdev=(8, 1)), None), (Entry(b"fifo", Kind.FIFO), None),
        (Entry(b"gonedir", Kind.DIR), None), reg(b"gonedir/f", b"f"),
    ]
    mid = [
        (Entry(b"d", Kind.DIR, mode=0o700, xattrs=OPAQUE), None), reg(b"d/z", b"zz" * 3000),
        whiteout(b"gone"), whiteout(b"gonedir"), reg(b"etc/a", b"new a" * 2000, mode=0o600, uid=1000),
        reg(b"etc/plain", b"now a file over a file"),
    ]
    top = [whiteout(b"h2"), reg(b"etc/new", rng.randbytes(70000)), (Entry(b"gonedir", Kind.DIR), None),
           reg(b"gonedir/g", b"g")]
    layers = build_layers(tmp_path, [base, mid, top])
    check_both(tmp_path, layers)
    md = build_multidevice(layers, tmp_path / "md2.erofs")
    # the 3 MiB file and the sparse file stay in the base layer: only tails and small files copied
    assert md.copied_bytes < 64 << 10
    assert md.size < 128 << 10
    assert md.layer_bytes_read < 256 << 10
    # the same bytes from fsck's own reader (chunk indexes followed to their devices)
    out = tmp_path / "extract"
    fsck(md.path, layers, out)
    assert (out / "big").read_bytes() == big
    assert (out / "h1").read_bytes() == b"hello" * 1000 and not (out / "h2").exists()
    assert (out / "sparse").read_bytes()[-10000:] == base[14][1][2]
    assert (out / "gonedir").is_dir() and sorted(os.listdir(out / "gonedir")) == ["g"]


def test_reproducible_and_device_table(tmp_path: Path) -> None:
    layers = build_layers(tmp_path, [[reg(b"a", b"1" * 5000)], [reg(b"b", b"2" * 5000)]])
    one = build_multidevice(layers, tmp_path / "one.erofs", tags=[b"b3:aa", b"b3:bb"])
    two = build_multidevice(layers, tmp_path / "two.erofs", tags=[b"b3:aa", b"b3:bb"])
    assert one.path.read_bytes() == two.path.read_bytes()
    raw = one.path.read_bytes()
    assert int.from_bytes(raw[1024 + 86:1024 + 88], "little") == 2  # extra devices
    slot = int.from_bytes(raw[1024 + 88:1024 + 90], "little") * 128
    assert raw[slot:slot + 5] == b"b3:aa" and raw[slot + 128:slot + 133] == b"b3:bb"
    assert int.from_bytes(raw[slot + 64:slot + 68], "little") == layers[0].stat().st_size // 4096
    # without its devices the kernel mounts it but cannot read the data: never silently wrong
    with mounted_erofs(one.path) as m, pytest.raises(OSError):
        (m / "a").read_bytes()


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(BadInput):
        build_multidevice([], tmp_path / "x")
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(16384))
    with pytest.raises(BadInput):
        build_flattened([junk], tmp_path / "y")
    with pytest.raises(BadInput):
        mount_options(["/dev/vdb,ro"])
    assert not list(tmp_path.glob(".*.tmp"))


# -- property: random layer stacks ------------------------------------------------------------
NAMES = [b"a", b"b", b"c"]
SIZES = [0, 1, 100, 4095, 4096, 5000, 8192, 12000, 40000]


@st.composite
def layer_tree(draw: Any, depth: int = 0, prefix: bytes = b"") -> list[tuple[Entry, Any]]:
    out: list[tuple[Entry, Any]] = []
    files: list[bytes] = []
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3)):
        path = prefix + name
        kind = draw(st.sampled_from(["file", "file", "dir", "opaque", "whiteout", "symlink", "link", "sparse"]
                                    if depth < 2 else ["file", "whiteout", "symlink", "link"]))
        if kind == "link" and not files:
            kind = "file"
        if kind == "file":
            data = random.Random(draw(st.integers(0, 999))).randbytes(draw(st.sampled_from(SIZES)))
            out.append(reg(path, data, mode=draw(st.sampled_from([0o644, 0o755]))))
            files.append(path)
        elif kind == "sparse":
            out.append(reg(path, (b"s" * 100, Hole(draw(st.sampled_from([4096, 70000, 1 << 20]))), b"e")))
        elif kind == "link":
            out.append((Entry(path, Kind.REG, hardlink=draw(st.sampled_from(files))), None))
        elif kind == "whiteout":
            out.append(whiteout(path))
        elif kind == "symlink":
            out.append((Entry(path, Kind.SYMLINK, symlink=b"../" + name), None))
        else:
            out.append((Entry(path, Kind.DIR, xattrs=OPAQUE if kind == "opaque" else {}), None))
            out.extend(draw(layer_tree(depth + 1, path + b"/")))
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(layer_tree(), min_size=1, max_size=4))
def test_random_stacks_match_the_overlay(stacks: list[list[tuple[Entry, Any]]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        layers = build_layers(tmp, stacks)
        check_both(tmp, layers)
        images = [read_layer(lambda o, n, p=p: _pread(p, o, n), p.stat().st_size) for p in layers]
        assert [e.path for e in compose(images)][0] == b""


def _pread(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_at_most_23_devices_and_guest_drive_names(tmp_path: Path) -> None:
    from runtime_shim.vm.roots import guest_device, layer_tags, root_key

    layers = build_layers(tmp_path, [[reg(f"f{i}".encode(), b"x" * 5000)] for i in range(24)])
    with pytest.raises(BadInput):
        build_multidevice(layers, tmp_path / "many.erofs")
    md = build_multidevice(layers[:23], tmp_path / "23.erofs")
    with mounted_multidevice(md.path, layers[:23]) as m:
        assert sorted(os.listdir(m)) == sorted(f"f{i}" for i in range(23))
        assert (m / "f22").read_bytes() == b"x" * 5000
    assert [guest_device(i) for i in (0, 1, 25, 26, 27)] == ["/dev/vda", "/dev/vdb", "/dev/vdz", "/dev/vdaa",
                                                          "/dev/vdab"]
    assert layer_tags(2) == [b"/dev/vdb", b"/dev/vdc"]
    assert root_key(["b3:a", "b3:b"]) != root_key(["b3:b", "b3:a"])


def test_chunk_indexes_after_xattr_bodies_of_every_alignment(tmp_path: Path) -> None:
    """Chunk indexes start 8-aligned after the inode and its xattrs: xattr bodies of both
    alignments (a value one byte longer each time) read back right, by the kernel and by fsck."""
    for n in range(8):
        tmp = tmp_path / str(n)
        tmp.mkdir()
        data = random.Random(n).randbytes(9000)
        layers = build_layers(tmp, [[reg(b"xa", data, xattrs={b"user.k": b"v" * n})], [reg(b"b", b"b")]])
        check_both(tmp, layers)


def test_a_node_builds_each_vm_root_once(tmp_path: Path) -> None:
    """Sandboxes of one layer stack started at once: one of them builds the root image, the
    others wait for it and use it (runtime_shim.vm.roots)."""
    import threading

    from runtime_shim.vm.roots import root_image

    layers = build_layers(tmp_path, [[reg(b"a", b"1" * 5000)], [reg(b"b", b"2" * 5000)]])
    got: list[tuple[Path, Any]] = []
    threads = [threading.Thread(target=lambda: got.append(root_image(tmp_path / "roots", ["b3:x", "b3:y"], layers)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({p for p, _built in got}) == 1
    assert sum(built is not None for _p, built in got) == 1
    with mounted_multidevice(got[0][0], layers) as m:
        assert (m / "a").read_bytes() == b"1" * 5000 and (m / "b").read_bytes() == b"2" * 5000
