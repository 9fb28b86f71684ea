"""The keeper: a process of ours that keeps a copy of the fanotify group as systemd's fd store would,
on nodes without such a service manager (docs/fanotify.md, "A keeper without systemd"). Opt-in
(`LAYERSTORE_FANOTIFY_KEEPER=1`): the runtime shim's supervision starts it (`ensure`) before it
starts a daemon, and a daemon counts a live keeper as a keeper of the group (`auto` then takes
fanotify).

    python -m fuse_client.fanotify.keeper CACHE_DIR

What makes it outlive the daemon and the holder, which keep the group too:
- it is out of the OOM killer's reach (`oom_score_adj` -1000: never chosen, and spared by a
  cgroup's group kill, memory.oom.group);
- it moves itself into a cgroup of its own beside the one it was started in (the daemon's:
  `layerstore-keeper`, or `$LAYERSTORE_FANOTIFY_KEEPER_CGROUP`), so a kill of the daemon's cgroup
  (cgroup.kill) does not reach it;
- it ignores SIGTERM, SIGINT and SIGHUP (as the holder does); it exits on `Q` from root, with
  SIGKILL, or once the cache directory is gone. Leaving on its own (not killed), it moves out of
  the default cgroup and removes it if that leaves it empty; `ensure` and `stop` remove the empty
  cgroup of a keeper that was killed.

One keeper per cache: it holds `CACHE/fanotify-keeper.lock` (flock) for its life, and one that
cannot take it exits at once (EXIT_ANOTHER) before it touches anything, so two `ensure`s at once
(the shim's, the watch's: runtime_shim/supervise/keeper_watch.py) or a starter that died half-way
leave one keeper.

Two sockets in the cache directory, mode 0600 (root only, in the cache's private directory):
- `fanotify-keeper.notify`, a datagram socket speaking systemd's fd-store messages: the daemon
  hands it the group with `fdstore.store` (`FDSTORE=1`, `FDNAME=fanotify-<group id>`, the fd with
  SCM_RIGHTS) and drops it with `fdstore.forget` (`FDSTOREREMOVE=1`): one implementation of the
  sender for systemd and for the keeper. It keeps one group (a newer one replaces it).
- `fanotify-keeper.sock`, the holder's request protocol (`handover`): `G` (the group fd attached,
  `{"pid", "group"}`), `I` (the same without the fd: which group it keeps), `Q` (quit).
A systemd manager hands the group back at exec (`$LISTEN_FDS`); the keeper is not the daemon's
parent, so the daemon asks it (`fetch`) when no holder answers (`group.take_over`).

Its identity (pid, start time) is in `CACHE/fanotify.keeper`.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from layerstore.fileio import private_dir
from layerstore.linux import cgroup, proc_start_time

from . import fdstore, handover, holder

log = logging.getLogger("layerstore.fanotify.keeper")

OPT_IN_ENV = "LAYERSTORE_FANOTIFY_KEEPER"  # "1": the shim starts a keeper, `auto` counts it
CGROUP_ENV = "LAYERSTORE_FANOTIFY_KEEPER_CGROUP"  # the v2 cgroup to move into (default: beside its starter's)
CGROUP_NAME = "layerstore-keeper"
NOTIFY_NAME = "fanotify-keeper.notify"
SOCKET_NAME = "fanotify-keeper.sock"
IDENTITY_NAME = "fanotify.keeper"
LOG_NAME = "fanotify-keeper.log"
LOCK_NAME = "fanotify-keeper.lock"  # flock held by the live keeper for its life
EXIT_ANOTHER = 3  # the exit status of a keeper that found another one holding the lock
READY_TIMEOUT = 10.0
CHECK_INTERVAL = 2.0  # seconds between checks that the cache directory still exists


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the node's operator asked for a keeper (pure)."""
    return env.get(OPT_IN_ENV, "").strip().lower() in ("1", "yes", "true", "on")


