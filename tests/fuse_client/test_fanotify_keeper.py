"""The keeper (fuse_client/fanotify/keeper.py; docs/fanotify.md, "The keeper"): a process of ours
that keeps a copy of the fanotify group on a node without a service manager. It keeps the group
through kill -9 of the daemon, the holder and the shim's watch (a read of an unfilled range
started in the gap completes with the right bytes on the same group once the next shim call
starts a daemon); it is out of the OOM killer's reach and in a cgroup beside its starter's, which
a cgroup kill of the starter's does not reach; `auto` takes fanotify with it and FUSE without;
and no process of ours is left."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.fanotify_helpers import needs_fanotify, read_uncached, shim_node, start_recorded, stop_holder
from testkit.fuse_helpers import CountingBackend, force_unmount, make_tree, wait_until

from erofs_builder.build import BuiltLayer
from fuse_client import daemon as node_daemon
from fuse_client.control import attach, detach, request_json
from fuse_client.fanotify import fdstore, handover, keeper, kernel
from layerstore.linux import cgroup, mount_erofs, umount

CAP_SYS_RESOURCE = 24


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=30, big=(3 << 20,))


@pytest.fixture
def keeper_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(keeper.OPT_IN_ENV, "1")
    monkeypatch.delenv(keeper.CGROUP_ENV, raising=False)


def _gone(pid: int) -> bool:
    return handover.proc_start_time(pid) is None


def _has_cap(bit: int) -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    return bool(eff >> bit & 1)


# -- pure ------------------------------------------------------------------------------------


def test_the_fd_store_messages_name_a_group_to_store_or_remove() -> None:
    assert fdstore.stored_name(fdstore.parse_message(b"FDSTORE=1\nFDNAME=fanotify-cafe\n")) == ("store", "cafe")
    assert fdstore.stored_name({"FDSTOREREMOVE": "1", "FDNAME": "fanotify-cafe"}) == ("remove", "cafe")
    assert fdstore.stored_name({"FDSTORE": "1", "FDNAME": "other"}) is None
    assert fdstore.stored_name({"FDSTORE": "1", "FDNAME": "fanotify-"}) is None
    assert fdstore.stored_name({"READY": "1"}) is None


def test_the_keeper_cgroup_is_beside_its_starter() -> None:
    assert cgroup.own_v2_cgroup("4:memory:/x\n0::/node/shim\n") == "/node/shim"
    assert cgroup.own_v2_cgroup("0::/\n") == "/"
    assert cgroup.own_v2_cgroup("4:memory:/x\n") is None
    assert cgroup.sibling("/node/shim", "layerstore-keeper") == "/node/layerstore-keeper"
    assert cgroup.sibling("/", "layerstore-keeper") == "/layerstore-keeper"
    assert keeper.wanted({keeper.OPT_IN_ENV: "1"}) and not keeper.wanted({}) and not keeper.wanted(
        {keeper.OPT_IN_ENV: "0"})


# -- a real keeper ---------------------------------------------------------------------------


@pytest.mark.root
def test_auto_counts_a_live_keeper_and_only_when_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table of docs/fanotify.md, "Which data path", for the keeper's rows (the kernel probe
    replaced): no keeper asked for -> FUSE; asked for and running -> fanotify, named in the
    reason; asked for but not running -> FUSE, saying so; `ensure` does nothing unless asked."""
    monkeypatch.setattr(kernel, "probe", lambda where: None)
    cache = tmp_path / "cache"
    assert keeper.ensure(cache, {}) is None and keeper.running(cache) is None
    path, why = node_daemon.data_path_choice(cache, None, "plain", env={})
    assert path == "fuse" and "no service manager keeps" in why and "keeper" not in why
    asked = {keeper.OPT_IN_ENV: "1"}
    path, why = node_daemon.data_path_choice(cache, None, "plain", env=asked)
    assert path == "fuse" and "it did not start" in why
    pid = keeper.ensure(cache, asked)
    try:
        assert pid is not None and keeper.ensure(cache, asked) == pid  # (one per cache)
        path, why = node_daemon.data_path_choice(cache, None, "plain", env=asked)
        assert path == "fanotify" and f"the keeper process {pid}" in why, why
    finally:
        keeper.stop(cache)
    assert pid is not None and _gone(pid)
    assert node_daemon.data_path_choice(cache, None, "plain", env=asked)[0] == "fuse"


