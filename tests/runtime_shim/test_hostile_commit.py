"""Committing a sandbox that fights back, with real runc sandboxes on a real node.

A sandbox's workload keeps swapping, in its own root (so in its upper), a directory for a symlink
to a host directory holding a secret, and a file for a FIFO and for a device node (/dev/zero's
numbers: a disk's would be the host's disk), while commits run one after the other. Every commit
must end before a deadline, and either succeed with sandbox content only (no byte of the host's
secret in the layer, the file's content the sandbox's own, whole or not yet written, or the file absent) or fail with a
clear `BadInput`. Run two ways: through the backends, so that the commit freezes the container
(then nothing changes under the read: no "changed while" refusal at all, and the container runs
on afterwards), and without them, so that the walker alone stands against a live race.

The race runs a few seconds here; `LAYERSTORE_LONG_RACE=1` makes it 30 s per mode
(bench/hostile_commit.py runs that and keeps the figures).

On the code before the untrusted walker, the unfrozen race puts the host's secret into layers
(the swapped directory was listed through the symlink) or hangs on the FIFO, and the frozen one
fails the same way because nothing froze the container."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from testkit import deadline
from testkit.fuse_helpers import wait_until
from testkit.hostile import SECRET, host_dir
from testkit.shim_support import (
    busybox_rootfs,
    needs_busybox,
    needs_root,
    needs_runc,
    store_shim,
    store_with_env,
)

from layerstore import linux
from layerstore.errors import BadInput
from layerstore.store import Store
from runtime_shim.errors import ShimError
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.state import Sandbox
from runtime_shim.sandbox.commit import commit, frozen

LONG = os.environ.get("LAYERSTORE_LONG_RACE") == "1"
RACE_SECONDS = 30.0 if LONG else 3.0
DEADLINE = 60.0  # seconds: a commit not done by then hangs
SANDBOX_FILE = b"sandbox-file\n"
SANDBOX_DATA = b"sandbox-data\n"
# the workload: swap /w/d for a symlink to the host directory ($1), /w/f for a FIFO and for a
# device node, back and forth, forever; /count says how far it got
SWAPPER = """
H=$1
mkdir -p /w/d && echo sandbox-data > /w/d/f && echo sandbox-file > /w/f && touch /ready
n=0
while :; do
  mv /w/d /w/d.x && ln -s "$H" /w/d
  rm -f /w/f && mkfifo /w/f
  rm /w/d && mv /w/d.x /w/d
  rm -f /w/f && mknod /w/f c 1 5
  rm -f /w/f && echo sandbox-file > /w/f
  n=$((n+1)); echo $n > /count
