"""`layerctl store ...` end to end, through the installed entry point."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.blob_ids import put_blob_id
from testkit.cli_helpers import assert_clean_failure, layerctl

from layerstore import __version__, keys


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    return url


@pytest.fixture
def blob_file(tmp_path: Path) -> Path:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(2_500_000))
    return p


def test_version() -> None:
    r = layerctl("--version")
    assert r.code == 0 and __version__ in r.out


def test_init_is_idempotent(tmp_path: Path) -> None:
    url = "file://" + str(tmp_path / "s")
    first = layerctl("store", "init", "--store", url)
    second = layerctl("store", "init", "--store", url)
    assert first.code == second.code == 0
    assert "initialised" in first.out and "already" in second.out


def test_put_get_round_trip(store: str, blob_file: Path, tmp_path: Path) -> None:
    r = layerctl("store", "put-blob", "--store", store, str(blob_file), "--json")
    assert r.code == 0, r.err
    info = r.json()
    assert info == {"blob": put_blob_id(blob_file), "size": 2_500_000, "chunks": 3,
                    "new_bytes": 2_500_000}
    again = layerctl("store", "put-blob", "--store", store, str(blob_file), "--json").json()
    assert again["new_bytes"] == 0 and again["blob"] == info["blob"]
    out = tmp_path / "out.bin"
    r = layerctl("store", "get-blob", "--store", store, info["blob"], str(out))
    assert r.code == 0, r.err
    assert out.read_bytes() == blob_file.read_bytes()
    r = layerctl("store", "get-blob", "--store", store, info["blob"], "-")
    assert r.code == 0


def test_store_from_environment(tmp_path: Path, blob_file: Path) -> None:
    env = {"LAYERSTORE_STORE": str(tmp_path / "envstore")}
    assert layerctl("store", "init", env=env).code == 0
    r = layerctl("store", "put-blob", str(blob_file), "--json", env=env)
    assert r.code == 0 and (tmp_path / "envstore" / "config").exists()


def test_default_store_is_under_xdg_data_home(tmp_path: Path, blob_file: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    assert layerctl("store", "init", env=env).code == 0
    assert (tmp_path / "xdg" / "layerstore" / "store" / "config").exists()
    assert layerctl("store", "put-blob", str(blob_file), env=env).code == 0


def test_ls(store: str, blob_file: Path) -> None:
    blob = layerctl("store", "put-blob", "--store", store, str(blob_file), "--json").json()["blob"]
    r = layerctl("store", "ls", "--store", store, "--json")
    assert r.code == 0
    listing = r.json()
    assert listing["blobs"] == [{"blob": blob, "size": 2_500_000, "chunks": 3}]
    assert listing["chunks"] == 3 and listing["tags"] == {} and listing["manifests"] == []
    human = layerctl("store", "ls", "--store", store)
    assert blob in human.out


def test_verify_clean_and_corrupt(store: str, blob_file: Path) -> None:
    blob = layerctl("store", "put-blob", "--store", store, str(blob_file), "--json").json()["blob"]
    r = layerctl("store", "verify", "--store", store, "--json")
    assert r.code == 0 and r.json() == {"objects": 5, "corrupt": []}
    # rot one chunk on disk
    chunk_key = next(k for k in _keys(store) if k.startswith("chunks/"))
    path = Path(store) / chunk_key
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    r = layerctl("store", "verify", "--store", store, "--json")
    assert r.code == 1 and r.json()["corrupt"] == [chunk_key]
    r = layerctl("store", "get-blob", "--store", store, blob, str(Path(store).parent / "out"))
    assert_clean_failure(r, "chunk", "hashes to")
    assert not (Path(store).parent / "out").exists()
    assert not list(Path(store).parent.glob(".out.part-*"))


def _keys(store: str) -> list[str]:
    root = Path(store)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["store", "ls", "--store", "gopher://x/y"], ["unknown store URL scheme", "gopher"]),
        (["store", "ls", "--store", "file://host/x"], ["malformed file URL"]),
        (["store", "ls", "--store", "s3://"], ["malformed S3 URL"]),
        (["store", "ls", "--store", "s3://b/p?bogus=1"], ["unknown store URL parameter"]),
        (["store", "get-blob", "--store", "STORE", "b3:1234", "OUT"], ["not a digest", "b3:1234"]),
        (["store", "get-blob", "--store", "STORE", "b3:" + "0" * 64, "OUT"], ["is not in store"]),
        (["store", "put-blob", "--store", "STORE", "/nonexistent/file"], ["cannot read", "/nonexistent/file"]),
        (["store", "ls", "--store", "MISSING"], ["does not exist", "store init"]),
        (["store", "init", "--store", "/proc/layerstore-no"], ["cannot create store directory"]),
        (["store", "bogus"], ["No such command"]),
    ],
)
def test_expected_failures(store: str, tmp_path: Path, args: list[str], needles: list[str]) -> None:
    subst = {"STORE": store, "OUT": str(tmp_path / "out"), "MISSING": str(tmp_path / "missing")}
    r = layerctl(*[subst.get(a, a) for a in args])
    assert_clean_failure(r, *needles)


def test_unwritable_store(tmp_path: Path, blob_file: Path) -> None:
    url = str(tmp_path / "ro")
    assert layerctl("store", "init", "--store", url).code == 0
    if os.geteuid() == 0:
        # root ignores permission bits: make the directory unwritable by mounting nothing over it
        # is overkill; a read-only bind would need mounts. Use a file where a directory must go.
        (Path(url) / "chunks").write_text("not a directory")
    else:
        os.chmod(url, 0o555)
    r = layerctl("store", "put-blob", "--store", url, str(blob_file))
    assert_clean_failure(r, "cannot")


def test_corrupt_store_config(store: str) -> None:
    Path(store, keys.CONFIG).write_text("garbage")
    assert_clean_failure(layerctl("store", "ls", "--store", store), "store config is not JSON")