@pytest.mark.root
def test_the_keeper_keeps_a_stored_group_hands_it_back_and_drops_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pid = keeper.ensure(cache, {keeper.OPT_IN_ENV: "1"})
    assert pid is not None
    group = kernel.init_group()
    try:
        assert keeper.store(cache, group, "cafe")
        wait_until(lambda: keeper.held(cache) == "cafe", 10, "the keeper to keep the group")
        got = keeper.fetch(cache)
        assert got is not None and got[1] == "cafe"
        assert os.stat(f"/proc/self/fd/{got[0]}").st_ino == os.fstat(group).st_ino  # (the same group)
        os.close(got[0])
        keeper.forget(cache, "cafe")
        wait_until(lambda: keeper.held(cache) is None, 10, "the keeper to let it go")
        assert keeper.fetch(cache) is None
    finally:
        os.close(group)
        keeper.stop(cache)
    assert _gone(pid)


@pytest.mark.root
def test_the_keeper_is_out_of_the_oom_killers_reach_and_beside_its_starters_cgroup(tmp_path: Path) -> None:
    """Started from a process in cgroup T/node, the keeper moves to T/layerstore-keeper; a kill
    of T/node (cgroup.kill: what a runtime does to a node's cgroup) ends its starter, not it. Its
    oom_score_adj is -1000 where the node grants CAP_SYS_RESOURCE, and where it does not (this
    CI's VM) the keeper says so in its identity, which the daemon's data-path reason carries."""
    root = cgroup.v2_root()
    if root is None or not (root / "cgroup.kill").exists() and not any(root.glob("*/cgroup.kill")):
        pytest.skip("no unified cgroup hierarchy with cgroup.kill")
    top = root / f"layerstore-test-{secrets.token_hex(4)}"
    node = top / "node"
    node.mkdir(parents=True)
    cache = tmp_path / "cache"
    starter = None
    pid = None
    try:
        code = ("import sys, time; from fuse_client.fanotify import keeper; "
                "print(keeper.ensure(sys.argv[1], {'LAYERSTORE_FANOTIFY_KEEPER': '1'}), flush=True); time.sleep(600)")
        starter = subprocess.Popen(["sh", "-c", f'echo $$ > {node}/cgroup.procs && exec "$@"', "sh",
                                    sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE, text=True)
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
        assert cgroup.cgroup_of(starter.pid) == "/" + node.relative_to(root).as_posix()
        assert cgroup.cgroup_of(pid) == "/" + (top / keeper.CGROUP_NAME).relative_to(root).as_posix()
        ident = keeper.identity(cache)
        assert ident is not None and ident[0] == pid
        if _has_cap(CAP_SYS_RESOURCE):
            assert cgroup.oom_score_adj(pid) == cgroup.OOM_SCORE_ADJ_MIN
            assert "NOT protected" not in ident[1]
        else:
            assert cgroup.oom_score_adj(pid) == 0 and "NOT protected from the OOM killer" in ident[1]
            assert "cannot set oom_score_adj" in (cache / keeper.LOG_NAME).read_text()
        (node / "cgroup.kill").write_text("1\n")
        assert starter.wait(10) == -signal.SIGKILL
        assert keeper.running(cache) == pid  # (beside the killed cgroup: untouched)
    finally:
        if starter is not None:
            if starter.poll() is None:
                starter.kill()
                starter.wait()
            if starter.stdout is not None:
                starter.stdout.close()
        keeper.stop(cache)
        if pid is not None:
            wait_until(lambda: _gone(pid), 10, "the keeper to exit")
        for d in (top / keeper.CGROUP_NAME, node, top):
            with contextlib.suppress(OSError):
                d.rmdir()


@pytest.mark.root
@needs_fanotify
def test_the_keeper_keeps_the_group_through_daemon_holder_and_watch_killed(
        backend: CountingBackend, src: Path, layer: BuiltLayer, tmp_path: Path, keeper_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim starts a keeper and a daemon (`auto`: fanotify because of the keeper); the group
    goes to the keeper at the first attach. kill -9 of the watch, the daemon and the holder: the
    group lives in the keeper, so a read of an unfilled range started then waits (no zeros); the
    next shim call starts a daemon, which takes the group back from the keeper (the same group:
    the same generation, no remount) and the read completes with the right bytes. Nothing of ours
    is left after the cleanup."""
    paths, sup, state = shim_node(tmp_path, monkeypatch, "auto")  # (asked for: the shim then starts its watch)
    target = tmp_path / "layer"
    target.mkdir()
    rec = None
    ours: list[int] = []
    got: list[bytes | BaseException] = []
    reader = None
    try:
        rec = start_recorded(sup, state, backend.url)
        keeper_pid, watch_pid = keeper.running(paths.cache), sup.watch_pid()
        assert keeper_pid is not None and watch_pid is not None
        stats = request_json(paths.cache, "GET", "/stats")
        assert stats["data_path"] == "fanotify" and f"keeper process {keeper_pid}" in stats["data_path_reason"]
        path = Path(attach(paths.cache, layer.blob, "test")["path"])  # type: ignore[index]
        generation = handover.holder_generation(paths.cache)
        assert generation is not None
        wait_until(lambda: keeper.held(paths.cache) == generation.removeprefix("fanotify:"), 10,
                   "the keeper to keep the daemon's group")
        mount_erofs(path, target)  # (cold: only the metadata attached)
        ident = handover.read_identity(paths.cache)
        assert ident is not None
        ours = [watch_pid, rec.pid, ident[0]]
        for pid in ours:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(_gone(p) for p in ours), 10, "the watch, the daemon and the holder to die")

        def read() -> None:
            try:
                got.append(read_uncached(target / "big0.bin"))
            except BaseException as e:
                got.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()  # (waits in the kernel: the group lives in the keeper only)
        reader.join(1.0)
        assert not got, got  # (not allowed by default: it waits)
        rec = start_recorded(sup, state, backend.url)  # the next shim call (DaemonBlobs.ensure) starts a daemon
        reader.join(60)
        assert got and got[0] == (src / "big0.bin").read_bytes()
        assert handover.holder_generation(paths.cache) == generation  # the same group, a new holder
        assert keeper.running(paths.cache) == keeper_pid
        ours = [keeper_pid, rec.pid]
        new_ident = handover.read_identity(paths.cache)
        assert new_ident is not None
        ours.append(new_ident[0])
    finally:
        if reader is not None:
            reader.join(5)
        with contextlib.suppress(OSError):
            umount(target, lazy=True)
        with contextlib.suppress(Exception):
            detach(paths.cache, layer.blob, "test")
        sup.stop(rec)
        stop_holder(paths.cache)
        keeper.stop(paths.cache)
        state.close()
        force_unmount(paths.fuse)
    watch = sup.watch_pid()
    wait_until(lambda: all(_gone(p) for p in ours) and watch is None, 20, "no process of ours left")


# -- one keeper, its cgroup, the watch's restart (docs/fanotify.md, "Dead alone", "Out of the killers' reach")


def _keepers_of(cache: Path) -> list[int]:
    """Pids of every keeper process of `cache` (by its exact command line), started or starting:
    what a test must leave none of (a watch stopped just after it spawned one included)."""
    want = ["-m", "fuse_client.fanotify.keeper", os.fspath(cache)]
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                argv = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0") if a]
                if argv[1:] == want and handover.proc_start_time(int(d.name)) is not None:
                    pids.append(int(d.name))
    return pids


def _end_keepers(cache: Path) -> None:
    """`keeper.stop`, then SIGKILL (by pid) of any keeper of `cache` left (one still starting)."""
    keeper.stop(cache)
    for pid in _keepers_of(cache):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _keepers_of(cache), 10, "no keeper left")


def _rmdir_all(dirs: list[Path], timeout: float = 10.0) -> None:
    """Remove test cgroups, deepest first (an exiting process may hold one a moment longer)."""
    end = time.monotonic() + timeout
    for d in dirs:
        while d.exists():
            try:
                d.rmdir()
            except OSError:
                if time.monotonic() > end:
                    break
                time.sleep(0.05)


@pytest.mark.root
def test_one_keeper_per_cache_whoever_starts_it(tmp_path: Path) -> None:
    """Two `ensure`s at once (the shim's and the watch's) give one keeper; a keeper started by hand
    while one runs gives way at once (EXIT_ANOTHER) and touches nothing."""
    cache = tmp_path / "cache"
    env = {**os.environ, keeper.OPT_IN_ENV: "1"}
    got: list[int | None] = []
    threads = [threading.Thread(target=lambda: got.append(keeper.ensure(cache, env))) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 2 and got[0] is not None and got[0] == got[1], got
        ident = (cache / keeper.IDENTITY_NAME).read_text()
        second = subprocess.run([sys.executable, "-m", "fuse_client.fanotify.keeper", str(cache)], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == keeper.EXIT_ANOTHER, second.stderr
        assert keeper.running(cache) == got[0] and (cache / keeper.IDENTITY_NAME).read_text() == ident
        ans, fd = handover.request(cache, b"I", path=keeper.socket_path(cache))
        assert fd is None and ans["pid"] == got[0]  # (its sockets answer: not replaced)
    finally:
        for t in threads:
            t.join(60)
        _end_keepers(cache)
    assert all(p is None or _gone(p) for p in got)


@pytest.mark.root
def test_a_keeper_that_quits_removes_its_cgroup_and_a_killed_ones_goes_at_the_next_start(tmp_path: Path) -> None:
    """Started from T/a/node, a keeper is in T/a/layerstore-keeper; killed -9 it cannot leave it
    (empty, it stays), and the next `ensure` (from T/b/node) removes it; that keeper, quit with `Q`
    (`keeper.stop`), leaves T/b/layerstore-keeper and removes it."""
    root = cgroup.v2_root()
    if root is None:
        pytest.skip("no unified cgroup hierarchy")
    top = root / f"layerstore-test-{secrets.token_hex(4)}"
    for part in ("a", "b"):
        (top / part / "node").mkdir(parents=True)
    cache = tmp_path / "cache"
    first = second = None

    def start_from(node: Path) -> int:
        code = ("import os, sys; from fuse_client.fanotify import keeper; "
                "print(keeper.ensure(sys.argv[1], {**os.environ, 'LAYERSTORE_FANOTIFY_KEEPER': '1'}), flush=True)")
        out = subprocess.run(["sh", "-c", f'echo $$ > {node}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c",
                              code, str(cache)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    def rel(p: Path) -> str:
        return "/" + p.relative_to(root).as_posix()

    try:
        first = start_from(top / "a" / "node")
        mine_a = top / "a" / keeper.CGROUP_NAME
        assert cgroup.cgroup_of(first) == rel(mine_a)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: _gone(first), 10, "the keeper to die")
        wait_until(lambda: (mine_a / "cgroup.procs").read_text() == "", 10, "the killed keeper's cgroup to empty")
        assert mine_a.is_dir()  # (left behind)
        second = start_from(top / "b" / "node")
        mine_b = top / "b" / keeper.CGROUP_NAME
        assert cgroup.cgroup_of(second) == rel(mine_b)
        assert not mine_a.exists()  # the next start removed the killed one's
        keeper.stop(cache)  # (`Q`)
        wait_until(lambda: _gone(second), 10, "the keeper to quit")
        wait_until(lambda: not mine_b.exists(), 10, "the keeper's cgroup to go")
        assert "left and removed cgroup" in (cache / keeper.LOG_NAME).read_text()
    finally:
        _end_keepers(cache)
        leaves = [top / p / q for p in ("a", "b") for q in (keeper.CGROUP_NAME, "node")]
        _rmdir_all([*leaves, top / "a", top / "b", top])
    assert all(p is None or _gone(p) for p in (first, second))


@pytest.mark.root
@pytest.mark.slow
@needs_fanotify
def test_the_watch_starts_a_keeper_killed_alone_and_the_daemon_hands_it_the_group(
        backend: CountingBackend, layer: BuiltLayer, tmp_path: Path, keeper_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shim-started daemon on fanotify (with a keeper), a layer attached: kill -9 of the keeper
    alone. The watch starts a new keeper (not the next daemon start) and the running daemon hands
    it the same group (its `I` answer); daemon, holder, watch and generation unchanged."""
    from runtime_shim.supervise.daemon import is_alive

    paths, sup, state = shim_node(tmp_path, monkeypatch, "auto")
    rec = None
    ours: list[int] = []
    attached = False
    try:
        rec = start_recorded(sup, state, backend.url)
        old, watch_pid = keeper.running(paths.cache), sup.watch_pid()
        assert old is not None and watch_pid is not None
        ours = [old, watch_pid, rec.pid]
        assert request_json(paths.cache, "GET", "/stats")["data_path"] == "fanotify"
        attach(paths.cache, layer.blob, "test")
        attached = True
        generation = handover.holder_generation(paths.cache)
        ident = handover.read_identity(paths.cache)
        assert generation is not None and ident is not None
        ours.append(ident[0])
        group = generation.removeprefix("fanotify:")
        wait_until(lambda: keeper.held(paths.cache) == group, 10, "the keeper to keep the daemon's group")
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: _gone(old), 10, "the keeper to die")
        wait_until(lambda: keeper.running(paths.cache) not in (None, old), 30, "the watch to start a keeper")
        new = keeper.running(paths.cache)
        assert new is not None
        ours.append(new)
        wait_until(lambda: keeper.held(paths.cache) == group, 10, "the daemon to hand the new keeper its group")
        assert is_alive(rec) and sup.watch_pid() == watch_pid
        assert handover.holder_generation(paths.cache) == generation
        assert handover.read_identity(paths.cache) == ident
        wait_until(lambda: f"started keeper {new}" in paths.daemon_log.read_text(), 10, "the watch to log it")
    finally:
        if attached:
            with contextlib.suppress(Exception):
                detach(paths.cache, layer.blob, "test")
        sup.stop(rec)
        stop_holder(paths.cache)
        _end_keepers(paths.cache)
        state.close()
        force_unmount(paths.fuse)
    wait_until(lambda: all(_gone(p) for p in ours) and sup.watch_pid() is None, 20, "no process of ours left")
