"""Layer mounts outside the node lock: one mount per cold layer however many sandboxes want it at
once, the layers of one environment mounted side by side, sandboxes of warm environments never
waiting for a cold one, a failed or abandoned claim handed on, recovery leaving claims in flight
alone, and the node lock reentrant per thread. Images are served from a directory (`DirBlobs`);
slow layer mounts are simulated with events, nothing is timed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit.shim_support import needs_busybox, needs_root, spec

from runtime_shim.errors import ShimError
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.lock import NodeLock
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED, MOUNTING
from tests.runtime_shim.test_shim_mounts import env2, erofs_mounts, images, open_shim  # noqa: F401  (fixtures)

pytestmark = [needs_root, needs_busybox]
WAIT = 30.0  # a guard against a hang, never a measurement


class Gate:
    """Wraps `LayerMounts.mount`: records the calls, and holds the chosen blobs' mounts until
    released (as a cold mount waits for the daemon to fetch metadata)."""

    def __init__(self, shim: Shim, hold: set[str], fail: dict[str, BaseException] | None = None) -> None:
        self.inner = shim.layers.mount
        self.hold = hold
        self.fail = fail or {}
        self.calls: list[str] = []
        self.entered = {b: threading.Event() for b in hold}
        self.go = threading.Event()
        self.shim = shim
        shim.layers.mount = self  # type: ignore[method-assign]

    def __call__(self, blob: str, generation: str) -> Any:
        self.calls.append(blob)
        if blob in self.hold:
            self.entered[blob].set()
            assert self.go.wait(WAIT)
        if blob in self.fail:
            raise self.fail.pop(blob)  # the first attempt only
        return self.inner(blob, generation)


def node_lock_free(shim: Shim) -> bool:
    import fcntl
    import os

    fd = os.open(shim.paths.lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_for(cond: Callable[[], bool]) -> bool:
    for _ in range(int(WAIT * 100)):
        if cond():
            return True
        threading.Event().wait(0.01)
    return cond()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, out


def test_a_cold_layer_is_mounted_once_outside_the_lock_and_its_layers_side_by_side(
        node: Path, images: dict[str, object]) -> None:  # noqa: F811
    base, tk = images["base"], images["toolkit"]
    with open_shim(node, images) as shim:
        warm = spec((images["base"], "base"))  # type: ignore[arg-type]
        gate = Gate(shim, {base, tk})  # type: ignore[arg-type]
        threads = [in_thread(lambda: shim.mount(MountRequest(env2(images)))) for _ in range(4)]
        try:
            # both layers of the environment are being mounted at once (neither waits for the other)
            assert gate.entered[base].wait(WAIT) and gate.entered[tk].wait(WAIT)  # type: ignore[index]
            # every sandbox has its references and waits; nobody holds the node lock meanwhile
            assert wait_for(lambda: shim.layer_refs() == {base: 4, tk: 4})
            # (the last to take its references may still be finishing its locked section: wait for
            # it; a layer mount made under the lock would keep it held while the gate is closed)
            assert wait_for(lambda: node_lock_free(shim))
        finally:
            gate.go.set()
            for th, _ in threads:
                th.join(WAIT)
        results = [out for _, out in threads]
        assert all("value" in r for r in results), results
        assert sorted(gate.calls) == sorted([base, tk])  # one mount per layer for four sandboxes
        assert shim.layer_refs() == {base: 4, tk: 4}
        assert len(erofs_mounts(node)) == 2
        with shim.state.read() as t:
            assert {lm.status for lm in t.layers()} == {MOUNTED} and all(lm.owner is None for lm in t.layers())
        more = shim.mount(MountRequest(warm))
        for r in results:
            shim.unmount(r["value"].id)
        shim.unmount(more.id)
        assert shim.layer_refs() == {} and erofs_mounts(node) == []


def test_a_warm_environment_does_not_wait_for_a_cold_one(node: Path, images: dict[str, object]) -> None:  # noqa: F811
    base, tk = images["base"], images["toolkit"]
    with open_shim(node, images) as shim:
        first = shim.mount(MountRequest(spec((base, "base"))))  # type: ignore[arg-type]
        gate = Gate(shim, {tk})  # type: ignore[arg-type]
        cold, out = in_thread(lambda: shim.mount(MountRequest(env2(images))))
        try:
            assert gate.entered[tk].wait(WAIT)  # type: ignore[index]
            warm = shim.mount(MountRequest(spec((base, "base"))))  # type: ignore[arg-type]  (while toolkit is mid-mount)
            assert shim.check(warm.id).ok
            with shim.state.read() as t:
                lm = t.layer(tk)  # type: ignore[arg-type]
                assert lm is not None and lm.status == MOUNTING and lm.in_flight
            assert shim.recover_if_needed() is None  # a claim in flight is not a reason to recover
            rep = shim.recover()  # and the full recovery leaves it alone
            assert tk not in rep.remounted_layers and not rep.orphan_mounts and not rep.rolled_back
        finally:
            gate.go.set()
            cold.join(WAIT)
        assert "value" in out, out
        assert gate.calls == [tk]
        for sb in (first, warm, out["value"]):
            shim.unmount(sb.id)
        assert shim.layer_refs() == {} and erofs_mounts(node) == []


def test_a_failed_layer_mount_fails_its_waiters_and_is_tried_again(node: Path, images: dict[str, object]) -> None:  # noqa: F811
    base, tk = images["base"], images["toolkit"]
    with open_shim(node, images) as shim:
        gate = Gate(shim, {tk}, fail={tk: ShimError("layer toolkit: simulated failure")})  # type: ignore[dict-item]
        threads = [in_thread(lambda: shim.mount(MountRequest(env2(images)))) for _ in range(3)]
        try:
            assert gate.entered[tk].wait(WAIT)  # type: ignore[index]
            assert wait_for(lambda: shim.layer_refs().get(tk) == 3)  # type: ignore[call-overload]  (all waiting)
        finally:
            gate.go.set()
            for th, _ in threads:
                th.join(WAIT)
        errors = [out.get("error") for _, out in threads]
        assert all(isinstance(e, ShimError) and "simulated failure" in str(e) for e in errors), errors
        assert gate.calls.count(tk) == 1
        assert shim.sandboxes() == [] and shim.layer_refs() == {} and erofs_mounts(node) == []
        sb = shim.mount(MountRequest(env2(images)))  # the next mount claims it again
        assert shim.layer_refs() == {base: 1, tk: 1}
        shim.unmount(sb.id)


class Abandon(BaseException):
    """Not an Exception: the claimant goes away without an outcome (as on KeyboardInterrupt)."""


def test_an_abandoned_claim_is_taken_over_by_a_waiter(node: Path, images: dict[str, object]) -> None:  # noqa: F811
    base, tk = images["base"], images["toolkit"]
    with open_shim(node, images) as shim:
        gate = Gate(shim, {tk}, fail={tk: Abandon()})  # type: ignore[dict-item]
        first, out1 = in_thread(lambda: shim.mount(MountRequest(env2(images), sandbox="first")))
        try:
            assert gate.entered[tk].wait(WAIT)  # type: ignore[index]
            second, out2 = in_thread(lambda: shim.mount(MountRequest(env2(images), sandbox="second")))
            # the second sandbox holds its references and waits for the first one's claim
            assert wait_for(lambda: shim.layer_refs().get(tk) == 2)  # type: ignore[call-overload]
        finally:
            gate.go.set()
            first.join(WAIT)
        second.join(WAIT)
        assert isinstance(out1.get("error"), Abandon)
        assert "value" in out2, out2
        assert gate.calls.count(tk) == 2  # tried by the first, taken over by the second
        assert [s.id for s in shim.sandboxes()] == ["second"]
        assert shim.layer_refs() == {base: 1, tk: 1} and shim.check("second").ok
        shim.unmount("second")
        assert shim.layer_refs() == {} and erofs_mounts(node) == []


def test_a_claim_whose_process_died_is_taken_by_the_next_mount(node: Path, images: dict[str, object]) -> None:  # noqa: F811
    import subprocess
    import sys

    base, tk = images["base"], images["toolkit"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open_shim(node, images) as shim:
        with shim.state.write() as t:  # a claim left by a process that is gone (no sandbox of its own)
            shim.layers.take(t, tk, "dir")  # type: ignore[arg-type]
            lm = t.layer(tk)  # type: ignore[arg-type]
            assert lm is not None
            lm.owner, lm.refs = {"pid": int(dead.stdout), "start": 1}, 0
            t.put_layer(lm)
        sb = shim.mount(MountRequest(env2(images)))
        assert shim.layer_refs() == {base: 1, tk: 1} and shim.check(sb.id).ok
        shim.unmount(sb.id)
        assert shim.layer_refs() == {} and erofs_mounts(node) == []


def test_the_node_lock_is_reentrant_per_thread_and_exclusive_between_threads(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "lock")
    order: list[str] = []
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with lock:
            with lock:  # reentrant in one thread
                order.append("a-in")
                held.set()
                assert release.wait(WAIT)
            order.append("a-still-holds")
        order.append("a-out")

    a = threading.Thread(target=holder)
    a.start()
    try:
        assert held.wait(WAIT)
        b, _ = in_thread(lambda: (lock.__enter__(), order.append("b-in"), lock.__exit__(None, None, None)))
        b.join(0.2)  # b must be waiting: a holds the lock (b-in cannot come before a-out)
        assert "b-in" not in order
    finally:
        release.set()
        a.join(WAIT)
    b.join(WAIT)
    assert order.index("a-still-holds") < order.index("b-in")
    assert not lock.held


class HintedBlobs(DirBlobs):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.sent: list[tuple[str, list[int]]] = []
        self.fail = False

    def prefetch(self, blob: str, chunks: list[int]) -> None:
        if self.fail:
            raise OSError("no daemon")
        self.sent.append((blob, list(chunks)))


def hints_sent(shim: Shim) -> None:
    for th in shim._hint_threads:
        th.join(WAIT)


def test_prefetch_hints_are_sent_once_per_chunk_per_node(node: Path, images: dict[str, object]) -> None:  # noqa: F811
    from dataclasses import replace

    base, tk = images["base"], images["toolkit"]
    blobs = HintedBlobs(images["blobs"])  # type: ignore[arg-type]
    one = replace(env2(images), prefetch={base: (3, 1, 2), tk: (0,), "b3:" + "c" * 64: (5,)})
    two = replace(spec((base, "base")), prefetch={base: (2, 7)})  # type: ignore[arg-type]
    with Shim(NodePaths(node), blobs) as shim:
        a = shim.mount(MountRequest(one))
        b = shim.mount(MountRequest(one))
        hints_sent(shim)
    assert sorted(blobs.sent) == sorted([(base, [3, 1, 2]), (tk, [0])])  # in order; other blobs ignored
    blobs.sent.clear()
    with Shim(NodePaths(node), blobs) as shim:  # another process, later: nothing is sent again
        c = shim.mount(MountRequest(one))
        blobs.fail = True
        d = shim.mount(MountRequest(two))  # a failed send is not recorded ...
        hints_sent(shim)
        blobs.fail = False
    assert blobs.sent == []
    with Shim(NodePaths(node), blobs) as shim:
        e = shim.mount(MountRequest(two))  # ... and is tried again; only the chunks not sent before
        hints_sent(shim)
        for sb in (a, b, c, d, e):
            shim.unmount(sb.id)
    assert blobs.sent == [(base, [7])]


class PinningBlobs(DirBlobs):
    """Every blob is 'complete': pin returns its image file (a local file, as the daemon's cache
    data file is). Records the calls; the generation can change (a daemon restart)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.held: dict[str, str] = {}  # holder -> blob
        self.calls: list[tuple[str, str]] = []
        self.gen = "daemon:1"
        self.mounted_at_unpin: list[bool] = []

    def generation(self) -> str | None:
        return self.gen

    def ensure(self) -> str:
        return self.gen

    def pin(self, blob: str, holder: str) -> Path | None:
        self.calls.append(("pin", holder))
        self.held[holder] = blob
        return self.path(blob)

    def unpin(self, blob: str, holder: str) -> None:
        from layerstore import linux

        self.calls.append(("unpin", holder))
        self.mounted_at_unpin.append(linux.is_mount(holder.split(":", 1)[1]))
        self.held.pop(holder, None)

    def pins(self, prefix: str) -> list[tuple[str, str]]:
        return [(b, h) for h, b in self.held.items() if h.startswith(prefix)]