done
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with bb:1, a busybox base that can also ln, mkfifo and mknod."""
    root = tmp_path_factory.mktemp("hostile")
    base = busybox_rootfs(root / "base")
    for applet in ("ln", "mkfifo", "mknod"):
        os.symlink("busybox", base / "bin" / applet)
    return store_with_env(root, base, "--all-root")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return host_dir(tmp_path)


@pytest.fixture
def shim(tmp_path: Path, store: str) -> Iterator[Shim]:
    with store_shim(tmp_path, store) as s:
        yield s


def count(sb: Sandbox) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((Path(sb.upper) / "count").read_text())
    return 0


@contextlib.contextmanager
def hostile_sandbox(shim: Shim, host: Path) -> Iterator[Sandbox]:
    """A mounted sandbox whose runc container runs SWAPPER; deleted and unmounted afterwards,
    whatever happens."""
    sb = shim.mount(MountRequest("bb:1"))
    try:
        backend = shim.backend("runc")
        backend.prepare(sb, ["/bin/sh", "-c", SWAPPER, "swapper", str(host)])
        execution = backend.start(sb.id, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: count(sb) > 0, DEADLINE, "the swapper to run",
                       alive=lambda: execution.process.poll() is None or pytest.fail("the swapper died"))
            yield sb
        finally:
            backend.delete(sb.id)
            execution.process.wait(DEADLINE)
    finally:
        shim.unmount(sb.id)


def bounded(fn: Callable[[], object], unblock: Callable[[], None]) -> object:
    return deadline.bounded(fn, unblock, DEADLINE, "a commit")


def unblock_fifos(upper: Path) -> Callable[[], None]:
    def unblock() -> None:  # a reader blocked in open(2) of a FIFO gets a writer
        for dirpath, _dirs, files in os.walk(upper):
            for name in files:
                with contextlib.suppress(OSError):
                    os.close(os.open(os.path.join(dirpath, name), os.O_WRONLY | os.O_NONBLOCK))
    return unblock


def is_a(path: Path, test: Callable[[int], bool]) -> bool:
    try:
        return test(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def check_layer(store: Store, blob: str, tmp: Path) -> None:
    """The committed layer holds sandbox content only: no byte of the host's secret anywhere in
    the image, /w/f and /w/d/f the sandbox's own content if they are files, no device node but a
    whiteout (the kernel reads the image: a real EROFS mount)."""
    image, mnt = tmp / "layer.img", tmp / "mnt"
    with open(image, "wb") as f:
        store.read_blob(blob, f.fileno())
    assert SECRET not in image.read_bytes(), "host content in the committed layer"
    mnt.mkdir()
    linux.mount_erofs(image, mnt)
    try:
        for rel, want in (("w/f", SANDBOX_FILE), ("w/d/f", SANDBOX_DATA)):
            # (w/d may be a symlink to the host in the layer: this check must not follow it either)
            if all(is_a(mnt / p, stat.S_ISDIR) for p in Path(rel).parents) and is_a(mnt / rel, stat.S_ISREG):
                # (empty: frozen between the shell's creat and its write)
                assert (mnt / rel).read_bytes() in (want, b""), f"{rel}: not the sandbox's content"
        for dirpath, _dirs, files in os.walk(mnt):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                    assert st.st_rdev == 0, f"{name}: a device node in the layer"
    finally:
        linux.umount(mnt)


def race(shim: Shim, sb: Sandbox, *, freeze: bool, tmp: Path) -> dict[str, object]:
    """Commit again and again for RACE_SECONDS; each commit checked. Returns the outcomes."""
    outcomes: Counter[str] = Counter()
    longest = 0.0
    end = time.monotonic() + RACE_SECONDS
    backends = list(shim.backends.values()) if freeze else []
    with Store.open(shim.store_url) as store:
        i = 0
        while time.monotonic() < end or i == 0:
            i += 1
            start = time.monotonic()
            try:
                res = bounded(lambda i=i: commit(store, sb, f"bb:race{i}", backends=backends),
                              unblock_fifos(Path(sb.upper)))
            except BadInput as e:
                why = str(e)
                changed = "changed while" in why or "shrank while" in why
                outcomes["changed" if changed else "device" if "device node" in why else why] += 1
            else:
                outcomes["ok"] += 1
                assert res.frozen == (("runc",) if freeze else ())  # type: ignore[attr-defined]
                with tempfile.TemporaryDirectory(dir=tmp) as t:
                    check_layer(store, res.layer, Path(t))  # type: ignore[attr-defined]
            longest = max(longest, time.monotonic() - start)
    return {"freeze": freeze, "seconds": RACE_SECONDS, "commits": i, "outcomes": dict(outcomes),
            "longest_commit_s": round(longest, 3), "swaps": count(sb)}


@needs_root
@needs_busybox
@needs_runc
@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "live"])
def test_commits_race_a_swapping_sandbox(shim: Shim, host: Path, tmp_path: Path, freeze: bool) -> None:
    with hostile_sandbox(shim, host) as sb:
        report = race(shim, sb, freeze=freeze, tmp=tmp_path)
        before = count(sb)
        wait_until(lambda: count(sb) > before, DEADLINE, "the sandbox to run on after the commits")
        assert shim.backend("runc").status(sb.id) == "running"
    outcomes = report["outcomes"]
    assert isinstance(outcomes, dict)
    assert set(outcomes) <= {"ok", "changed", "device"}, outcomes  # nothing but clear refusals
    if freeze:  # frozen: nothing moved under the read (a device node there when frozen is refused)
        assert "changed" not in outcomes, outcomes
    out = os.environ.get("LAYERSTORE_RACE_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(report) + "\n")


# -- freezing through the seam, without a container -------------------------------------------------
class FakeBackend:
    name = "fake"

    def __init__(self, has: bool = True, pause: bool | Exception = True) -> None:
        self.answer, self.keeps, self.calls = pause, has, []  # type: ignore[var-annotated]

    def has(self, sandbox: str) -> bool:
        return self.keeps

    def pause(self, sandbox: str) -> bool:
        self.calls.append("pause")
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def resume(self, sandbox: str) -> None:
        self.calls.append("resume")


def test_frozen_resumes_what_it_froze_also_on_failure() -> None:
    froze, idle, none = FakeBackend(), FakeBackend(pause=False), FakeBackend(has=False)
    with pytest.raises(BadInput), frozen("s1", [froze, idle, none]) as names:  # type: ignore[list-item]
        assert names == ["fake"] and froze.calls == ["pause"]
        raise BadInput("the build failed")
    assert froze.calls == ["pause", "resume"] and idle.calls == ["pause"] and none.calls == []


def test_a_workload_that_cannot_be_frozen_refuses_the_commit() -> None:
    first, broken = FakeBackend(), FakeBackend(pause=ShimError("runc pause s1: the container could not be frozen"))
    with pytest.raises(ShimError, match="not committed while it may be writing"), \
            frozen("s1", [first, broken]):  # type: ignore[list-item]
        pytest.fail("the commit ran")
    assert first.calls == ["pause", "resume"]


@needs_root
@needs_busybox
@needs_runc
def test_runc_pause_and_resume(shim: Shim, host: Path) -> None:
    backend = shim.backend("runc")
    with hostile_sandbox(shim, host) as sb:
        assert backend.pause(sb.id) is True and backend.status(sb.id) == "paused"
        try:
            at = count(sb)
            time.sleep(0.2)  # (not a timing assertion: a frozen workload makes no progress at all)
            assert count(sb) == at
            assert backend.pause(sb.id) is False  # paused already: not this caller's to resume
        finally:
            backend.resume(sb.id)
        assert backend.status(sb.id) == "running"
    assert backend.pause(sb.id) is False  # gone: nothing to freeze
