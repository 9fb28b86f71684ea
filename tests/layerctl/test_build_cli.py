"""`layerctl build` end to end, through the installed entry point."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from testkit import archive_factory as af
from testkit.blob_ids import is_blob_file
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.erofs_helpers import mounted_erofs, snapshot_tree

from layerstore.store import Store
from manifest.files import read_config
from tests.erofs_builder.test_oci_source import image_spec

KEYS = {"blob", "size", "chunks", "new_bytes", "files"}


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    with Store.open(url) as s:
        s.init()
    return url


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return af.make_tree(tmp_path_factory.mktemp("tree") / "root", sparse=False)


@pytest.fixture(scope="module")
def tree_tar(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return af.tar_with_gnu_tar(tree, tmp_path_factory.mktemp("tar") / "tree.tar", "posix")


@pytest.mark.root
def test_json_shape_push_and_get_blob(tmp_path: Path, store: str, tree_tar: Path) -> None:
    out = tmp_path / "layer.erofs"
    r = layerctl("build", str(tree_tar), "--output", str(out), "--push", "--store", store, "--json",
                 "--role", "toolkit")
    assert r.code == 0, r.err
    res = r.json()
    assert set(res) == KEYS | {"role", "lease", "lease_expires"} and res["role"] == "toolkit"
    assert res["lease"].startswith("push-kept-")
    image = out.read_bytes()
    assert res["size"] == len(image)
    with Store.open(store) as s:
        assert is_blob_file(s, res["blob"], out)
    assert res["new_bytes"] > 0 and res["chunks"] >= 1 and res["files"] > 20
    back = tmp_path / "back.erofs"
    r = layerctl("store", "get-blob", "--store", store, res["blob"], str(back))
    assert r.code == 0, r.err
    assert back.read_bytes() == image
    again = layerctl("build", str(tree_tar), "--push", "--store", store, "--json")
    assert again.code == 0, again.err
    assert again.json()["new_bytes"] == 0 and again.json()["blob"] == res["blob"]
    listing = layerctl("store", "ls", "--store", store, "--json").json()
    assert [b["blob"] for b in listing["blobs"]] == [res["blob"]]


@pytest.mark.root
def test_stdin_directory_and_tar_give_one_image(tmp_path: Path, tree: Path, tree_tar: Path) -> None:
    from_file = layerctl("build", str(tree_tar), "--json")
    from_stdin = layerctl("build", "-", "--json", input=gzip.compress(tree_tar.read_bytes()))
    from_dir = layerctl("build", str(tree), "--json")
    for r in (from_file, from_stdin, from_dir):
        assert r.code == 0, r.err
        assert set(r.json()) == KEYS and r.json()["new_bytes"] is None
    assert from_file.json()["blob"] == from_stdin.json()["blob"] == from_dir.json()["blob"]


@pytest.mark.root
def test_human_summary(tmp_path: Path, store: str, tree_tar: Path) -> None:
    r = layerctl("build", str(tree_tar), "--push", "--store", store, "--role", "base")
    assert r.code == 0, r.err
    assert "(base)" in r.out and "files, image" in r.out and "chunks" in r.out
    assert "new," in r.out and "deduplicated" in r.out
    assert r.err == ""  # no progress bar when stderr is not a terminal


def test_oci_source_writes_one_file_per_layer_and_the_config(tmp_path: Path, store: str) -> None:
    af.write_oci_layout(tmp_path / "oci", image_spec())
    out, cfg = tmp_path / "images", tmp_path / "config.json"
    r = layerctl("build", f"oci:{tmp_path / 'oci'}:latest", "--output", str(out), "--config-out", str(cfg),
                 "--push", "--store", store, "--json", "--role", "base")
    assert r.code == 0, r.err
    layers = r.json()
    assert isinstance(layers, list) and len(layers) == 3
    assert len({res["lease"] for res in layers}) == 1  # one push, one lease for all its layers
    for res in layers:
        assert set(res) == KEYS | {"role", "lease", "lease_expires"}
        path = out / (res["blob"].split(":")[1] + ".erofs")
        with Store.open(store) as s:
            assert is_blob_file(s, res["blob"], path)
    assert sorted(p.name for p in out.iterdir()) == sorted(res["blob"].split(":")[1] + ".erofs" for res in layers)
    doc = json.loads(cfg.read_text())
    assert doc == {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
                   "workdir": "/home/user", "user": "1000:1000"}
    assert read_config(cfg).to_json() == doc  # what `layerctl env create --config` reads
    again = layerctl("build", f"docker-archive:{af.write_docker_archive(tmp_path / 'i.tar', image_spec())}",
                     "--push", "--store", store, "--json")
    assert again.code == 0, again.err
    # The same layer tars, stored differently, give the same images: nothing new to push.
    assert [res["blob"] for res in again.json()] == [res["blob"] for res in layers]
    assert all(res["new_bytes"] == 0 for res in again.json())


@pytest.mark.root
def test_all_root_and_mtime_clamp(tmp_path: Path, tree: Path) -> None:
    out = tmp_path / "x.erofs"
    r = layerctl("build", str(tree), "--output", str(out), "--all-root", "--mtime", "1000", "--json")
    assert r.code == 0, r.err
    with mounted_erofs(out) as mnt:
        snap = snapshot_tree(mnt)
    assert all(rec["uid"] == 0 and rec["gid"] == 0 for rec in snap.values())
    assert all(rec["mtime_ns"] <= 1000 * 10**9 for rec in snap.values())


@pytest.mark.root
def test_usage_errors(tmp_path: Path, tree: Path, tree_tar: Path) -> None:
    r = layerctl("build", str(tmp_path / "missing"))
    assert_clean_failure(r, "no such file")
    assert r.code == 3
    r = layerctl("build", str(tree_tar), "--config-out", str(tmp_path / "c.json"))
    assert_clean_failure(r, "--config-out needs an image source")
    assert not (tmp_path / "c.json").exists()
    (tmp_path / "adir").mkdir()
    r = layerctl("build", str(tree_tar), "--output", str(tmp_path / "adir"))
    assert_clean_failure(r, "is a directory")
    r = layerctl("build", str(tree_tar), "--push", "--store", str(tmp_path / "nostore"))
    assert_clean_failure(r, "layerctl store init")


def _layouts(image: Path, names: list[str]) -> set[str]:
    """dump.erofs's data layout number of each file (0: flat plain, 2: flat inline)."""
    out = set()
    for name in names:
        dump = subprocess.run(["dump.erofs", f"--path=/{name}", str(image)], capture_output=True, text=True, check=True)
        out.add(re.search(r"Layout: (\d+)", dump.stdout).group(1))  # type: ignore[union-attr]
    return out


@pytest.mark.root
def test_no_pack_tails_keeps_every_file_in_whole_blocks(tmp_path: Path) -> None:
    """--no-pack-tails (layers for DAX mounts): no multi-block file's tail is inline (a file under a block
    stays inline, beside its inode), the tree reads back the same."""
    src = tmp_path / "src"
    src.mkdir()
    names = ["tail100", "tail2000", "small"]
    for name, size in zip(names, (4096 + 100, 8192 + 2000, 300), strict=True):
        (src / name).write_bytes(os.urandom(size))
    images = {}
    for flag in ([], ["--no-pack-tails"]):
        out = tmp_path / f"{len(flag)}.erofs"
        r = layerctl("build", str(src), "--output", str(out), "--json", *flag)
        assert r.code == 0, r.err
        images[bool(flag)] = out
    big = names[:2]
    assert _layouts(images[False], big) == {"2"}  # the default packs short tails inline
    assert _layouts(images[True], big) == {"0"}
    with mounted_erofs(images[True]) as mnt:
        assert snapshot_tree(mnt) == snapshot_tree(src)
        for name in names:
            assert (mnt / name).read_bytes() == (src / name).read_bytes()