def test_direct_mounts_need_no_daemon_and_are_unpinned_after_the_last_user(
        node: Path, images: dict[str, object]) -> None:  # noqa: F811
    base, tk = images["base"], images["toolkit"]
    blobs = PinningBlobs(images["blobs"])  # type: ignore[arg-type]
    with Shim(NodePaths(node), blobs) as shim:
        a = shim.mount(MountRequest(env2(images)))
        b = shim.mount(MountRequest(spec((base, "base"))))  # type: ignore[arg-type]
        with shim.state.read() as t:
            lms = {lm.blob: lm for lm in t.layers()}
        assert {lm.pin for lm in lms.values()} == {shim.layers.holder(base), shim.layers.holder(tk)}  # type: ignore[arg-type]
        assert all(lm.generation == "direct" for lm in lms.values())
        assert sorted(blobs.calls) == sorted(("pin", lm.pin) for lm in lms.values())  # one pin per layer
        blobs.gen = "daemon:2"  # the daemon restarted: direct mounts are not stale
        assert shim.recover_if_needed() is None
        rep = shim.recover()
        assert rep.remounted_layers == [] and rep.remounted_sandboxes == [] and shim.check(a.id).ok
        blobs.held["shim:" + str(node / "layers" / ("d" * 64))] = "b3:" + "d" * 64  # a pin no record holds
        shim.recover()
        assert set(blobs.held) == {lm.pin for lm in lms.values()}  # reconciled: the stray one is gone
        shim.unmount(a.id)
        assert blobs.held == {shim.layers.holder(base): base}  # type: ignore[arg-type]  (toolkit's last user left)
        shim.unmount(b.id)
        assert blobs.held == {} and erofs_mounts(node) == []
        assert blobs.mounted_at_unpin == [False, False, False]  # always after the unmount
