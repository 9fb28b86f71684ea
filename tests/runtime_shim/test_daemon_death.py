"""Issue 30: the node daemon's death on a node without a service manager (the FUSE data path),
through the CLI and real runc, as root. A sandbox reads files of its image in a loop; kill -9 of
the daemon under it, three times: the shim's watch starts a new daemon each time, the reader
fails and `run` says why in one line, `sandbox ls` marks it lost, a new run works at once;
`recover` leaves no dead mount and `node stop` nothing mounted. Without a watch: `recover` and
`node stop` clear a dead daemon's FUSE mount themselves. Every wait has a generous deadline that
only turns a hang into a failure; the node fixture's clean-up (tests/conftest.py) stops the watch first."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.shim_support import busybox_rootfs, in_background, needs_busybox, needs_root, needs_runc

from layerstore import linux
from runtime_shim.nodestate.state import DaemonRecord, NodeState
from runtime_shim.supervise.daemon import is_alive, proc_start_time

pytestmark = [needs_root, needs_busybox, needs_runc]
BIN = Path(sys.executable).parent
FILES = 400  # the reader reads a file it never read before every 20 ms: the kill finds it mid-way
DEADLINE = 90.0
READER = ("cat /data/f0 > /dev/null && echo go; i=1; while :; do cat /data/f$i > /dev/null || exit 5; "
          f"i=$(( (i + 1) % {FILES} )); sleep 0.02; done")


def content(i: int) -> str:
    return (f"file {i} " * 4000)[:16384]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """rd:1: busybox and FILES files of 16 KiB under /data."""
    root = tmp_path_factory.mktemp("death")
    url = str(root / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    base = busybox_rootfs(root / "base")
    (base / "data").mkdir()
    for i in range(FILES):
        (base / "data" / f"f{i}").write_text(content(i))
    r = layerctl("build", str(base), "--push", "--store", url, "--all-root", "--json")
    assert r.code == 0, r.err
    assert layerctl("env", "create", "--store", url, "--base", r.json()["blob"], "-t", "rd:1").code == 0
    return url


def daemon(node: Path) -> DaemonRecord | None:
    with NodeState(node / "state") as st, st.read() as t:
        return t.daemon()


def kill9(node: Path) -> int:
    rec = daemon(node)
    assert rec is not None and is_alive(rec), "no live node daemon to kill"
    os.kill(rec.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(rec.pid, os.WNOHANG)
    return rec.pid


def wait_for_restart(node: Path, old: int) -> DaemonRecord:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        rec = daemon(node)
        fuse = node / "fuse"
        if rec is not None and rec.pid != old and is_alive(rec) and linux.is_mount(fuse) and not linux.is_dead(fuse):
            return rec
        time.sleep(0.05)
    raise AssertionError(f"no new node daemon within {DEADLINE} s: {(node / 'daemon.log').read_text()[-3000:]}")


def dead_mounts(node: Path) -> list[str]:
    """Mounts of the node that cannot be read: a FUSE mount answering ENOTCONN, or any mount whose
    root cannot be listed (an EROFS mount on a dead FUSE file, an overlay above one)."""
    bad = []
    for m in linux.read_mounts().values():
        if not (m.mountpoint == str(node) or m.mountpoint.startswith(f"{node}/")):
            continue
        try:
            os.listdir(m.mountpoint)
        except OSError as e:
            bad.append(f"{m.fstype} {m.mountpoint}: {e.strerror}")
    return bad


def watch_pid(node: Path) -> int | None:
    try:
        pid, start = (int(x) for x in (node / "watch.pid").read_text().split())
    except (OSError, ValueError):
        return None
    return pid if proc_start_time(pid) == start else None


def start_reader(url: str, node: Path, sid: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([str(BIN / "layerctl"), "run", "--store", url, "--node-dir", str(node), "--keep",
                          "--sandbox", sid, "--upper-size", "64M", "rd:1", "--", "sh", "-c", READER],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    th, got = in_background(p.stdout.readline, name="reader-go")
    th.join(DEADLINE)
    if got != ["go\n"]:
        p.kill()
        raise AssertionError(f"the reader did not start: {got} {p.communicate(timeout=DEADLINE)}")
    return p


def test_three_kills_under_a_reading_sandbox(store: str, node: Path) -> None:
    url = store
    for k in range(1, 4):
        sid = f"r{k}"
        reader = start_reader(url, node, sid)
        try:
            assert watch_pid(node) is not None  # the FUSE data path is watched too
            old = kill9(node)
            out, err = reader.communicate(timeout=DEADLINE)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        # the reader read a file it never read before through the dead FUSE mount: EIO (or SIGBUS)
        assert reader.returncode != 0, (out, err)
        said = [ln for ln in err.splitlines() if ln.startswith("layerctl: the node daemon died")]
        assert len(said) == 1 and f"sandbox {sid}:" in said[0] and said[0].endswith("run it again"), err
        new = wait_for_restart(node, old)
        log = [ln for ln in (node / "daemon.log").read_text(errors="replace").splitlines() if ln.strip()]
        restarts = [ln for ln in log if f"node daemon {old} died" in ln]
        assert len(restarts) == 1 and f"started {new.pid}" in restarts[0] and sid in restarts[0], log[-10:]
        assert log[-1] == restarts[0], log[-10:]  # (the last line, until the new daemon serves a request)
        # a new run of the same environment works at once (new layer mounts on the new daemon)
        r = layerctl("run", "--store", url, "--node-dir", str(node), "rd:1", "--", "cat", f"/data/f{FILES - k}")
        assert (r.code, r.out) == (0, content(FILES - k)), r.err
        assert "died" not in r.err
        ls = layerctl("sandbox", "ls", "--node-dir", str(node), "--json")
        assert ls.code == 0, ls.err
        lost = {s["sandbox"]: s["lost"] for s in ls.json()["sandboxes"]}
        assert sorted(lost) == [f"r{i}" for i in range(1, k + 1)]
        assert all("FUSE mount, which died at" in why for why in lost.values()), lost
        text = layerctl("sandbox", "ls", "--node-dir", str(node)).out
        assert f"{sid}  " in text and "lost: its layer" in text
    rep = layerctl("recover", "--node-dir", str(node), "--json")
    assert rep.code == 0, rep.err
    assert rep.json()["broken"] == {} and dead_mounts(node) == []
    assert (node / "roots" / "r1" / "data" / "f3").read_text() == content(3)  # mounted again for new processes
    for k in range(1, 4):
        assert layerctl("sandbox", "rm", "--node-dir", str(node), f"r{k}").code == 0
    rec = daemon(node)
    r = layerctl("node", "stop", "--node-dir", str(node))
    assert (r.code, r.out) == (0, "node daemon stopped\n"), r.err
    assert [m.mountpoint for m in linux.read_mounts().values() if m.mountpoint.startswith(f"{node}/")] == []
    assert watch_pid(node) is None and rec is not None and not is_alive(rec) and daemon(node) is None


def test_without_a_watch_recover_and_node_stop_clear_a_dead_daemons_mount(store: str, node: Path,
                                                                          tmp_path: Path) -> None:
    url, env = store, {"LAYERSTORE_DAEMON_WATCH": "0"}
    target = tmp_path / "m1"
    r = layerctl("mount", "--store", url, "--node-dir", str(node), "--sandbox", "m1", "--upper-size", "64M", "rd:1",
                 str(target), env=env)
    assert r.code == 0, r.err
    assert (target / "data" / "f1").read_text() == content(1) and watch_pid(node) is None
    old = kill9(node)
    with pytest.raises(OSError):
        (target / "data" / "f2").read_text()  # never read: the dead daemon cannot serve it
    assert daemon(node).pid == old  # type: ignore[union-attr]  # (nothing restarted it)
    # any shim start repairs it: the sandbox is marked lost and mounted again on a new daemon
    ls = layerctl("sandbox", "ls", "--node-dir", str(node), "--json", env=env)
    assert ls.code == 0, ls.err
    [sb] = ls.json()["sandboxes"]
    assert sb["sandbox"] == "m1" and "FUSE mount, which died" in sb["lost"] and sb["status"] == "mounted"
    assert (target / "data" / "f2").read_text() == content(2)
    assert layerctl("umount", "--node-dir", str(node), str(target), env=env).code == 0
    # no sandbox: nothing needs a daemon, but recover still removes the dead one's mount
    kill9(node)
    rep = layerctl("recover", "--node-dir", str(node), "--json", env=env)
    assert rep.code == 0, rep.err
    assert rep.json()["dead_mounts"] == [str(node / "fuse")] and dead_mounts(node) == []
    assert not linux.is_mount(node / "fuse")
    text = layerctl("recover", "--node-dir", str(node), env=env)
    assert text.code == 0 and "0 dead FUSE mount(s) removed" in text.out  # idempotent
    # and node stop removes it too
    r = layerctl("run", "--store", url, "--node-dir", str(node), "rd:1", "--", "cat", "/data/f5", env=env)
    assert (r.code, r.out) == (0, content(5)), r.err
    kill9(node)
    r = layerctl("node", "stop", "--node-dir", str(node), env=env)
    assert (r.code, r.out) == (0, "no node daemon running: what a dead one left is removed\n"), r.err
    assert [m.mountpoint for m in linux.read_mounts().values() if m.mountpoint.startswith(f"{node}/")] == []
    r = layerctl("node", "stop", "--node-dir", str(node), env=env)
    assert (r.code, r.out) == (0, "no node daemon running\n"), r.err
