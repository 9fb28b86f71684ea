"""A real Debian userland as the base layer: `mmdebstrap --variant=minbase bookworm` (no mirror
argument: it reads the machine's apt sources; nothing here names a host), cached as a tar under
$XDG_CACHE_HOME/layerstore/tests/ (built on a cold cache: ~15-30 s), built into a layer, pushed,
and run with runc through the CLI with the real node daemon: dpkg and the C library work, the
package database is intact, writes land in the sandbox's upper."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.shim_support import needs_root, needs_runc

pytestmark = [needs_root, needs_runc,
              pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="needs mmdebstrap (.ci/install-deps.sh)")]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "layerstore" / "tests"


def debian_tar() -> Path:
    """The cached minbase tar, built once (under a lock, so concurrent runs build it once)."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tar = d / "debian-bookworm-minbase.tar"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tar.is_file() and tar.stat().st_size > 0:
            return tar
        part = d / "debian-bookworm-minbase.part"
        # --format: mmdebstrap picks the format from the output name otherwise, and ".part" is none
        p = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", "bookworm", str(part)],
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            part.unlink(missing_ok=True)
            pytest.skip(f"mmdebstrap could not build a Debian base here: {p.stderr.strip().splitlines()[-1:]}")
        os.replace(part, tar)
        return tar


@pytest.fixture(scope="module")
def debian_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    tar = debian_tar()
    url = str(tmp_path_factory.mktemp("deb") / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    r = layerctl("build", str(tar), "--push", "--role", "base", "--store", url, "--json", timeout=600)
    assert r.code == 0, r.err
    r = layerctl("env", "create", "--store", url, "--base", r.json()["blob"], "-t", "deb:12", "--json")
    assert r.code == 0, r.err
    return url


def test_real_commands_in_a_debian_sandbox(debian_store: str, node: Path, tmp_path: Path) -> None:
    args = ("run", "--store", debian_store, "--node-dir", str(node), "deb:12", "--")
    r = layerctl(*args, "cat", "/etc/debian_version")
    assert r.code == 0, r.err
    assert r.out.strip().split(".")[0] == "12", r.out
    r = layerctl(*args, "sh", "-c", "dpkg -l | head -n 8; dpkg-query -W -f='${Status}\\n' bash libc6 dpkg")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("Desired=") and any(ln.startswith("ii  ") for ln in lines), r.out
    assert lines[-3:] == ["install ok installed"] * 3, r.out
    script = "id -un; echo written > /root/note; cat /root/note; ls /var/lib/dpkg/info | wc -l"
    r = layerctl(*args, "bash", "-c", script)
    assert r.code == 0, r.err
    who, note, packages = r.out.split()
    assert (who, note) == ("root", "written") and int(packages) > 100
    # a kept sandbox: the write is in its upper, the shared layer is untouched
    r = layerctl("mount", "--store", debian_store, "--node-dir", str(node), "deb:12", str(tmp_path / "root"),
                 "--sandbox", "deb-1")
    assert r.code == 0, r.err
    (tmp_path / "root" / "etc" / "motd").write_text("sandbox motd\n")
    # (its upper has the node's quota: on its own image, mounted at scratch/)
    assert (node / "sandboxes" / "deb-1" / "scratch" / "upper" / "etc" / "motd").read_text() == "sandbox motd\n"
    layer = next((node / "layers").iterdir())
    assert (layer / "etc" / "motd").read_text() != "sandbox motd\n"
    assert layerctl("umount", "--node-dir", str(node), str(tmp_path / "root")).code == 0