def notify_path(cache_dir: Path) -> Path:
    return Path(os.path.abspath(cache_dir)) / NOTIFY_NAME


def socket_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


def identity(cache_dir: Path) -> tuple[int, str] | None:
    """(pid, how it is placed: oom_score_adj and cgroup) of this cache's live keeper (its identity
    file names a live process), else None."""
    try:
        ident = json.loads((Path(cache_dir) / IDENTITY_NAME).read_text())
        pid, start, placed = int(ident["pid"]), ident["start_time"], str(ident.get("placed", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pid, placed) if start is not None and proc_start_time(pid) == start else None


def running(cache_dir: Path) -> int | None:
    """The pid of this cache's live keeper, else None."""
    ident = identity(cache_dir)
    return None if ident is None else ident[0]


def held(cache_dir: Path) -> str | None:
    """The id of the group the live keeper keeps, None if it keeps none or none answers."""
    if running(cache_dir) is None:
        return None
    with contextlib.suppress(OSError):
        ans, _fd = handover.request(cache_dir, b"I", path=socket_path(cache_dir), timeout=2)
        group = ans.get("group")
        return str(group) if group else None
    return None


def store(cache_dir: Path, fd: int, group_id: str) -> bool:
    """Hand a copy of the group to the live keeper (systemd's message, `fdstore.store`); False if
    no keeper runs or the hand-over failed (logged)."""
    if running(cache_dir) is None:
        return False
    return fdstore.store(fd, group_id, env={"NOTIFY_SOCKET": os.fspath(notify_path(cache_dir))})


def forget(cache_dir: Path, group_id: str) -> None:
    if running(cache_dir) is not None:
        fdstore.forget(group_id, env={"NOTIFY_SOCKET": os.fspath(notify_path(cache_dir))})


def fetch(cache_dir: Path) -> tuple[int, str] | None:
    """(group fd, group id) from the live keeper, None if it keeps none or none answers."""
    if running(cache_dir) is None:
        return None
    with contextlib.suppress(OSError):
        ans, fd = handover.request(cache_dir, b"G", path=socket_path(cache_dir))
        if fd is not None:
            log.info("fanotify group %s handed back by the keeper", ans.get("group"))
            return fd, str(ans.get("group"))
    return None


def stop(cache_dir: Path, timeout: float = 5.0) -> None:
    """Ask the keeper to quit (it lets its copy of the group go); SIGKILL if it lingers."""
    pid = running(cache_dir)
    if pid is None:
        remove_stale_cgroup(cache_dir)
        return
    with contextlib.suppress(OSError):
        _ans, fd = handover.request(cache_dir, b"Q", path=socket_path(cache_dir), timeout=2)
        if fd is not None:
            os.close(fd)
    end = time.monotonic() + timeout
    while running(cache_dir) == pid and time.monotonic() < end:
        time.sleep(0.01)
    if running(cache_dir) == pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reaped(pid)
    remove_stale_cgroup(cache_dir)  # (if it was killed: one that quit removed it itself)


def ensure(cache_dir: Path, env: Mapping[str, str] | None = None) -> int | None:
    """Start this cache's keeper if the operator asked for one and none runs; its pid (None when
    not asked for, or it could not start: logged, and the daemon then serves FUSE under `auto`)."""
    env = os.environ if env is None else env
    if not wanted(env):
        return None
    pid = running(cache_dir)
    if pid is not None:
        return pid
    cache_dir = private_dir(os.path.abspath(cache_dir), parents=True)
    remove_stale_cgroup(cache_dir)
    argv = [sys.executable, "-m", "fuse_client.fanotify.keeper", os.fspath(cache_dir)]
    out = os.open(cache_dir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:  # (posix_spawn, not Popen: the keeper outlives whoever started it)
        pid = os.posix_spawn(argv[0], argv, dict(env), setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, out, 2),
        ])
    except OSError as e:
        log.error("cannot start the fanotify keeper: %s", e)
        return None
    finally:
        os.close(out)
    deadline = time.monotonic() + READY_TIMEOUT
    alive = True  # ours has not exited
    while time.monotonic() < deadline:
        live = running(cache_dir)
        if live is not None and (live == pid or not alive):
            return live  # (ours, or another `ensure`'s, which ours gave way to: EXIT_ANOTHER)
        if alive and (status := _exit_status(pid)) is not None:
            alive = False
            if status != EXIT_ANOTHER:
                break
        time.sleep(0.01)
    else:
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while not _reaped(pid):
                time.sleep(0.01)
    log.error("the fanotify keeper did not start (see %s)", cache_dir / LOG_NAME)
    return None


