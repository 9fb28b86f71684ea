"""Issue 27: a hostile layer must never hang or outlive `layerctl run`. Through real runc, as
root: a FIFO as etc/passwd (or etc/group) is refused before the runtime starts, whatever the
user; a runtime that hangs is killed at its start deadline; a stop signal to `layerctl run` ends
the sandbox; a runtime that dies mid-way leaves nothing. "Nothing left" = no process and no
directory in the sandbox's cgroup, no container in `runc list`, no runtime state, no mount naming
the sandbox. Every wait has a generous deadline that only turns a hang into a failure; every
fixture kills and removes what a failed test left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.shim_support import (
    CONFIG,
    add_blob,
    busybox_rootfs,
    cleanup_node,
    dir_shim,
    in_background,
    mkfs,
    needs_busybox,
    needs_root,
    needs_runc,
    node_mounts,
    spec,
    store_with_env,
)

from layerstore.errors import BadInput
from runtime_shim.backends import bundle, cgroups, signals
from runtime_shim.errors import ShimError
from runtime_shim.node.shim import Shim
from runtime_shim.sandbox import runner

pytestmark = [needs_root, needs_busybox, needs_runc, pytest.mark.hostile]
DEADLINE = 60.0  # seconds: "fails cleanly in under 60 s" (issue 27); only turns a hang into a failure
BIN = Path(sys.executable).parent


def fifo_rootfs(root: Path, *names: str) -> Path:
    base = busybox_rootfs(root)
    for name in names:
        (base / "etc" / name).unlink()
        os.mkfifo(base / "etc" / name)
    return base


def leftovers(node: Path, sandbox: str) -> list[str]:
    """What of `sandbox` is left on the node: cgroup directories and their processes, runc's
    container and state, mounts naming it."""
    left = [f"cgroup {d}" for d in cgroups.dirs(sandbox)]
    left += [f"process {pid}" for pid in cgroups.pids_of(sandbox)]
    root = node / "oci" / "runc"
    listed = subprocess.run(["runc", "--root", str(root), "list", "-q"], capture_output=True, text=True)
    left += [f"runc container {c}" for c in listed.stdout.split() if c == sandbox]
    if (root / sandbox).exists():
        left.append(f"runc state {root / sandbox}")
    left += [f"mount {m.mountpoint}" for m in node_mounts(node) if sandbox in m.mountpoint or sandbox in m.options]
    return left


def scrub(node: Path, sandbox: str) -> None:
    """A failed test's clean-up: kill the sandbox's processes, delete its container, remove its
    cgroup (the node's mounts go with `cleanup_node`)."""
    cgroups.kill(sandbox)
    subprocess.run(["runc", "--root", str(node / "oci" / "runc"), "delete", "--force", sandbox], capture_output=True)
    cgroups.remove(sandbox, timeout=5)


# -- through the CLI: a FIFO layer as root, and stop signals ------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """bb:1 (busybox) and fifo:1 (busybox whose etc/passwd and etc/group are FIFOs)."""
    root = tmp_path_factory.mktemp("hostile-runtime")
    url = store_with_env(root / "ok", busybox_rootfs(root / "ok" / "base"), "--all-root", tag="bb:1")
    fifo = fifo_rootfs(root / "fifo-base", "passwd", "group")
    r = layerctl("build", str(fifo), "--push", "--store", url, "--all-root", "--json")
    assert r.code == 0, r.err
    assert layerctl("env", "create", "--store", url, "--base", r.json()["blob"], "-t", "fifo:1").code == 0
    return {"url": url}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    n = tmp_path / "node"
    ids = ["rh-fifo", "rh-term", "rh-int", "rh-hup"]
    try:
        yield n
    finally:
        for sid in ids:
            scrub(n, sid)
        cleanup_node(n, tmp_path)


def test_a_fifo_passwd_layer_as_root_fails_cleanly(store: dict[str, str], node: Path) -> None:
    """Issue 27's done-when: refused before the runtime starts (the root user needs no lookup
    by the shim, but runc's init opens etc/passwd and etc/group for every user, and blocked there
    for good), in well under DEADLINE, with nothing left."""
    p = subprocess.Popen([str(BIN / "layerctl"), "run", "--store", store["url"], "--node-dir", str(node),
                          "--sandbox", "rh-fifo", "fifo:1", "--", "true"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        p.kill()
        scrub(node, "rh-fifo")  # (the runtime holds the output pipes until its init is gone)
        p.communicate()
        pytest.fail("layerctl run hung on a FIFO etc/passwd as root")
    assert p.returncode == BadInput.exit_code, err
    assert err.strip().splitlines() == ["layerctl: error: the environment's etc/passwd: a FIFO where a regular "
                                        "file was expected (refused, not opened)"], err
    assert not (node / "oci" / "runc" / "rh-fifo").exists()  # the runtime never ran
    assert leftovers(node, "rh-fifo") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_the_run_and_its_sandbox(store: dict[str, str], node: Path, signum: int) -> None:
    """The signal reaches the workload (`sleep`, the child of the container's init: issue 30),
    which ends of it; the grace (LAYERSTORE_STOP_GRACE) is longer than the deadline, so only the
    signal can end the run in time. (Before issue 30 `sleep` was pid 1 of its pid namespace, which
    ignores a signal it has no handler for: the container was killed after the grace. Before issue
    27 the signal was only passed on, and the run never ended.)"""
    sid = {signal.SIGTERM: "rh-term", signal.SIGINT: "rh-int", signal.SIGHUP: "rh-hup"}[signum]
    env = {**os.environ, "LAYERSTORE_STOP_GRACE": str(10 * DEADLINE)}
    p = subprocess.Popen([str(BIN / "layerctl"), "run", "--store", store["url"], "--node-dir", str(node),
                          "--sandbox", sid, "bb:1", "--", "sh", "-c", "echo ready; exec sleep 1000"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"  # (bounded by the finally's kill)
        p.send_signal(signum)
        _, err = p.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"layerctl run did not end after {signal.Signals(signum).name}")
    finally:
        if p.poll() is None:
            p.kill()
            scrub(node, sid)
            p.communicate()
    name = signal.Signals(signum).name
    assert p.returncode == 130, err
    assert err.decode().strip().splitlines() == [f"layerctl: stopped by {name}: sandbox {sid} stopped and removed"]
    assert leftovers(node, sid) == []
    assert layerctl("sandbox", "ls", "--node-dir", str(node), "--json").json()["sandboxes"] == []


# -- in process: a runtime that hangs, a runtime that dies ------------------------------------------
@pytest.fixture
def fifo_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Shim, str]]:
    """A shim whose one layer has a FIFO etc/passwd, with the shim's check of the root switched
    off: a root that blocks runc's init (what any other way to hang the runtime would do)."""
    blobs = tmp_path / "blobs"
    blob = add_blob(blobs, mkfs(fifo_rootfs(tmp_path / "base", "passwd"), tmp_path / "fifo.img"))
    monkeypatch.setattr(bundle, "check_rootfs", lambda rootfs: None, raising=False)  # (none before issue 27)
    with dir_shim(tmp_path, blobs) as s:
        try:
            yield s, blob
        finally:
            for sid in ("rh-hang", "rh-crash", "rh-sig"):
                scrub(s.paths.root, sid)


def test_a_runtime_that_hangs_is_killed_at_its_start_deadline(fifo_shim: tuple[Shim, str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    shim, blob = fifo_shim
    monkeypatch.setenv("LAYERSTORE_RUNTIME_START_TIMEOUT", "2")
    th, result = in_background(runner.run, shim, spec((blob, "base"), config=CONFIG), ["true"], sandbox="rh-hang",
                               stdin=subprocess.DEVNULL, userns=False)
    th.join(DEADLINE)
    assert not th.is_alive(), "the run hung past its start deadline"
    assert isinstance(result[0], ShimError) and "did not start sandbox rh-hang within 2 s" in str(result[0]), result
    assert leftovers(shim.paths.root, "rh-hang") == []
    assert shim.sandboxes() == [] and node_mounts(shim.paths.root) == []  # (no layer mount either)


def blocked_on_a_fifo(sandbox: str) -> bool:
    """Is a process of the sandbox in open(2) of a FIFO without a writer?"""
    for pid in cgroups.pids_of(sandbox):
        try:
            if Path(f"/proc/{pid}/wchan").read_text() == "wait_for_partner":
                return True
        except OSError:
            pass
    return False


def test_a_stop_signal_while_the_runtime_hangs_ends_the_run(fifo_shim: tuple[Shim, str]) -> None:
    """What issue 27 saw: `run` ignored SIGTERM while runc's init was blocked (runc swallows
    signals until the container has started). The container never started: it is killed at
    once, no grace."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    shim, blob = fifo_shim
    done = threading.Event()

    def signal_when_blocked() -> None:
        while not done.wait(0.05):
            if blocked_on_a_fifo("rh-sig"):
                os.kill(os.getpid(), signal.SIGTERM)  # to us, in runner.run's wait: its handler is in place
                return

    sender = threading.Thread(target=signal_when_blocked, daemon=True)
    watchdog = threading.Timer(DEADLINE, scrub, (shim.paths.root, "rh-sig"))  # a hang becomes a failure
    sender.start()
    watchdog.start()
    try:
        with pytest.raises(signals.Stopped, match="^stopped by SIGTERM: sandbox rh-sig stopped and removed$"):
            runner.run(shim, spec((blob, "base"), config=CONFIG), ["true"], sandbox="rh-sig",
                       stdin=subprocess.DEVNULL, userns=False)
    finally:
        done.set()
        watchdog.cancel()
        sender.join()
    assert leftovers(shim.paths.root, "rh-sig") == []
    assert shim.sandboxes() == [] and node_mounts(shim.paths.root) == []  # (no layer mount either)


FAKE_RUNC = """#!/bin/sh
# A runtime that dies mid-create, before it recorded the container: the real one's `run` is
# killed as soon as its init is in the sandbox's cgroup (the init, blocked on the FIFO etc/passwd
# or on its way there, may survive it), and its record (state.json) is dropped, as a runtime that
# died a moment earlier leaves it. Every other command is the real runtime's.
case " $* " in
*" run "*)
    "$REAL_RUNC" "$@" & pid=$!
    until [ -n "$(cat "$WATCH_CGROUP/cgroup.procs" 2>/dev/null)" ]; do sleep 0.05; done  # (size 0 in cgroupfs)
    kill -9 $pid
    wait $pid
    for id; do :; done  # (the last argument: the container's id)
    rm -f "$2/$id/state.json"
    exit 137;;
esac
exec "$REAL_RUNC" "$@"
"""


def test_a_runtime_that_dies_mid_way_leaves_nothing(fifo_shim: tuple[Shim, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    shim, blob = fifo_shim
    fake = tmp_path / "fake-runc"
    fake.write_text(FAKE_RUNC)
    fake.chmod(0o755)
    hierarchies = cgroups.hierarchies()
    watch = next((h for h in hierarchies if h.name == "pids"), hierarchies[0]) / "layerstore" / "rh-crash"
    monkeypatch.setenv("REAL_RUNC", shim.backend("runc").path)  # type: ignore[attr-defined]
    monkeypatch.setenv("WATCH_CGROUP", str(watch))
    monkeypatch.setattr(shim.backends["runc"], "found", str(fake))
    th, result = in_background(runner.run, shim, spec((blob, "base"), config=CONFIG), ["true"], sandbox="rh-crash",
                               stdin=subprocess.DEVNULL, userns=False)
    th.join(DEADLINE)
    assert not th.is_alive(), "the run hung after its runtime died"
    assert result[0] == runner.RunResult("rh-crash", 137, False), result  # the runtime's death, reported
    assert leftovers(shim.paths.root, "rh-crash") == []
    assert shim.sandboxes() == [] and node_mounts(shim.paths.root) == []  # (no layer mount either)
