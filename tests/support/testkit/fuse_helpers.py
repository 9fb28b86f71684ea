"""Helpers for the FUSE daemon tests: source trees, images pushed to a store, a daemon run as a
`layerctl daemon` subprocess or in-process (in a thread, with any store object, e.g. one whose
backend counts requests), and cleanup that works even when a test fails or the daemon died.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import trio

from erofs_builder.build import BuiltLayer, build_layer, push_layer
from erofs_builder.sources.source_dir import dir_entries
from fuse_client.control import DaemonNotRunning, request_json
from fuse_client.daemon import Daemon, DaemonConfig
from fuse_client.nodecache import Budget, LazyCache, open_cache
from layerstore import linux
from layerstore.backends.base import Backend, ObjectInfo
from layerstore.store import Store

LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
READY_TIMEOUT = 30.0


# -- content ------------------------------------------------------------------------------------
def make_tree(root: Path, *, small: int = 40, big: tuple[int, ...] = (3 << 20,), seed: int = 1) -> Path:
    """A tree of `small` small files in a few directories, plus big files of the given sizes."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(small):
        d = root / f"d{i % 4}"
        d.mkdir(exist_ok=True)
        (d / f"small{i}.txt").write_bytes(rng.randbytes(rng.randint(1, 6000)))
    for j, size in enumerate(big):
        (root / f"big{j}.bin").write_bytes(rng.randbytes(size))
    (root / "link").symlink_to("d0/small0.txt")
    return root


def build_image(src: Path, out: Path) -> BuiltLayer:
    return build_layer(dir_entries(src, all_root=True), out, all_root=True)


def build_and_push(store: Store, src: Path, out: Path) -> BuiltLayer:
    layer = build_image(src, out)
    push_layer(store, layer)
    return layer


# -- the node cache in-process, without a kernel ------------------------------------------------
@contextlib.asynccontextmanager
async def running_lazy_cache(store: Store, cache_dir: Path, *, budget: Budget | None = None,
                             **lazy_kw: Any) -> AsyncIterator[LazyCache]:
    """The node cache at `cache_dir` open and running (its background tasks in a nursery), filled
    from `store` by a `LazyCache(**lazy_kw)`; its last batch committed and its tasks ended after."""
    with contextlib.ExitStack() as stack:
        cache = open_cache(cache_dir, budget, stack)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            yield LazyCache(cache, store, nursery=nursery, **lazy_kw)
            await cache.shutdown_flush()
            nursery.cancel_scope.cancel()


# -- a backend wrapper that counts and can fail ----------------------------------------------------
class CountingBackend(Backend):
    """Counts loads per key (thread-safe); optionally fails every load with an exception."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.loads: Counter[str] = Counter()
        self.fail: BaseException | None = None
        self._lock = threading.Lock()

    def chunk_loads(self) -> Counter[str]:
        with self._lock:
            return Counter({k: n for k, n in self.loads.items() if k.startswith("chunks/")})

    def create(self) -> None:
        self.inner.create()

    def check(self) -> None:
        self.inner.check()

    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        with self._lock:
            self.loads[key] += 1
            fail = self.fail
        if fail is not None:
            raise fail
        return self.inner.load(key, offset, size, max_size=max_size)

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        return self.inner.store_once(key, data)

    def replace(self, key: str, data: bytes) -> None:
        self.inner.replace(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list_info(prefix)


# -- mounts ---------------------------------------------------------------------------------------
def force_unmount(path: Path) -> None:
    """Detach whatever is mounted at `path` (a dead FUSE mount included), quietly."""
    for _ in range(4):
        if not linux.is_mount(path):
            return
        with contextlib.suppress(Exception):
            linux.umount(path, lazy=True)


def blob_path(mountpoint: Path, blob: str) -> Path:
    return Path(mountpoint) / "blobs" / blob


def wait_until(cond: Any, timeout: float, what: str, alive: Any = None) -> None:
    end = time.monotonic() + timeout
    while True:
        if cond():
            return
        if alive is not None:
            alive()
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _answers(cache_dir: Path) -> bool:
    try:
        request_json(cache_dir, "GET", "/stats", timeout=5)
        return True
    except (DaemonNotRunning, OSError):
        return False


# -- the daemon as a subprocess (end to end) -----------------------------------------------------------
class DaemonProcess:
    def __init__(self, store_url: str, cache_dir: Path, mountpoint: Path, *extra: str,
                 env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.store_url = store_url
        self.cache_dir = Path(cache_dir)
        self.mountpoint = Path(mountpoint)
        self.extra = extra
        self.env = env
        self.log = log or self.cache_dir.parent / f"daemon-{os.getpid()}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.pop("LAYERSTORE_STORE", None)
        env.update(self.env or {})
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [LAYERCTL, "daemon", "--store", self.store_url, "--cache", str(self.cache_dir),
                 "--mountpoint", str(self.mountpoint), *self.extra],
                stdout=logf, stderr=subprocess.STDOUT, env=env)
        wait_until(lambda: linux.is_mount(self.mountpoint) and _answers(self.cache_dir), READY_TIMEOUT,
                   "the daemon to mount", alive=self._check_alive)
        return self

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def blob(self, digest: str) -> Path:
        return blob_path(self.mountpoint, digest)

    def stats(self) -> dict[str, Any]:
        return request_json(self.cache_dir, "GET", "/stats")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        force_unmount(self.mountpoint)

    def __enter__(self) -> DaemonProcess:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
        finally:
            self.cleanup()


# -- the daemon in-process (any store object; handlers reachable) -------------------------------------
class DaemonThread:
    """`Daemon.serve` in a trio run on a thread of this process (pyfuse3 allows one mount per
    process at a time)."""

    def __init__(self, store: Any, cache_dir: Path, mountpoint: Path, **cfg: Any) -> None:
        Path(mountpoint).mkdir(parents=True, exist_ok=True)
        self.config = DaemonConfig(cache_dir=Path(cache_dir), mountpoint=Path(mountpoint), **cfg)
        self.daemon = Daemon(self.config, store)
        self.mountpoint = Path(mountpoint)
        self.cache_dir = Path(cache_dir)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.daemon.serve)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as e:  # reported to the test thread
            self._error = e
        finally:
            self._started.set()

    def blob(self, digest: str) -> Path:
        return blob_path(self.mountpoint, digest)

    def stats(self) -> dict[str, Any]:
        return request_json(self.cache_dir, "GET", "/stats")

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a sync function on the daemon's trio thread (to inspect its state safely)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.daemon.token())

    def __enter__(self) -> DaemonThread:
        self._thread = threading.Thread(target=self._run, name="fuse-daemon", daemon=True)
        self._thread.start()
        self._started.wait(READY_TIMEOUT)
        if self._error is not None:
            force_unmount(self.mountpoint)
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.daemon.stop_threadsafe()
            if self._thread is not None:
                self._thread.join(60)
        finally:
            force_unmount(self.mountpoint)
        if self._error is not None and exc[0] is None:
            raise self._error


def read_file(path: Path, chunk: int = 1 << 20) -> bytes:
    with open(path, "rb") as f:
        parts = []
        while b := f.read(chunk):
            parts.append(b)
        return b"".join(parts)


def read_errno(path: Path, offset: int = 0, size: int = 4096) -> int | None:
    """The errno of reading `path` at `offset` (None if the read succeeded)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return e.errno
    try:
        os.pread(fd, size, offset)
        return None
    except OSError as e:
        return e.errno
    finally:
        os.close(fd)