def remove_stale_cgroup(cache_dir: Path) -> None:
    """Remove the cgroup of its own that the last keeper of this cache moved into, if that keeper
    is gone (killed: it did not leave it) and nothing else is in it (the kernel refuses otherwise:
    left alone). Only the default one (`CGROUP_NAME`): an operator's cgroup is theirs."""
    try:
        ident = json.loads((Path(cache_dir) / IDENTITY_NAME).read_text())
        pid, start, rel = int(ident["pid"]), ident["start_time"], ident.get("cgroup")
    except (OSError, ValueError, KeyError, TypeError):
        return
    root = cgroup.v2_root()
    if not isinstance(rel, str) or os.path.basename(rel) != CGROUP_NAME or root is None:
        return
    if proc_start_time(pid) == start:
        return  # (it runs)
    if (root / rel.lstrip("/")).is_dir() and cgroup.remove_if_empty(rel, root):
        log.info("removed the empty cgroup %s of fanotify keeper %d (gone)", rel, pid)


def _exit_status(pid: int) -> int | None:
    """The exit status of `pid` (a keeper this process started) once it exited (reaped), else None;
    -1 if it was not this process's child or was killed by a signal."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1 if proc_start_time(pid) is None else None
    if done != pid:
        return None
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


def _reaped(pid: int) -> bool:
    """Whether `pid` (a keeper this process started) has exited; reaps it."""
    return _exit_status(pid) is not None


# -- the keeper process -----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where `place` put the keeper."""

    text: str  # what it got, for the log and its identity ("placed")
    mine: str | None = None  # the default cgroup it moved into: it leaves and removes it on quitting
    origin: str | None = None  # the cgroup it was started in

    def leave(self) -> None:
        """Out of its own cgroup (into the parent, else back where it came from), which is then
        removed if empty (another cache's keeper may share it). Failures are logged, not raised."""
        if self.mine is None or cgroup.cgroup_of() != self.mine:
            return
        to = [cgroup.parent(self.mine)] + ([self.origin] if self.origin else [])
        if cgroup.leave(self.mine, to):
            log.info("keeper: left and removed cgroup %s", self.mine)
        else:
            log.info("keeper: cgroup %s left in place (not empty, or the kernel refused)", self.mine)


def place(env: Mapping[str, str]) -> Placement:
    """Out of the OOM killer's reach and into a cgroup of its own (module doc); what it got. A
    refusal is logged and the keeper still runs (it is then only as safe as the holder)."""
    got = []
    try:
        cgroup.set_oom_score_adj(cgroup.OOM_SCORE_ADJ_MIN)
    except OSError as e:  # (lowering it needs CAP_SYS_RESOURCE: a container may not grant it)
        log.error("keeper: cannot set oom_score_adj to %d: %s: the OOM killer may choose it", cgroup.OOM_SCORE_ADJ_MIN,
                  e.strerror)
    adj = cgroup.oom_score_adj()
    unsafe = "" if adj == cgroup.OOM_SCORE_ADJ_MIN else " (NOT protected from the OOM killer)"
    got.append(f"oom_score_adj {adj}{unsafe}")
    own = cgroup.cgroup_of()
    rel = env.get(CGROUP_ENV) or (cgroup.sibling(own, CGROUP_NAME) if own is not None else None)
    mine = None
    if rel is None:
        log.warning("keeper: no unified (v2) cgroup: it stays in the cgroups it was started in")
    else:
        try:
            cgroup.move_self(rel)
            got.append(f"cgroup {cgroup.cgroup_of()}")
            mine = rel if not env.get(CGROUP_ENV) else None
        except OSError as e:
            log.error("keeper: cannot move into cgroup %s: %s (it stays in %s)", rel, e, own)
    return Placement(", ".join(got), mine, own)


