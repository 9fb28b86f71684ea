"""A corpus of malformed and hostile archives. Each must be refused with a `BadInput` that names
the member, by the reader, by the builder (no output left), and through `layerctl build` (non-zero
exit, one clear stderr line, no output file, nothing in the store)."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path

import pytest
from testkit import archive_factory as af
from testkit.archive_factory import end, header, member, pad, pax, raw_tar
from testkit.cli_helpers import assert_clean_failure, layerctl

from erofs_builder.build import build_layer
from erofs_builder.sources.source_oci import image_layers
from erofs_builder.sources.source_tar import tar_entries
from erofs_builder.tree import Hole
from layerstore.errors import BadInput, NotFound
from layerstore.store import Store

OK = member("ok", b"fine")
_payload = raw_tar(member("big", os.urandom(200_000)), member("more", b"m" * 50_000))


def _corrupt_gzip() -> bytes:
    gz = bytearray(gzip.compress(_payload, mtime=0))
    for i in range(len(gz) // 2, len(gz) // 2 + 16):
        gz[i] ^= 0x5A
    return bytes(gz)


def _neg_size() -> bytes:
    return b"\xff" * 12


def _huge_size() -> bytes:
    return b"\x80" + (1 << 45).to_bytes(11, "big")


# (id, archive, regex the message must match, text naming the member)
TAR_CASES: list[tuple[str, bytes, str, str]] = [
    ("dotdot", raw_tar(OK, member("a/../../etc/passwd", b"x")), r"'\.\.' component", "a/../../etc/passwd"),
    ("dotdot-longname", raw_tar(member("././@LongLink", b"../../x\0", typeflag=b"L"), member("t", b"")),
     r"'\.\.' component", "../../x"),
    ("dotdot-hardlink", raw_tar(OK, header("h", typeflag=b"1", linkname="../ok")), r"'\.\.' component", "'h'"),
    ("through-symlink", raw_tar(header("link", typeflag=b"2", linkname="/etc"), member("link/passwd", b"x")),
     "written through 'link', which is a symlink", "link/passwd"),
    ("through-symlink-dir", raw_tar(header("l", typeflag=b"2", linkname="/tmp"), header("l/sub/", typeflag=b"5")),
     "written through 'l'", "l/sub"),
    ("through-file", raw_tar(member("f", b"x"), member("f/g", b"y")), "written through 'f'", "f/g"),
    ("later-non-dir", raw_tar(member("a/b", b""), header("a", typeflag=b"2", linkname="/")),
     "uses it as a directory", "'a'"),
    ("duplicate", raw_tar(member("a", b"1"), member("a", b"2")), "duplicate entry", "'a'"),
    ("duplicate-normalised", raw_tar(member("./a/b", b"1"), member("/a//b", b"2")), "duplicate entry", "a/b"),
    ("duplicate-root", raw_tar(header("./", typeflag=b"5"), header("/", typeflag=b"5")), "duplicate entry",
     "member '/'"),
    ("hardlink-missing", raw_tar(OK, header("h", typeflag=b"1", linkname="nope")),
     "hard link to missing target 'nope'", "'h'"),
    ("hardlink-forward", raw_tar(header("h", typeflag=b"1", linkname="later"), member("later", b"x")),
     "hard link to missing target", "'h'"),
    ("hardlink-dir", raw_tar(header("d", typeflag=b"5"), header("h", typeflag=b"1", linkname="d")),
     "hard link to directory", "'h'"),
    ("nul-in-name", raw_tar(pax({"path": b"a\0b"}), member("x", b"")), "NUL", "a"),
    ("long-component", raw_tar(pax({"path": "d/" + "n" * 256}), member("x", b"")), "longer than 255", "d/nnn"),
    ("negative-size", raw_tar(OK, header("neg", size_field=_neg_size())), "absurd size -1", "'neg'"),
    ("huge-size", raw_tar(OK, header("huge", size_field=_huge_size())), "absurd size", "'huge'"),
    ("pax-huge-size", raw_tar(pax({"size": "99999999999999999"}), member("p", b"")), "bad pax size", "'p'"),
    ("bad-size-field", raw_tar(OK, header("b", size_field=b"12x4\0\0\0\0\0\0\0\0")), "bad size field",
     "after member 'ok'"),
    ("truncated-header", raw_tar(OK, eof=False) + header("b")[:300], "truncated header", "after member 'ok'"),
    ("truncated-data", header("big", size=100_000) + b"x" * 600, "truncated archive", "'big'"),
    ("no-end-marker", raw_tar(OK, eof=False), "no end-of-archive block", "after member 'ok'"),
    ("bad-checksum", raw_tar(OK, header("b", checksum_delta=1)), "bad header checksum", "after member 'ok'"),
    ("bad-checksum-first", raw_tar(header("first", checksum_delta=-7)), "bad header checksum", "start of the archive"),
    ("corrupt-gzip", _corrupt_gzip(), "corrupt gzip stream", "tar offset"),
    ("truncated-gzip", gzip.compress(_payload, mtime=0)[:-9], "corrupt gzip stream", "tar offset"),
    ("truncated-zstd", af.compress(_payload, "zstd")[:-20], "corrupt zstd stream", "tar offset"),
    ("garbage-zstd", b"\x28\xb5\x2f\xfd" + os.urandom(3000), "corrupt zstd stream", "tar offset"),
    ("unknown-type", raw_tar(OK, header("weird", typeflag=b"Z")), "unknown member type", "'weird'"),
    ("empty-symlink", raw_tar(header("s", typeflag=b"2", linkname="")), "bad symlink target", "'s'"),
    ("symlink-with-data", raw_tar(header("s", typeflag=b"2", linkname="x", size=5) + pad(b"xxxxx")),
     "symlink with 5 bytes", "'s'"),
    ("malformed-pax", raw_tar(header("PaxHeader", size=10, typeflag=b"x") + pad(b"garbage!!\n"), OK),
     "malformed pax record", "after the start"),
    ("dangling-extended-header", pax({"path": "x"}) + end(), "extended header not followed by a member",
     "after the start"),
    ("overlay-xattr", raw_tar(pax({"SCHILY.xattr.trusted.overlay.redirect": "/etc"}), member("f", b"")),
     "overlayfs xattr", "'f'"),
    ("root-not-dir", raw_tar(header("./", typeflag=b"2", linkname="x")), "root is a symlink", "member './'"),
    ("device-out-of-range", raw_tar(pax({"SCHILY.devmajor": "5000"}), header("c", typeflag=b"3")),
     "bad pax devmajor", "'c'"),
    ("bad-sparse-map", raw_tar(pax({"GNU.sparse.map": "0,10", "GNU.sparse.size": "5", "GNU.sparse.name": "sp"}),
                               member("x", b"0123456789")), "sparse map", "'sp'"),
    ("empty-stream", b"", "no end-of-archive block", "start of the archive"),
]


def _consume(data: bytes) -> None:
    for _entry, content in tar_entries(io.BytesIO(data), name="evil.tar"):
        for block in content or ():
            assert isinstance(block, (bytes, memoryview, Hole))


@pytest.mark.parametrize("data,match,names", [c[1:] for c in TAR_CASES], ids=[c[0] for c in TAR_CASES])
def test_reader_refuses(data: bytes, match: str, names: str) -> None:
    with pytest.raises(BadInput, match=match) as exc:
        _consume(data)
    msg = str(exc.value)
    assert msg.startswith("evil.tar: ") and names in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("data,match,names", [c[1:] for c in TAR_CASES], ids=[c[0] for c in TAR_CASES])
def test_builder_leaves_nothing(tmp_path: Path, data: bytes, match: str, names: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadInput, match=match):
        build_layer(tar_entries(io.BytesIO(data), name="evil.tar"), out / "img.erofs")
    assert list(out.iterdir()) == []


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    with Store.open(url) as s:
        s.init()
    return url


def assert_store_empty(url: str) -> None:
    r = layerctl("store", "ls", "--store", url, "--json")
    assert r.code == 0, r.err
    listing = r.json()
    assert listing["blobs"] == [] and listing["chunks"] == 0, listing


@pytest.mark.slow
@pytest.mark.parametrize("data,match,names", [c[1:] for c in TAR_CASES], ids=[c[0] for c in TAR_CASES])
def test_cli_refuses(tmp_path: Path, store: str, data: bytes, match: str, names: str) -> None:
    src = tmp_path / "evil.tar"
    src.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    r = layerctl("build", str(src), "--output", str(out / "img.erofs"), "--push", "--store", store, "--json")
    assert_clean_failure(r, names)
    assert r.code == 2 and r.out == ""
    assert list(out.iterdir()) == []
    assert_store_empty(store)


def test_cli_refuses_stdin(tmp_path: Path, store: str) -> None:
    r = layerctl("build", "-", "--push", "--store", store, input=dict((c[0], c[1]) for c in TAR_CASES)["dotdot"])
    assert_clean_failure(r, "stdin: member 'a/../../etc/passwd'")
    assert_store_empty(store)


# -- OCI images -------------------------------------------------------------------------------
GOOD = af.Layer(af.layer_tar([("dir", ".", 0o755), ("file", "ok", b"fine")]), "gzip")


def _layout(tmp_path: Path, second: af.Layer, **kw: object) -> Path:
    root = tmp_path / "oci"
    af.write_oci_layout(root, af.ImageSpec([GOOD, second]), **kw)  # type: ignore[arg-type]
    return root


def _tamper_layer(root: Path, index: int) -> None:
    manifest_digest = json.loads((root / "index.json").read_text())["manifests"][0]["digest"]
    manifest = json.loads((root / "blobs/sha256" / manifest_digest.split(":")[1]).read_bytes())
    blob = root / "blobs/sha256" / manifest["layers"][index]["digest"].split(":")[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))


def _oci_cases(tmp_path: Path, case: str) -> tuple[Path, str]:
    if case == "digest-mismatch":
        root = _layout(tmp_path, af.Layer(af.layer_tar([("file", "x", os.urandom(5000))]), "gzip"))
        _tamper_layer(root, 1)
        return root, "layer 1 .*digest mismatch"
    if case == "digest-mismatch-plain":
        root = _layout(tmp_path, af.Layer(af.layer_tar([("file", "x", b"a" * 5000)]), "none"))
        _tamper_layer(root, 1)
        return root, "layer 1 .*digest mismatch"
    if case == "diff-id-mismatch":
        root = _layout(tmp_path, af.Layer(af.layer_tar([("file", "x", b"y")]), "zstd"),
                       diff_ids=[None, "sha256:" + "0" * 64])
        return root, "layer 1 .*diff_id mismatch"
    if case == "whiteout-conflict":
        tar = af.layer_tar([("file", "a", b"1"), ("file", ".wh.a", b"")])
        return _layout(tmp_path, af.Layer(tar)), "member '.wh.a': whiteout of 'a', which this layer also holds"
    if case == "overlay-xattr":
        tar = af.layer_tar([("dir", "d", 0o755), ("xfile", "d/f", (b"", {"trusted.overlay.opaque": b"y"}))])
        return _layout(tmp_path, af.Layer(tar)), "member 'd/f': overlayfs xattr"
    if case == "dotdot":
        tar = raw_tar(member("../escape", b"x"))
        return _layout(tmp_path, af.Layer(tar)), "layer 1 .*member '../escape': '..' component"
    raise AssertionError(case)


OCI_CASES = ["digest-mismatch", "digest-mismatch-plain", "diff-id-mismatch", "whiteout-conflict", "overlay-xattr",
             "dotdot"]


def _build_image(spec: str, out: Path) -> None:
    for i, layer in enumerate(image_layers(spec).layers):
        build_layer(layer.entries(), out / f"{i}.erofs")


@pytest.mark.parametrize("case", OCI_CASES)
def test_oci_refuses(tmp_path: Path, store: str, case: str) -> None:
    root, match = _oci_cases(tmp_path, case)
    out = tmp_path / "direct"
    out.mkdir()
    with pytest.raises(BadInput, match=match):
        _build_image(f"oci:{root}", out)
    out = tmp_path / "images"
    r = layerctl("build", f"oci:{root}", "--output", str(out), "--push", "--store", store,
                 "--config-out", str(tmp_path / "config.json"))
    assert_clean_failure(r)
    assert not out.exists() and not (tmp_path / "config.json").exists()
    assert_store_empty(store)


def test_oci_missing_blob_and_bad_layout(tmp_path: Path, store: str) -> None:
    root = _layout(tmp_path, GOOD)
    manifest_digest = json.loads((root / "index.json").read_text())["manifests"][0]["digest"]
    (root / "blobs/sha256" / manifest_digest.split(":")[1]).unlink()
    with pytest.raises(NotFound, match="manifest sha256:"):
        image_layers(f"oci:{root}")
    (tmp_path / "notoci").mkdir()
    r = layerctl("build", f"oci:{tmp_path / 'notoci'}", "--push", "--store", store)
    assert_clean_failure(r, "not an OCI image layout")
    gz = tmp_path / "image.tar.gz"
    gz.write_bytes(gzip.compress(af.raw_tar(OK)))
    r = layerctl("build", f"docker-archive:{gz}", "--push", "--store", store)
    assert_clean_failure(r, "compressed archive")
    assert_store_empty(store)


def test_docker_archive_layer_tampered(tmp_path: Path, store: str) -> None:
    spec = af.ImageSpec([af.Layer(GOOD.tar, "none"), af.Layer(af.layer_tar([("file", "x", b"abc" * 100)]), "none")])
    path = af.write_docker_archive(tmp_path / "image.tar", spec)
    data = bytearray(path.read_bytes())
    pos = data.find(b"abcabc")
    data[pos] = ord("X")
    path.write_bytes(bytes(data))
    with pytest.raises(BadInput, match="diff_id mismatch"):
        _build_image(f"docker-archive:{path}", tmp_path)
    r = layerctl("build", f"docker-archive:{path}", "--push", "--store", store, "--json")
    assert_clean_failure(r, "diff_id mismatch")
    assert_store_empty(store)


# -- bounded resources (issue 12): every case fails with a BadInput naming its limit ----------
def _peak_bytes(data: bytes) -> tuple[int, BaseException | None]:
    """Peak Python memory while reading `data` (allocations counted, not time)."""
    import tracemalloc

    tracemalloc.start()
    try:
        _consume(data)
        error = None
    except BadInput as e:
        error = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, error


LIMIT_CASES: list[tuple[str, bytes, str]] = [
    ("path-over-path-max", raw_tar(pax({"path": "d/" + "/".join(["n" * 200] * 21)}), member("x", b"")),
     r"a name of 4\d\d\d bytes \(the limit is 4095\)"),
    ("path-100k-components", raw_tar(pax({"path": af.deep_path(100_000)}), member("x", b"")),
     r"a name of 199999 bytes \(the limit is 4095\)"),
    ("hardlink-target-over-path-max", raw_tar(OK, pax({"linkpath": "a/" * 3000 + "ok"}),
                                              header("h", typeflag=b"1", linkname="ok")), "limit is 4095"),
    ("pax-after-pax", raw_tar(pax({"path": "a"}), pax({"path": "b"}), member("x", b"")),
     r"repeated extended header \('x' twice"),
    ("longname-chain", raw_tar(*[member("././@LongLink", b"n%d\0" % i, typeflag=b"L") for i in range(3)],
                               member("x", b"")), r"repeated extended header \('L' twice"),
    ("longlink-chain", raw_tar(member("././@LongLink", b"t\0", typeflag=b"K"),
                               member("././@LongLink", b"u\0", typeflag=b"K"),
                               header("s", typeflag=b"2", linkname="x")), r"repeated extended header \('K' twice"),
    ("extended-headers-over-8mib", raw_tar(pax({"comment": "c" * (5 << 20)}),
                                           member("././@LongLink", b"n" * (4 << 20), typeflag=b"L"),
                                           member("x", b"")), "extended headers of one member over 8388608 bytes"),
    ("pax-records", raw_tar(pax({f"k{i}": "v" for i in range(5000)}), member("x", b"")),
     "more than 4096 pax records in one header"),
    ("global-keys", raw_tar(pax({f"g{i}": "v" for i in range(300)}, typeflag=b"g"), member("x", b"")),
     r"global pax keys over the limit \(300 keys"),
    ("global-size", raw_tar(*[pax({f"g{i}": "v" * (300 << 10)}, typeflag=b"g") for i in range(4)], member("x", b"")),
     r"global pax keys over the limit .* at most 256 keys and 1048576 bytes"),
    ("global-headers", raw_tar(*[pax({"comment": "c"}, typeflag=b"g")] * 4097, member("x", b"")),
     "more than 4096 global headers"),
    ("sparse-map-count", raw_tar(pax({"GNU.sparse.map": ",".join(["0", "0"] * 300_000), "GNU.sparse.size": "1"}),
                                 member("sp", b"")), "sparse map of more than 262144 segments"),
]


@pytest.mark.parametrize("data,match", [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_reader_limits(data: bytes, match: str) -> None:
    with pytest.raises(BadInput, match=match) as exc:
        _consume(data)
    assert str(exc.value).startswith("evil.tar: ") and "\n" not in str(exc.value)


def test_member_count_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import erofs_builder.sources.source_tar as source_tar

    monkeypatch.setattr(source_tar, "MAX_MEMBERS", 3)
    _consume(raw_tar(*[member(f"f{i}", b"") for i in range(3)]))
    with pytest.raises(BadInput, match="more than 3 members"):
        _consume(raw_tar(*[member(f"f{i}", b"") for i in range(4)]))


def test_deep_path_is_refused_in_bounded_memory() -> None:
    """100,000 components: refused by name length before any per-prefix work (the old reader
    kept every prefix, ~10 GB for this name)."""
    peak, error = _peak_bytes(raw_tar(pax({"path": af.deep_path(100_000)}), member("x", b"")))
    assert isinstance(error, BadInput) and "limit is 4095" in str(error)
    assert peak < 8 << 20, peak


def test_deep_members_cost_linear_memory() -> None:
    """Members 2,000 directories deep (under PATH_MAX) with no directory entries: the reader's
    state grows with the names' length, not with its square (the old reader held ~4 MB of
    prefixes per member: ~100 MB here, ~800x the archive; now ~10 MB)."""
    data = af.deep_members(25, 2000)
    peak, error = _peak_bytes(data)
    assert error is None
    assert peak < 150 * len(data), (peak, len(data))  # ~75x: an interned node per component
    # the same tree checks still hold at depth
    bad = raw_tar(pax({"path": af.deep_path(1500, "t/")}), member("x", b""),
                  pax({"path": af.deep_path(1000, "t/")}), header("y", typeflag=b"2", linkname="z"))
    with pytest.raises(BadInput, match="uses it as a directory"):
        _consume(bad)
    bad = raw_tar(pax({"path": af.deep_path(1000, "t/")}), header("y", typeflag=b"2", linkname="z"),
                  pax({"path": af.deep_path(1500, "t/")}), member("x", b""))
    with pytest.raises(BadInput, match="would be written through 't/a/a/a/a"):
        _consume(bad)


def test_deep_whiteouts_cost_linear_memory(tmp_path: Path) -> None:
    import tracemalloc

    from erofs_builder.sources.source_oci import whiteouts

    data = af.deep_members(25, 2000)
    tracemalloc.start()
    try:
        for _entry, content in whiteouts(tar_entries(io.BytesIO(data), name="evil.tar"), name="evil.tar"):
            for _ in content or ():
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 250 * len(data), (peak, len(data))  # the old whiteout pass alone held ~800x


def _small_layout(tmp_path: Path) -> Path:
    root = tmp_path / "oci"
    af.write_oci_layout(root, af.ImageSpec([GOOD]))
    return root


def test_oci_json_and_layer_bounds(tmp_path: Path) -> None:
    from erofs_builder.sources import source_oci

    root = _small_layout(tmp_path)
    index = json.loads((root / "index.json").read_text())
    # a descriptor's size is checked before the blob is read: over the limit, or not the file's
    for size, match in ((source_oci.MAX_MANIFEST_JSON + 1, "descriptor size 4194305 is over the limit"),
                        (True, "bad size 'True'"), (3, "is .* bytes, its descriptor says 3")):
        index["manifests"][0]["size"] = size
        (root / "index.json").write_text(json.dumps(index))
        with pytest.raises(BadInput, match=match):
            image_layers(f"oci:{root}")
    root = _small_layout(tmp_path / "2")
    af.rewrite_oci_manifest(root, lambda m: m["layers"].extend([m["layers"][0]] * 500))
    with pytest.raises(BadInput, match="lists 501 layers .at most 500."):
        image_layers(f"oci:{root}")
    root = _small_layout(tmp_path / "3")
    af.rewrite_oci_manifest(root, lambda m: m["layers"][0].update(size=m["layers"][0]["size"] + 1))
    with pytest.raises(BadInput, match="layer 0 .*the blob is .* bytes, its descriptor says"):
        image_layers(f"oci:{root}")
    root = _small_layout(tmp_path / "4")
    (root / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BadInput, match="index.json: JSON nested too deeply"):
        image_layers(f"oci:{root}")
    (root / "index.json").write_text(json.dumps({"manifests": [{"digest": "x"}] * 4097}))
    with pytest.raises(BadInput, match="lists 4097 images"):
        image_layers(f"oci:{root}")
    (root / "index.json").write_text(" " * (source_oci.MAX_INDEX_JSON + 1))
    with pytest.raises(BadInput, match="index.json is larger than 4194304 bytes"):
        image_layers(f"oci:{root}")


def test_docker_archive_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from erofs_builder.sources import source_oci

    # Python's tarfile would read a pax header of any size into memory
    path = tmp_path / "big-pax.tar"
    path.write_bytes(raw_tar(pax({"comment": "c" * (9 << 20)}), member("manifest.json", b"[]")))
    with pytest.raises(BadInput, match="a tar header of more than 8388608 bytes"):
        image_layers(f"docker-archive:{path}")
    path = tmp_path / "deep.tar"
    path.write_bytes(raw_tar(member("manifest.json", b"[" * 100_000 + b"]" * 100_000)))
    with pytest.raises(BadInput, match="manifest.json: JSON nested too deeply"):
        image_layers(f"docker-archive:{path}")
    monkeypatch.setattr(source_oci, "MAX_ARCHIVE_MEMBERS", 10)
    path = tmp_path / "many.tar"
    path.write_bytes(raw_tar(*[member(f"m{i}", b"") for i in range(11)]))
    with pytest.raises(BadInput, match="more than 10 members"):
        image_layers(f"docker-archive:{path}")
