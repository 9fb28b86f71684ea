"""Peak memory of a contender: its node side in one memory cgroup, its sandboxes in runc's.

The contender's runner moves itself into its cgroup before it starts anything, so its children (the
downloader and tar, the node daemon, the shim) are charged there. runc puts each sandbox in a cgroup of
its own at an absolute path (the layerstore shim: /layerstore/<id>; the conventional runner the same way,
/lsburst-sandboxes/<id>), so the sampler adds the live sandboxes' cgroups to the contender's. Reported: the
sampled peak of that sum (page cache included: what the node holds for the contender at its busiest),
the sampled peak of anonymous memory (processes without page cache), and the kernel's high-water mark of
the node-side cgroup alone. Works with the v1 memory controller (this machine's hybrid layout) and v2.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup/unified")


def memory_root() -> tuple[Path, int]:
    if (V1_ROOT / "memory.usage_in_bytes").exists():
        return V1_ROOT, 1
    if (V2_ROOT / "cgroup.controllers").exists() and "memory" in (V2_ROOT / "cgroup.controllers").read_text():
        return V2_ROOT, 2
    root = Path("/sys/fs/cgroup")
    return root, 2


def parse_memory_stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out


class MemoryCgroup:
    """The contender's cgroup, plus (for sampling) the cgroups runc makes for its sandboxes, which sit
    elsewhere in the hierarchy (`sandbox_glob`, relative to the memory root)."""

    def __init__(self, relpath: str, sandbox_glob: str = "") -> None:
        self.root, self.version = memory_root()
        self.path = self.root / relpath.strip("/")
        self.sandbox_glob = sandbox_glob
        self.peak_anon = 0
        self.peak_usage_sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def kernel_peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def anon(self, path: Path | None = None) -> int:
        st = parse_memory_stat(((path or self.path) / "memory.stat").read_text())
        if self.version == 1:
            return st.get("total_rss", 0) + st.get("total_shmem", 0)
        return st.get("anon", 0) + st.get("shmem", 0)

    def sample(self) -> tuple[int, int]:
        """(usage, anon) of the contender's cgroup plus its live sandboxes' cgroups."""
        usage, anon = self.usage(), self.anon()
        if self.sandbox_glob:
            name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
            for d in self.root.glob(self.sandbox_glob):
                with contextlib.suppress(OSError, ValueError):
                    usage += int((d / name).read_text())
                    anon += self.anon(d)
        return usage, anon

    def start_sampling(self, interval: float = 0.1) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                with contextlib.suppress(OSError, ValueError):
                    usage, anon = self.sample()
                    self.peak_anon = max(self.peak_anon, anon)
                    self.peak_usage_sampled = max(self.peak_usage_sampled, usage)

        self._thread = threading.Thread(target=loop, daemon=True, name="memsample")
        self._thread.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def remove(self) -> None:
        """Remove the cgroup and any empty children (runc removes its own; a crash may not)."""
        if not self.path.exists():
            return
        for d in sorted((p for p in self.path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def remove_everywhere(name: str) -> None:
    """rmdir the cgroup `name` (a top-level directory) and its children in every hierarchy, deepest
    first; a cgroup that still has processes refuses and stays."""
    for top in Path("/sys/fs/cgroup").glob(f"*/{name}"):
        dirs = [p for p in top.rglob("*") if p.is_dir()] + [top]
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()


def remove_stale(prefix: str = "lsburst-") -> None:
    """Top-level cgroups `<prefix><pid>` of runs whose process is gone, and the shared sandbox parent."""
    names = {p.name for p in Path("/sys/fs/cgroup").glob(f"*/{prefix}*")}
    for name in names:
        pid = name[len(prefix):]
        if pid.isdigit() and (int(pid) == os.getpid() or Path(f"/proc/{pid}").exists()):
            continue
        remove_everywhere(name)


def join(relpath: str) -> None:
    """Move the calling process into the memory cgroup `relpath` (run by the contender's runner)."""
    root, _ = memory_root()
    (root / relpath.strip("/") / "cgroup.procs").write_text(str(os.getpid()))
