"""The wheel as a user gets it: built from this checkout and installed into a fresh venv outside it,
with nothing of the checkout on the path, it holds every package of the house, runs `layerctl
--help`, imports every module (fanotify and the snapshotter's stubs among them, the stubs without
regenerating), and finds the guest kit the checkout's sources key.

Offline by construction: the wheel is built with the running interpreter's setuptools
(`pip wheel --no-build-isolation --no-index`) and installed with `--no-deps --no-index`; the
project's dependencies come from the running interpreter's site-packages, put on the fresh venv's
path by a .pth file (a path line adds a directory: the editable-install hooks in it do not run,
so the checkout cannot leak in that way either; every module's __file__ is checked).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from runtime_shim.vm import kit
from snapshotter import protoc
from tests.test_house import MODULES, ROOT

pytestmark = pytest.mark.slow

# Not part of the wheel (and not needed to build it: README.md is, as its long description).
NOT_SHIPPED = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".hypothesis",
                                     ".pytest_cache", ".ruff_cache", ".work", "tests", "bench", "docs")

PROBE = """
import importlib, json, sys
from pathlib import Path
prefix, kits, mods = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from snapshotter import protoc
stubs_current = protoc.up_to_date()  # (before snapshotter.stubs is imported: that would regenerate them)
wrong = {}
for name in mods:
    try:
        m = importlib.import_module(name)
    except Exception as e:
        wrong[name] = f"{type(e).__name__}: {e}"
        continue
    if not str(Path(m.__file__).resolve()).startswith(prefix):
        wrong[name] = f"imported from {m.__file__}"
from runtime_shim.vm import kit
print(json.dumps({"wrong": wrong, "key": kit.kit_key(), "kernel": str(kit.find_kit(kits).kernel),
                  "stubs_current": stubs_current}))
"""


def _run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, cwd=cwd, timeout=240)
    what = " ".join(str(a) for a in args[:3])[:200]
    assert p.returncode == 0, f"{what} ...: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    protoc.generate()  # (the stubs are modules of the wheel; make deps has made them already)
    src = tmp_path_factory.mktemp("src") / "layerstore"
    shutil.copytree(ROOT, src, ignore=NOT_SHIPPED, symlinks=True)
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-cache-dir", "--no-deps",
         "--no-build-isolation", "--no-index", "-w", out, src)
    [whl] = out.glob("layerstore-*.whl")
    return whl


def test_the_wheel_holds_every_package_of_the_house(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rpartition("/")[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert {"runtime_shim/vm/guest-kit.lock", "runtime_shim/vm/guest/init", "runtime_shim/vm/guest/lsguest.c",
            "runtime_shim/vm/guest/build-kit.sh", "snapshotter/api/.generated",
            "service/templates/status.html"} <= set(names)
    assert {f"snapshotter/protos/snapshotter/api/{p.name}" for p in protoc.protos()} <= set(names)


def test_the_installed_wheel_runs_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps", "--no-index",
         "--no-cache-dir", "--disable-pip-version-check", wheel)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "layerstore-test-deps.pth").write_text("".join(f"{p}\n" for p in deps))
    env = {"PATH": f"{venv / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}

    usage = _run(venv / "bin" / "layerctl", "--help", env=env, cwd=tmp_path)
    assert "Usage: layerctl" in usage

    kits = tmp_path / "kits"
    (kits / kit.kit_key()).mkdir(parents=True)  # a kit under the key this checkout's sources give
    for name in ("vmlinuz", "initrd"):
        (kits / kit.kit_key() / name).write_bytes(b"")
    (kits / kit.kit_key() / "kit.json").write_text("{}")
    got = json.loads(_run(venv / "bin" / "python", "-c", PROBE, str(site.resolve()), kits, json.dumps(sorted(MODULES)),
                          env=env, cwd=tmp_path))
    assert got["wrong"] == {}
    assert "fuse_client.fanotify" in MODULES
    assert got["key"] == kit.kit_key() and got["kernel"] == str(kits / kit.kit_key() / "vmlinuz")
    assert got["stubs_current"], "the installed stubs would be regenerated into site-packages at first import"