def _receive(notify: socket.socket, kept: tuple[int, str] | None) -> tuple[int, str] | None:
    """One fd-store message: keep, replace or drop the group (as systemd's fd store would)."""
    fds = array.array("i")
    try:
        msg, anc, _flags, _addr = notify.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
    except OSError:
        return kept
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    what = fdstore.stored_name(fdstore.parse_message(msg))
    take = fds[0] if what is not None and what[0] == "store" and fds and _is_group(fds[0]) else None
    for fd in fds:
        if fd != take:
            os.close(fd)
    if take is not None:
        if kept is not None:
            os.close(kept[0])
        log.info("keeper: keeps fanotify group %s", what[1])  # type: ignore[index]
        return take, what[1]  # type: ignore[index]
    if what is not None and what[0] == "remove" and kept is not None and kept[1] == what[1]:
        os.close(kept[0])
        log.info("keeper: let fanotify group %s go", what[1])
        return None
    return kept


def _is_group(fd: int) -> bool:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            return b"fanotify flags:" in f.read()
    except OSError:
        return False


def _answer(srv: socket.socket, kept: tuple[int, str] | None) -> bytes:
    """Accept one connection and answer `G`, `I` or `Q` (root only); the request ("" if refused)."""
    try:
        conn, _ = srv.accept()
    except OSError:
        return b""
    with conn:
        try:
            conn.settimeout(5)
            if not handover.peer_is_root(conn):
                return b""
            what = conn.recv(1)
            me = json.dumps({"pid": os.getpid(), "group": kept[1] if kept else None}).encode()
            if what == b"G" and kept is not None:
                handover.send_fd(conn, me, kept[0])
            elif what in (b"G", b"I", b"Q"):
                conn.sendall(me)
            return what
        except OSError:
            return b""


def serve(cache_dir: Path, placed: Placement) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    notify = holder.bind(cache_dir, notify_path(cache_dir), socket.SOCK_DGRAM)
    srv = holder.bind(cache_dir, socket_path(cache_dir))
    tmp = cache_dir / f"{IDENTITY_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "start_time": proc_start_time(os.getpid()), "placed": placed.text,
                               "cgroup": placed.mine}))
    os.replace(tmp, cache_dir / IDENTITY_NAME)
    kept: tuple[int, str] | None = None
    while True:
        ready, _, _ = select.select([notify, srv], [], [], CHECK_INTERVAL)
        if notify in ready:
            kept = _receive(notify, kept)
        if srv in ready and _answer(srv, kept) == b"Q":
            log.info("keeper: asked to quit (group %s let go)", kept[1] if kept else None)
            break
        if not cache_dir.is_dir():
            break
    if kept is not None:
        os.close(kept[0])
    notify.close()
    srv.close()
    placed.leave()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper %(levelname)s %(message)s")
    cache_dir = Path(os.path.abspath(argv[1]))
    lock = os.open(cache_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("keeper %d for %s: another keeper runs: exits", os.getpid(), cache_dir)
        return EXIT_ANOTHER
    placed = place(os.environ)  # (the lock stays held until this process ends)
    log.info("keeper %d for %s: %s", os.getpid(), cache_dir, placed.text)
    serve(cache_dir, placed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
