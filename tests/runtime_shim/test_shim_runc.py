"""Runs with real runc (and crun) on composed roots: exit codes, output streaming, and isolation
seen from inside the container."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.fuse_helpers import wait_until
from testkit.shim_support import (
    busybox_image,
    dir_shim,
    needs_busybox,
    needs_root,
    needs_runc,
    spec,
)

from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.sandbox import runner

pytestmark = [needs_root, needs_busybox, needs_runc]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("img")
    return busybox_image(root)


@pytest.fixture
def shim(tmp_path: Path, image: tuple[Path, str]) -> Iterator[Shim]:
    with dir_shim(tmp_path, image[0]) as s:
        yield s


def run(shim: Shim, blob: str, script: str, **kw: object) -> tuple[int, str, str]:
    out, err = shim.paths.root / "out.txt", shim.paths.root / "err.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        res = runner.run(shim, spec((blob, "base")), ["/bin/sh", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=o, stderr=e, **kw)  # type: ignore[arg-type]
    return res.exit_code, out.read_text(), err.read_text()


def test_exit_codes_and_output(shim: Shim, image: tuple[Path, str]) -> None:
    assert run(shim, image[1], "echo out; echo err >&2; exit 0") == (0, "out\n", "err\n")
    assert run(shim, image[1], "exit 7")[0] == 7
    assert run(shim, image[1], "sh -c 'kill -9 $$'; exit $?")[0] == 137  # (pid 1 itself ignores a signal from inside)
    code, out, _ = run(shim, image[1], "seq 1 20000")
    assert code == 0 and out.splitlines()[-1] == "20000" and len(out.splitlines()) == 20000
    assert shim.sandboxes() == [] and shim.layer_refs() == {}  # torn down after each run


def test_the_sandbox_sees_only_its_root(shim: Shim, image: tuple[Path, str], tmp_path: Path) -> None:
    other = shim.mount(MountRequest(spec((image[1], "base"))))
    (Path(other.target) / "secret").write_text("other sandbox\n")
    node = str(shim.paths.root)
    probes = [node, f"{node}/cache", f"{node}/fuse", f"{node}/state", other.upper, other.target, str(tmp_path),
              str(image[0])]
    script = "; ".join(f"test -e {p} && echo REACHABLE {p}" for p in probes) + """
        ls /proc/1/root/ >/dev/null 2>&1 && test -e /proc/1/root/secret && echo REACHABLE other-secret
        echo nets: $(ls /sys/class/net)
        echo pid1: $(cat /proc/1/cmdline | head -c 20)
        echo user: $(id -u)
        echo written > /etc/motd && echo wrote-motd
        grep -c . /proc/self/mountinfo >/dev/null && echo ok
        touch /proc/sysrq-trigger 2>/dev/null || echo sysrq-ro
        exit 0"""
    code, out, err = run(shim, image[1], script, keep=True)
    assert code == 0, err
    assert "REACHABLE" not in out, out
    assert "nets: lo\n" in out  # its own network namespace: loopback only
    assert "user: 0\n" in out and "wrote-motd" in out
    sb = [s for s in shim.sandboxes() if s.id != other.id][0]
    assert (Path(sb.upper) / "etc" / "motd").read_text() == "written\n"  # the write went to its upper
    assert (Path(other.target) / "etc" / "motd").read_text() == "base motd\n"
    assert (shim.paths.layer_mount(image[1]) / "etc" / "motd").read_text() == "base motd\n"
    shim.unmount(sb.id)
    shim.unmount(other.id)


def test_config_from_the_environment(shim: Shim, image: tuple[Path, str]) -> None:
    conf = {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo default $GREETING; pwd"], "env": ["GREETING=hi"],
            "workdir": "/etc", "user": "nobody"}
    out = shim.paths.root / "o.txt"
    with open(out, "wb") as o:
        res = runner.run(shim, spec((image[1], "base"), config=conf), None, stdin=subprocess.DEVNULL, stdout=o)
    assert res.exit_code == 0
    assert out.read_text() == "default hi\n/etc\n"
    with open(out, "wb") as o:
        runner.run(shim, spec((image[1], "base"), config=conf), ["id -u"], stdin=subprocess.DEVNULL, stdout=o)
    assert out.read_text() == "65534\n"


@pytest.mark.skipif(shutil.which("crun") is None or shutil.which("unshare") is None, reason="needs crun")
def test_crun_behind_the_same_driver(shim: Shim, image: tuple[Path, str]) -> None:
    assert run(shim, image[1], "echo from crun; exit 5", runtime="crun") == (5, "from crun\n", "")


def start_container(shim: Shim, sb_id: str, target: str) -> None:
    """A detached container (runc create + start), as a crashed `layerctl run` leaves one running."""
    from runtime_shim.backends.bundle import write_bundle

    bundle = shim.paths.bundle(sb_id)
    write_bundle(bundle, target, {"cmd": ["/bin/sh"]}, ["sleep", "1000"], sandbox=sb_id,
                 cgroups_path=f"/layerstore/{sb_id}")
    base = ["runc", "--root", str(shim.paths.root / "oci" / "runc")]
    for verb in (["create", "--bundle", str(bundle)], ["start"]):
        subprocess.run([*base, *verb, sb_id], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)


def container_status(shim: Shim, sb_id: str) -> str | None:
    return shim.backend("runc").status(sb_id)


def test_recover_and_teardown_delete_leftover_containers(shim: Shim, image: tuple[Path, str]) -> None:
    import json
    import os
    import signal

    live, gone, dead = (shim.mount(MountRequest(spec((image[1], "base")))) for _ in range(3))
    for sb in (live, gone, dead):
        start_container(shim, sb.id, sb.target)
        assert container_status(shim, sb.id) == "running"
    state = json.loads((shim.paths.root / "oci" / "runc" / dead.id / "state.json").read_text())
    os.kill(state["init_process_pid"], signal.SIGKILL)  # its process died (as after a crash or reboot)
    # SIGKILL takes effect asynchronously: wait until runc sees the container stopped.
    wait_until(lambda: container_status(shim, dead.id) != "running", 20, "the killed container to stop")
    with shim.lock:
        shim.lifecycle.teardown(gone)  # its sandbox is gone (torn down as before the shim deleted containers)
    rep = shim.recover()
    assert sorted(rep.deleted_containers) == sorted([f"runc:{gone.id}", f"runc:{dead.id}"])
    assert container_status(shim, gone.id) is None and container_status(shim, dead.id) is None
    assert container_status(shim, live.id) == "running"  # a live sandbox's running container is its own
    shim.unmount(live.id)  # `sandbox rm` stops and deletes it
    assert container_status(shim, live.id) is None
    assert os.listdir(shim.paths.root / "oci" / "runc") == []
    shim.unmount(dead.id)
