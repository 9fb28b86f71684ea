"""16 sandboxes reading in a loop while the node daemon is killed with -9 and restarted N times
(issue 18; docs/fanotify.md): on the fanotify data path every read must complete with the right
bytes. Each cycle starts on a cold mount (the layer unmounted, detached, evicted, attached and
mounted again: an attached blob is never evicted, docs/fanotify.md window 7), so the readers need
fills across the gap.

    sudo .venv/bin/python bench/daemon_restart.py [--restarts N] [--readers 16]
        [--kill-all [--fd-store | --keeper [--kill-keeper]]]

N defaults to 100 (`BENCH_SIZE=full`, and the kill-all run: 30) or 8 at `BENCH_SIZE=quick` (what
`make bench` runs: about a minute).

Writes bench/results/daemon_restart.json (daemon_restart-quick.json at quick): restarts, reads,
failed reads, wrong reads, the gaps (kill to the next daemon answering), the load average, and
what the successors answered and filled.

`--kill-all` (bench/results/daemon_restart-kill-all.json): the daemon is started by the runtime
shim's supervisor (runtime_shim.supervise.daemon, with its watch process), and each cycle kills the daemon
*and* the fanotify holder with -9 at once: the group dies with them. Measured per cycle: how long
until the watch has made a new group with the attached file marked (`marks_back`: from the kill
until the watch's new group, or the new holder's, shows the mark; holes read as zeros before it:
the window), until a
daemon answers again (`daemon_back`), and the reads that returned wrong bytes (zeros read in the
window) or failed.

`--kill-all --fd-store` (bench/results/daemon_restart-kill-all-fdstore.json; 30 cycles, 4 at
quick): the default configuration, the one `auto` takes fanotify in. A stand-in service manager
(testkit.fdstore_manager, in this process: it plays PID 1 and is never killed) owns the notify
socket, keeps the group the daemon stores with FDSTORE=1, and restarts a daemon that dies with
the stored fds at 3.. (LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID), `$FDSTORE` and `$NOTIFY_SOCKET`
set and no `$LAYERSTORE_DATA_PATH` (checked: /stats says fanotify, because of the fd store). No
shim watch runs (the shim is not involved). Each cycle: a cold mount, the readers reading for
0.02-0.12 s, then the daemon and the holder killed with -9 at once. Measured per cycle: whether the
blob still had holes at the kill (`marked_at_kill`: its mark stays until the blob is complete),
until the manager's next daemon answers (`daemon_back`), until every reader has completed a read
started after the kill (`reads_back`), whether the group stayed the same, and the failed and
wrong reads. Exits 1 on any failed or wrong read, or a read still waiting 30 s after the next
daemon answered (`cycles_with_a_stuck_read`: see docs/benchmarks-fanotify.md for the one seen).

`--kill-all --keeper` (bench/results/daemon_restart-kill-all-keeper-<size>.json, size quick or
full; 30 cycles, 4 at quick): a node without systemd whose operator opted in to our keeper
(`LAYERSTORE_FANOTIFY_KEEPER=1`, docs/fanotify.md "A keeper without systemd"). The runtime shim's
supervisor starts the keeper, the daemon (`auto`: fanotify because of the keeper; checked) and
the watch. Each cycle: a cold mount, the readers reading for 0.02-0.12 s, then every process of
ours but the keeper killed with -9 at once (the watch, the daemon, the holder); the keeper's
copy of the group keeps the marks, so reads of holes wait; then the bench plays the next shim call
(`DaemonSupervisor.start`: the daemon takes the group back from the keeper). Expected: 0 wrong
and 0 failed reads, the same group every cycle; exits 1 otherwise. With `--kill-keeper`
(...-kill-all-keeper-all-<size>.json) the keeper is killed too, with everything of ours: the group
dies, holes read as zeros until the next shim call's daemon marks the files on a new group (its
keeper started again first). The bench makes that call at once, so its zero reads are a floor:
on a node the window lasts until the next shim call. It counts the wrong reads, how many of them
differ from the source only by zero pages (`wrong_zero_reads`: holes read without a group), the
failed reads, and when the new group had the file marked (`marks_back`); exits 1 only on a wrong
read that is not zeros. Measured per cycle in both: whether the blob still had holes at the kill
(`marked_at_kill`), whether the keeper's copy still marked it after the kill (`keeper_kept_marks`),
until the next daemon's mount answers (`daemon_back`), until every reader has completed a read
started after the kill (`reads_back`), the same group or not, and the reads wrong, zero or failed
(counted by when they ended: from this cycle's kill to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests" / "support"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from testkit.fanotify_cycles import remount_cold  # noqa: E402
from testkit.fanotify_helpers import mounted_layer, node_daemon, process_marks, read_uncached, start_daemon  # noqa: E402,E501
from testkit.fuse_helpers import build_and_push, make_tree  # noqa: E402

from erofs_builder.build import BuiltLayer  # noqa: E402
from fuse_client.control import request_json  # noqa: E402
from layerstore import linux  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.store import Store  # noqa: E402


def pushed_layer(tmp: Path, big: tuple[int, ...] = (8 << 20, 2 << 20)) -> tuple[PosixBackend, BuiltLayer,
                                                                                 dict[Path, bytes]]:
    """A local store under `tmp` with one layer pushed, and the layer's files' bytes by path."""
    backend = PosixBackend(tmp / "store", fsync=False)
    backend.create()
    store = Store(backend)
    store.init()
    src = make_tree(tmp / "src", small=200, big=big)
    layer = build_and_push(store, src, tmp / "image.erofs")
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    return backend, layer, {rel: (src / rel).read_bytes() for rel in files}


class Readers:
    """`n` threads reading random files of the layer mounted at `root`, uncached, each read compared
    with the source: the reads, the failed ones and the ones that returned wrong bytes."""

    def __init__(self, n: int, root: Path, want: dict[Path, bytes]) -> None:
        self.root = root
        self.want = want
        self.files = sorted(want)
        self.stop = threading.Event()
        self.reads = [0] * n
        self.failed: list[str] = []
        self.wrong: list[str] = []
        self.wrong_at: list[float] = []  # when each wrong read ended (time.monotonic)
        self.zero_at: list[float] = []  # ... each wrong read that differs only by zero pages (holes)
        self.failed_at: list[float] = []  # ... each failed read
        self.since: float | None = None  # (`mark`) and when each reader's first read started since it ended
        self.first_after: list[float | None] = [None] * n
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.read_loop, args=(k, self.stop), daemon=True)
                        for k in range(len(self.reads))]
        for t in self.threads:
            t.start()

    def read_loop(self, k: int, stop: threading.Event) -> None:
        rng = random.Random(k * 7919 + self.reads[k])
        while not stop.is_set():
            rel = rng.choice(self.files)
            t0 = time.monotonic()
            try:
                got = read_uncached(self.root / rel)
            except OSError as e:
                self.failed_at.append(time.monotonic())
                self.failed.append(f"{rel}: {e}")
                continue
            if got != self.want[rel]:
                now = time.monotonic()
                if zeros_where_wrong(got, self.want[rel]):
                    self.zero_at.append(now)
                self.wrong_at.append(now)
                self.wrong.append(str(rel))
            self.reads[k] += 1
            since = self.since
            if since is not None and t0 >= since and self.first_after[k] is None:
                self.first_after[k] = time.monotonic()

    def mark(self, t: float) -> None:
        """From now on note, per reader, when its first read that started at or after `t` ended."""
        self.first_after = [None] * len(self.reads)
        self.since = t

    def all_back(self) -> float | None:
        """When the last reader completed its first read started since `mark` (None: not yet)."""
        ends = self.first_after
        return None if any(e is None for e in ends) else max(e for e in ends if e is not None)

    def total(self) -> int:
        return sum(self.reads)

    def wait_reads(self, n: int = 64) -> None:
        """Until `n` more reads are done (the last restart's reads went through)."""
        before = self.total()
        while self.total() < before + n:
            time.sleep(0.01)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        self.threads = []

    def cold_cycle(self, cache: Path, blob: str, holder: str) -> int:
        """Stop reading, make the layer cold again (`remount_cold`), read again; the bytes evicted."""
        self.join()
        evicted = remount_cold(cache, blob, self.root, holder)
        self.start()
        return evicted

    def summary(self) -> dict[str, Any]:
        return {"readers": len(self.reads), "reads": self.total(), "failed_reads": len(self.failed),
                "wrong_reads": len(self.wrong), "wrong_zero_reads": len(self.zero_at),
                "failed_examples": self.failed[:5], "wrong_examples": self.wrong[:5]}

    def ended_between(self, t0: float, t1: float) -> dict[str, Any]:
        """The wrong, zero and failed reads that ended in [t0, t1), and when the wrong ones ended
        (seconds after t0: min, median, max)."""
        wrong = [t - t0 for t in self.wrong_at if t0 <= t < t1]
        return {"wrong_reads": len(wrong), "wrong_zero_reads": sum(t0 <= t < t1 for t in self.zero_at),
                "failed_reads": sum(t0 <= t < t1 for t in self.failed_at),
                "wrong_read_ends_s": spread(wrong)}


def zeros_where_wrong(got: bytes, want: bytes, page: int = 4096) -> bool:
    """Whether `got` differs from `want` only by pages of zeros (a hole read while no group
    marked the file), the length the same (pure)."""
    if len(got) != len(want):
        return False
    zero = bytes(page)
    for off in range(0, len(want), page):
        g = got[off : off + page]
        if g != want[off : off + page] and g != zero[: len(g)]:
            return False
    return True


def kill_all(args: argparse.Namespace) -> int:
    """The `--kill-all` run (module doc)."""
    from testkit.fanotify_helpers import holder_marks, stop_holder, unmount_and_detach

    from fuse_client.control import attach
    from fuse_client.fanotify import handover
    from layerstore.linux import mount_erofs
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import NodeState
    from runtime_shim.supervise.daemon import DaemonSupervisor, is_alive

    os.environ["LAYERSTORE_DATA_PATH"] = "fanotify"
    os.environ.pop("LAYERSTORE_DAEMON_WATCH", None)
    with tempfile.TemporaryDirectory(prefix="daemon-kill-all-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        backend, layer, want = pushed_layer(tmp)
        paths = NodePaths(tmp / "node")
        paths.root.mkdir()
        sup = DaemonSupervisor(paths)
        state = NodeState(paths.state)
        target = tmp / "layer"
        target.mkdir()
        readers = Readers(args.readers, target, want)
        cycles: list[dict[str, Any]] = []
        last_kill = 0.0
        rec = sup.start(backend.url)
        with state.write() as t:
            t.put_daemon(rec)
        started = False
        try:
            got = attach(paths.cache, layer.blob, "bench")
            assert got is not None
            mount_erofs(Path(got["path"]), target)
            readers.start()
            started = True
            for i in range(args.restarts):
                while True:  # (the watch records the new daemon once its mount answers)
                    with state.read() as t:
                        rec = t.daemon()
                    if rec is not None and is_alive(rec):
                        break
                    time.sleep(0.01)
                evicted = readers.cold_cycle(paths.cache, layer.blob, "bench") if i else 0
                time.sleep(random.uniform(0.05, 0.3))
                ident = handover.read_identity(paths.cache)
                assert ident is not None
                w0 = len(readers.wrong)
                k0 = time.monotonic()
                os.kill(rec.pid, 9)
                os.kill(ident[0], 9)
                marks = daemon = None
                while marks is None:  # (first: a daemon being asked could hold this loop up)
                    if time.monotonic() - k0 > 120:
                        raise RuntimeError("no new group within 120 s")
                    if process_marks(sup.watch_pid()) >= 1 or (
                            (cur := handover.read_identity(paths.cache)) is not None and cur[1] != ident[1]
                            and holder_marks(paths.cache) >= 1):
                        marks = time.monotonic() - k0
                    time.sleep(0.0005)
                while daemon is None:
                    if time.monotonic() - k0 > 120:
                        raise RuntimeError("no daemon within 120 s")
                    try:
                        if request_json(paths.cache, "GET", "/stats", timeout=2)["pid"] != rec.pid:
                            daemon = time.monotonic() - k0
                    except Exception:  # (not up yet)
                        time.sleep(0.005)
                cycles.append({"marks_back_s": round(marks, 4), "daemon_back_s": round(daemon, 3),
                               "wrong_reads": len(readers.wrong) - w0, "evicted_before": evicted})
                if i:  # wrong reads that ended since the last cycle's kill, in seconds after it
                    cycles[-2]["wrong_read_ends_s"] = [round(t - last_kill, 3) for t in readers.wrong_at
                                                       if last_kill <= t < k0]
                last_kill = k0
                print(f"cycle {i + 1}/{args.restarts}: marks back after {marks:.3f} s, daemon after {daemon:.2f} s, "
                      f"reads {readers.total()}, failed {len(readers.failed)}, wrong {len(readers.wrong)}", flush=True)
            readers.wait_reads()
            if cycles:
                cycles[-1]["wrong_read_ends_s"] = [round(t - last_kill, 3) for t in readers.wrong_at
                                                   if t >= last_kill]
        finally:
            if started:
                readers.join()
            unmount_and_detach(paths.cache, layer.blob, "bench", target)
            with state.read() as t:
                rec = t.daemon()
            sup.stop(rec)
            stop_holder(paths.cache)
            state.close()
            if linux.is_mount(paths.fuse):
                linux.umount(paths.fuse, lazy=True)
        watch_lines = [ln for ln in paths.daemon_log.read_text(errors="replace").splitlines() if " watch " in ln]
        med = sorted(c["marks_back_s"] for c in cycles)
        result = {
            "mode": "kill-all (daemon and holder, -9, at once; the shim's watch regroups and restarts)",
            "cycles": len(cycles), **readers.summary(),
            "marks_back_seconds": {"min": med[0], "median": med[len(med) // 2], "max": med[-1]} if med else None,
            "daemon_back_seconds_median": sorted(c["daemon_back_s"] for c in cycles)[len(cycles) // 2] if cycles
            else None,
            "per_cycle": cycles, "watch_log": watch_lines[-2 * len(cycles):], "loadavg": os.getloadavg(),
            "blob_bytes": layer.size,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_cycle"}, indent=2))
    return 0


STUCK_AFTER = 30.0  # seconds a read may still wait after the next daemon answers before it counts as stuck


def spread(xs: list[float], ndigits: int = 3) -> dict[str, float] | None:
    xs = sorted(xs)
    return {"min": round(xs[0], ndigits), "median": round(xs[len(xs) // 2], ndigits),
            "max": round(xs[-1], ndigits)} if xs else None


def kill_all_fd_store(args: argparse.Namespace) -> int:
    """The `--kill-all --fd-store` run (module doc): the default data path under a stand-in
    service manager that keeps the group; every process of ours killed at once each cycle."""
    from testkit.fanotify_helpers import stop_holder, unmount_and_detach
    from testkit.fdstore_manager import FdStoreManager

    from fuse_client.control import attach
    from fuse_client.fanotify import handover
    from layerstore.linux import mount_erofs

    for k in ("LAYERSTORE_DATA_PATH", "LAYERSTORE_DAEMON_WATCH"):
        os.environ.pop(k, None)  # (the daemon's own default decides: auto)
    t_start = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="daemon-kill-all-fdstore-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        # (a bigger blob than the other modes': the readers must not have filled it all before the
        # kill, or no read needs the group; `marked_at_kill` says whether holes were left)
        backend, layer, want = pushed_layer(tmp, (24 << 20, 8 << 20, 2 << 20))
        cache, target = tmp / "cache", tmp / "layer"
        target.mkdir()
        mgr = FdStoreManager(backend.url, cache, tmp / "mnt", tmp)
        readers = Readers(args.readers, target, want)
        cycles: list[dict[str, Any]] = []
        answered = {"leftovers": 0, "unknown": 0}
        filled_by_successors = 0
        stuck: list[int] = []  # cycles where a read waited STUCK_AFTER beyond the next daemon's answer
        started = False
        try:
            pid = mgr.start()
            stats = request_json(cache, "GET", "/stats")
            choice = {"data_path": stats["data_path"], "data_path_reason": stats["data_path_reason"]}
            if stats["data_path"] != "fanotify" or "fd store" not in stats["data_path_reason"]:
                raise RuntimeError(f"the default data path under the manager is not fanotify by the fd store: {choice}")
            got = attach(cache, layer.blob, "bench")
            assert got is not None and got["data_path"] == "fanotify", got
            stored = mgr.wait_stored()
            generation = handover.holder_generation(cache)
            if generation != "fanotify:" + stored.removeprefix("fanotify-"):
                raise RuntimeError(f"the holder's group {generation} is not the stored one {stored}")
            mount_erofs(Path(got["path"]), target)
            readers.start()
            started = True
            for i in range(args.restarts):
                evicted = readers.cold_cycle(cache, layer.blob, "bench") if i else 0
                time.sleep(random.uniform(0.02, 0.12))  # (sooner than the other modes: holes left)
                stats = request_json(cache, "GET", "/stats")
                if stats["pid"] != pid or stats["data_path"] != "fanotify":
                    raise RuntimeError(f"cycle {i + 1}: /stats {stats['pid']} {stats['data_path']}")
                if i:  # (what this successor answered and filled so far)
                    answered["leftovers"] += stats["fanotify"]["leftovers_answered"]
                    answered["unknown"] += stats["fanotify"]["unknown_answered"]
                    filled_by_successors += stats["fanotify"]["filled"]
                ident = handover.read_identity(cache)
                assert ident is not None
                marked = process_marks(ident[0]) >= 1  # (the blob still had holes)
                w0, f0 = len(readers.wrong), len(readers.failed)
                k0 = time.monotonic()
                readers.mark(k0)
                os.kill(pid, 9)  # every process of ours at once: the daemon, the holder (no watch runs)
                os.kill(ident[0], 9)
                pid = mgr.wait_answering(not_pid=pid, timeout=120)
                daemon_back = time.monotonic() - k0
                while (back := readers.all_back()) is None:
                    if time.monotonic() - k0 > 120:
                        raise RuntimeError(f"cycle {i + 1}: readers stuck 120 s after the kill")
                    time.sleep(0.005)
                same = handover.holder_generation(cache) == generation
                if back - k0 > daemon_back + STUCK_AFTER:
                    stuck.append(i + 1)
                cycles.append({"daemon_back_s": round(daemon_back, 3), "reads_back_s": round(back - k0, 3),
                               "fds_passed": mgr.starts[-1][2], "same_group": same, "marked_at_kill": marked,
                               "wrong_reads": len(readers.wrong) - w0, "failed_reads": len(readers.failed) - f0,
                               "evicted_before": evicted})
                print(f"cycle {i + 1}/{args.restarts}: holes {marked}, daemon after {daemon_back:.2f} s, every reader "
                      f"done a read after {back - k0:.2f} s, reads {readers.total()}, failed {len(readers.failed)}, "
                      f"wrong {len(readers.wrong)}, same group {same}", flush=True)
            readers.wait_reads()
            fan = request_json(cache, "GET", "/stats")["fanotify"]
            answered["leftovers"] += fan["leftovers_answered"]
            answered["unknown"] += fan["unknown_answered"]
            filled_by_successors += fan["filled"]
        finally:
            if started:
                readers.join()
            if args.daemon_log is not None:
                args.daemon_log.write_text(mgr.log_text())
            unmount_and_detach(cache, layer.blob, "bench", target)
            mgr.close()
            stop_holder(cache)
        quick = os.environ.get("BENCH_SIZE", "full") == "quick"
        result = {
            "mode": "kill-all under a stand-in service manager keeping the group (fd store; the default data "
                    "path): daemon and holder killed -9 at once, no shim watch; the manager restarts the daemon "
                    "with the stored group (Restart=on-failure, RestartSec=100ms)",
            **choice, "cycles": len(cycles), **readers.summary(),
            "daemon_back_seconds": spread([c["daemon_back_s"] for c in cycles]),
            "reads_back_seconds": spread([c["reads_back_s"] for c in cycles]),
            "every_cycle_same_group": all(c["same_group"] for c in cycles),
            "cycles_with_a_stuck_read": stuck,
            "cycles_killed_with_holes": sum(c["marked_at_kill"] for c in cycles),
            "daemon_starts": len(mgr.starts), "spawn_errors": mgr.spawn_errors,
            "answered_by_successors": answered, "filled_by_successors": filled_by_successors,
            "evicted_bytes_per_cold_cycle": round(sum(c["evicted_before"] for c in cycles[1:]) / (len(cycles) - 1))
            if len(cycles) > 1 else None,
            "size": "quick" if quick else "full", "seconds": round(time.monotonic() - t_start, 1),
            "loadavg_before": load_before, "loadavg": os.getloadavg(), "blob_bytes": layer.size,
            "per_cycle": cycles,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_cycle"}, indent=2))
    return 0 if not readers.failed and not readers.wrong and not stuck and result["every_cycle_same_group"] else 1


class ShimNode:
    """A node as the runtime shim runs it without systemd, with the keeper opted in (`--keeper`):
    the shim's supervisor starts the keeper, the daemon and the watch; `start` is the shim's next
    call that needs a daemon (`DaemonBlobs.ensure`)."""

    def __init__(self, root: Path, store_url: str) -> None:
        from runtime_shim.nodestate.paths import NodePaths
        from runtime_shim.nodestate.state import NodeState
        from runtime_shim.supervise.daemon import DaemonSupervisor

        self.paths = NodePaths(root)
        self.paths.root.mkdir()
        self.cache = self.paths.cache
        self.sup = DaemonSupervisor(self.paths)
        self.state = NodeState(self.paths.state)
        self.store_url = store_url
        self.rec: Any = None

    def start(self) -> None:
        rec = self.sup.start(self.store_url)
        with self.state.write() as t:
            t.put_daemon(rec)
        self.rec = rec

    def restart(self, k0: float, old_group: str | None, new_group: bool,
                timeout: float = 120.0) -> tuple[float | None, float]:
        """The next shim call, in a thread (as the watch starts one). With `new_group` (the old
        group died), meanwhile: when the holder's group, another than `old_group`, has the attached
        file marked (None if it shows no mark within 2 s of the daemon: the blob was complete).
        Returns (marks back, the daemon's mount answering), in seconds after `k0`."""
        from testkit.fanotify_helpers import holder_marks

        from fuse_client.fanotify import handover

        failed: list[BaseException] = []

        def call() -> None:
            try:
                self.start()
            except BaseException as e:  # (raised again below)
                failed.append(e)

        starter = threading.Thread(target=call, daemon=True)
        starter.start()
        marks = daemon = None
        while daemon is None or new_group and marks is None and time.monotonic() - k0 < daemon + 2.0:
            if time.monotonic() - k0 > timeout:
                raise RuntimeError(f"no daemon within {timeout:.0f} s of the kill")
            looking = new_group and marks is None
            if looking and handover.holder_generation(self.cache) not in (None, old_group) and holder_marks(
                    self.cache) >= 1:
                marks = time.monotonic() - k0
            if daemon is None and not starter.is_alive():
                daemon = time.monotonic() - k0
            time.sleep(0.0005 if looking else 0.005)
        starter.join()
        if failed:
            raise failed[0]
        return marks, daemon

    def close(self) -> None:
        """Stop the watch and the daemon, the holder and the keeper; detach the FUSE mount."""
        from testkit.fanotify_helpers import stop_holder

        from fuse_client.fanotify import keeper

        with self.state.read() as t:
            rec = t.daemon()
        self.sup.stop(rec)
        stop_holder(self.cache)
        keeper.stop(self.cache)
        self.state.close()
        if linux.is_mount(self.paths.fuse):
            linux.umount(self.paths.fuse, lazy=True)


def keeper_cycle(node: ShimNode, readers: Readers, blob: str, i: int, kill_keeper: bool) -> dict[str, Any]:
    """One cycle of the `--keeper` run (module doc): a cold mount, reads, every process of ours
    (but the keeper, unless `kill_keeper`) killed -9 at once, the next shim call. What it measured
    (the reads that went wrong are counted after the run, by when they ended)."""
    from fuse_client.fanotify import handover, keeper
    from runtime_shim.supervise.daemon import proc_start_time

    cache = node.cache
    evicted = readers.cold_cycle(cache, blob, "bench") if i else 0
    time.sleep(random.uniform(0.02, 0.12))  # (soon after the cold mount: holes left)
    stats = request_json(cache, "GET", "/stats")
    if stats["pid"] != node.rec.pid or stats["data_path"] != "fanotify":
        raise RuntimeError(f"cycle {i + 1}: /stats {stats['pid']} {stats['data_path']}")
    group, ident, keeper_pid = handover.holder_generation(cache), handover.read_identity(cache), keeper.running(cache)
    watch = node.sup.watch_pid()
    if group is None or ident is None or keeper_pid is None or watch is None:
        raise RuntimeError(f"cycle {i + 1}: group {group}, holder {ident}, keeper {keeper_pid}, watch {watch}")
    kept = keeper.held(cache)
    marked = process_marks(ident[0]) >= 1  # (the blob still had holes)
    victims = [watch, node.rec.pid, ident[0]] + ([keeper_pid] if kill_keeper else [])
    k0 = time.monotonic()
    readers.mark(k0)
    for pid in victims:  # (the watch first: it would restart the daemon or regroup)
        os.kill(pid, 9)
    while any(proc_start_time(pid) is not None for pid in victims):  # (reaps the bench's own children)
        if time.monotonic() - k0 > 30:
            raise RuntimeError(f"cycle {i + 1}: {victims} not all gone 30 s after SIGKILL")
        time.sleep(0.001)
    keeper_marks = None if kill_keeper else process_marks(keeper_pid) >= 1
    marks_back, daemon_back = node.restart(k0, group, new_group=kill_keeper)
    while (back := readers.all_back()) is None:
        if time.monotonic() - k0 > daemon_back + 120:
            raise RuntimeError(f"cycle {i + 1}: readers stuck 120 s after the next daemon")
        time.sleep(0.005)
    return {"kill_t": k0, "daemon_back_s": round(daemon_back, 3), "reads_back_s": round(back - k0, 3),
            "marks_back_s": None if marks_back is None else round(marks_back, 4), "marked_at_kill": marked,
            "keeper_kept_group": kept == group.removeprefix("fanotify:"), "keeper_kept_marks": keeper_marks,
            "same_group": handover.holder_generation(cache) == group,
            "same_keeper": keeper.running(cache) == keeper_pid, "evicted_before": evicted}


def kill_all_keeper(args: argparse.Namespace) -> int:
    """The `--kill-all --keeper [--kill-keeper]` run (module doc): a node without systemd with
    our keeper; every process of ours killed at once each cycle, the keeper spared or not."""
    from testkit.fanotify_helpers import unmount_and_detach

    from fuse_client.control import attach
    from fuse_client.fanotify import keeper
    from layerstore.linux import mount_erofs

    os.environ["LAYERSTORE_DATA_PATH"] = "auto"  # (asked for: the shim starts its watch; the keeper decides)
    os.environ[keeper.OPT_IN_ENV] = "1"
    for k in ("LAYERSTORE_DAEMON_WATCH", keeper.CGROUP_ENV):
        os.environ.pop(k, None)
    t_start, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="daemon-kill-all-keeper-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        backend, layer, want = pushed_layer(tmp, (24 << 20, 8 << 20, 2 << 20))  # (as --fd-store: holes left)
        node = ShimNode(tmp / "node", backend.url)
        target = tmp / "layer"
        target.mkdir()
        readers = Readers(args.readers, target, want)
        cycles: list[dict[str, Any]] = []
        started = False
        try:
            node.start()
            stats = request_json(node.cache, "GET", "/stats")
            choice = {"data_path": stats["data_path"], "data_path_reason": stats["data_path_reason"],
                      "keeper_placed": (keeper.identity(node.cache) or (0, None))[1]}
            if stats["data_path"] != "fanotify" or "keeper process" not in stats["data_path_reason"]:
                raise RuntimeError(f"the default data path with the keeper is not fanotify by the keeper: {choice}")
            got = attach(node.cache, layer.blob, "bench")
            assert got is not None and got["data_path"] == "fanotify", got
            mount_erofs(Path(got["path"]), target)
            readers.start()
            started = True
            for i in range(args.restarts):
                cycles.append(keeper_cycle(node, readers, layer.blob, i, args.kill_keeper))
                c = cycles[-1]
                print(f"cycle {i + 1}/{args.restarts}: holes {c['marked_at_kill']}, marks back {c['marks_back_s']}, "
                      f"daemon after {c['daemon_back_s']:.2f} s, every reader done a read after "
                      f"{c['reads_back_s']:.2f} s, reads {readers.total()}, failed {len(readers.failed)}, "
                      f"wrong {len(readers.wrong)} ({len(readers.zero_at)} zeros), same group {c['same_group']}",
                      flush=True)
            readers.wait_reads()
        finally:
            if started:
                readers.join()
            unmount_and_detach(node.cache, layer.blob, "bench", target)
            node.close()
        kills = [c.pop("kill_t") for c in cycles] + [float("inf")]
        for k, c in enumerate(cycles):
            c.update(readers.ended_between(kills[k], kills[k + 1]))
        result = keeper_result(args, cycles, readers, choice)
        result.update({"seconds": round(time.monotonic() - t_start, 1), "loadavg_before": load_before,
                       "loadavg": os.getloadavg(), "blob_bytes": layer.size, "per_cycle": cycles})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_cycle"}, indent=2))
    if args.kill_keeper:  # (zeros are the window measured; anything else read wrong is a fault)
        return 0 if len(readers.wrong) == len(readers.zero_at) else 1
    ok = not readers.failed and not readers.wrong and not result["cycles_with_a_stuck_read"]
    return 0 if ok and result["every_cycle_same_group"] else 1


def keeper_result(args: argparse.Namespace, cycles: list[dict[str, Any]], readers: Readers,
                  choice: dict[str, Any]) -> dict[str, Any]:
    spared = not args.kill_keeper
    return {
        "mode": ("kill-all with our keeper (no systemd): the watch, the daemon and the holder killed -9 at once, "
                 "the keeper spared; the next shim call starts a daemon, which takes the group back from the keeper"
                 if spared else "kill-all with our keeper killed too (no systemd): the keeper, the watch, the daemon "
                 "and the holder killed -9 at once; the next shim call (made at once) starts a keeper and a daemon, "
                 "which marks the attached file on a new group"),
        "keeper_killed": not spared, **choice, "cycles": len(cycles), **readers.summary(),
        "marks_back_seconds": spread([c["marks_back_s"] for c in cycles if c["marks_back_s"] is not None], 4),
        "daemon_back_seconds": spread([c["daemon_back_s"] for c in cycles]),
        "reads_back_seconds": spread([c["reads_back_s"] for c in cycles]),
        "every_cycle_same_group": all(c["same_group"] for c in cycles),
        "every_cycle_keeper_kept_the_marks": all(c["keeper_kept_marks"] for c in cycles if c["marked_at_kill"])
        if spared else None,  # (a blob complete at the kill has no mark to keep)
        "cycles_with_a_stuck_read": [k + 1 for k, c in enumerate(cycles)
                                     if c["reads_back_s"] > c["daemon_back_s"] + STUCK_AFTER],
        "cycles_killed_with_holes": sum(c["marked_at_kill"] for c in cycles),
        "cycles_with_wrong_reads": sum(c["wrong_reads"] > 0 for c in cycles),
        "evicted_bytes_per_cold_cycle": round(sum(c["evicted_before"] for c in cycles[1:]) / (len(cycles) - 1))
        if len(cycles) > 1 else None,
        "size": "quick" if os.environ.get("BENCH_SIZE", "full") == "quick" else "full",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=None,
                    help="cycles (default: 100, 30 with --kill-all; 8 at BENCH_SIZE=quick, 4 with --fd-store or "
                         "--keeper)")
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--kill-all", action="store_true", help="kill the holder too: the watch's regroup window")
    ap.add_argument("--fd-store", action="store_true",
                    help="with --kill-all: under a stand-in service manager keeping the group (the default data path)")
    ap.add_argument("--keeper", action="store_true",
                    help="with --kill-all: our keeper keeps the group (no systemd); it is spared by the kills")
    ap.add_argument("--kill-keeper", action="store_true", help="with --keeper: the keeper is killed too")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--daemon-log", type=Path, default=None, help="with --fd-store: keep the daemons' log there")
    args = ap.parse_args(argv)
    quick = os.environ.get("BENCH_SIZE", "full") == "quick"
    if (args.fd_store or args.keeper) and not args.kill_all:
        ap.error("--fd-store and --keeper go with --kill-all")
    if args.fd_store and args.keeper:
        ap.error("--fd-store or --keeper: a service manager keeps the group, or our keeper")
    if args.kill_keeper and not args.keeper:
        ap.error("--kill-keeper goes with --keeper")
    if args.restarts is not None and args.restarts < 1 or args.readers < 1:
        ap.error("--restarts and --readers must be at least 1")
    if args.restarts is None:
        args.restarts = (4 if args.fd_store or args.keeper else 8) if quick else 30 if args.kill_all else 100
    if args.out is None and args.keeper:
        args.out = ROOT / "bench" / "results" / (f"daemon_restart-kill-all-keeper{'-all' if args.kill_keeper else ''}"
                                                 f"-{'quick' if quick else 'full'}.json")
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("daemon_restart" + ("-kill-all" if args.kill_all else "")
                                                 + ("-fdstore" if args.fd_store else "")
                                                 + ("-quick" if quick else "") + ".json")
    if args.fd_store:
        return kill_all_fd_store(args)
    if args.keeper:
        return kill_all_keeper(args)
    if args.kill_all:
        return kill_all(args)
    with tempfile.TemporaryDirectory(prefix="daemon-restart-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        backend, layer, want = pushed_layer(tmp)
        gaps: list[float] = []
        answered = {"leftovers": 0, "unknown": 0}
        filled_by_successors = 0
        evicted: list[int] = []
        t0 = time.monotonic()
        with node_daemon(backend.url, tmp, "fanotify") as ds, mounted_layer(ds[-1], layer.blob, "fanotify",
                                                                            tmp) as mnt:
            readers = Readers(args.readers, mnt, want)
            readers.start()
            try:
                for i in range(args.restarts):
                    if i:  # (the first mount is cold already)
                        evicted.append(readers.cold_cycle(ds[-1].cache_dir, layer.blob, "test"))
                    time.sleep(random.uniform(0.05, 0.3))
                    fan = ds[-1].stats()["fanotify"]
                    answered["leftovers"] += fan["leftovers_answered"]
                    answered["unknown"] += fan["unknown_answered"]
                    filled_by_successors += fan["filled"] if i else 0
                    k0 = time.monotonic()
                    ds[-1].kill9()
                    ds.append(start_daemon(backend.url, tmp / "cache", tmp / "mnt", "fanotify"))
                    gaps.append(time.monotonic() - k0)
                    print(f"restart {i + 1}/{args.restarts}: gap {gaps[-1]:.2f} s, reads {readers.total()}, "
                          f"failed {len(readers.failed)}, wrong {len(readers.wrong)}", flush=True)
                readers.wait_reads()
            finally:
                readers.join()
            fan = ds[-1].stats()["fanotify"]
            answered["leftovers"] += fan["leftovers_answered"]
            answered["unknown"] += fan["unknown_answered"]
            filled_by_successors += fan["filled"]
        result = {
            "restarts": args.restarts, **readers.summary(),
            "gap_seconds": {"min": round(min(gaps), 3), "median": round(sorted(gaps)[len(gaps) // 2], 3),
                            "max": round(max(gaps), 3)} if gaps else None,
            "answered_by_successors": answered, "filled_by_successors": filled_by_successors,
            "evicted_bytes_per_cold_cycle": round(sum(evicted) / len(evicted)) if evicted else None,
            "size": "quick" if quick else "full", "seconds": round(time.monotonic() - t0, 1),
            "loadavg": os.getloadavg(), "blob_bytes": layer.size,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if not readers.failed and not readers.wrong else 1


if __name__ == "__main__":
    sys.exit(main())
