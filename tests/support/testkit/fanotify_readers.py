"""Reads of a fanotify-backed EROFS mount in a child process with a deadline, for the tests that
kill or upgrade the daemon under readers: a read that never returns (a permission event nobody
answers leaves an EROFS folio locked, and every later reader of it waits in D state) fails the test
with a one-line diagnosis instead of hanging the suite. On expiry: the child's stuck stacks
(/proc/<pid>/task/<tid>/stack) are summed up, the child is killed, the mount is lazily detached
(the child may stay in D state until the group's last holder goes: the daemon fixture's teardown),
and the test fails; the run goes on.

The child is this file run as a script (stdlib only). It writes one line per event on stdout:
`R <reads>` (right reads so far), `E <message>` (a failed or wrong read), `D` (done); it stops
when its stdin closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

READERS_DEADLINE = 120.0  # s for a wait on the readers (their next reads, or their stop)
VERIFY_DEADLINE = 120.0  # s for one pass over every file


class StuckReads(AssertionError):
    """Reads did not return in time (the one-line diagnosis is the message)."""


def stuck_stacks(pid: int, frames: int = 4) -> str:
    """The threads of `pid` in D state, grouped by the top `frames` functions of their kernel
    stacks: `12x folio_wait_bit_common<-filemap_get_pages<-...; 1x fanotify_handle_event<-...`."""
    groups: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state != "D":
                    continue
                with open(f"/proc/{pid}/task/{tid}/stack") as f:
                    names = [line.split()[1].split("+")[0] for line in f if len(line.split()) > 1]
            except (OSError, IndexError):
                continue
            groups["<-".join(names[:frames]) or "?"] += 1
    if not groups:
        return "no thread in D state"
    return "; ".join(f"{n}x {stack}" for stack, n in groups.most_common())


def _give_up(proc: subprocess.Popen[str], mount: Path, what: str, deadline: float) -> StuckReads:
    """Diagnose, kill the child, detach `mount` lazily; the error to raise."""
    diagnosis = stuck_stacks(proc.pid)
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)  # (a child in an unkillable wait is left behind: the run goes on)
    from layerstore.linux import MountError, umount

    with contextlib.suppress(MountError):  # (not mounted any more)
        umount(mount, lazy=True)
    return StuckReads(f"{what} stuck after {deadline:.0f} s (mount {mount} detached): {diagnosis}")


class ChildReaders:
    """`n` reader threads in a child process reading random files of `mnt` and comparing them
    with `src` (see `reading_in_child`)."""

    def __init__(self, mnt: Path, src: Path, files: list[Path], n: int, deadline: float) -> None:
        self.mnt, self.deadline = mnt, deadline
        self.reads = 0
        self.errors: list[str] = []
        self.done = threading.Event()
        spec = {"mode": "readers", "mnt": str(mnt), "src": str(src), "files": [str(f) for f in files], "n": n}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._pump = threading.Thread(target=self._read_output, daemon=True)
        self._pump.start()

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "R":
                self.reads = int(rest)
            elif kind == "E":
                self.errors.append(rest)
        self.done.set()

    def wait_reads(self, n: int) -> None:
        """Until `n` more right reads (or an error); `StuckReads` past the deadline."""
        want, end = self.reads + n, time.monotonic() + self.deadline
        while self.reads < want and not self.errors:
            if time.monotonic() > end or self.done.is_set():
                err = _give_up(self.proc, self.mnt, f"readers (waiting for {n} reads)", self.deadline)
                self.close()
                raise err
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the readers; `StuckReads` if they do not all return by the deadline."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(self.deadline)
        except subprocess.TimeoutExpired:
            err = _give_up(self.proc, self.mnt, "readers (stopping)", self.deadline)
            self.close()
            raise err from None
        self.close()

    def close(self) -> None:
        """The pipes to the child closed (its output once it ended: the child exited or was killed)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self._pump.join(5)
        if not self._pump.is_alive():
            assert self.proc.stdout is not None
            self.proc.stdout.close()


@contextlib.contextmanager
def reading_in_child(mnt: Path, src: Path, files: list[Path], n: int = 16,
                     deadline: float = READERS_DEADLINE) -> Iterator[ChildReaders]:
    """`n` readers in a child while the block runs; stopped (with the deadline) at its end. The
    caller checks `.errors` after the block."""
    readers = ChildReaders(mnt, src, files, n, deadline)
    try:
        yield readers
    except BaseException:
        readers.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            readers.proc.wait(5)
        readers.close()
        raise
    readers.stop()


def verify_in_child(mnt: Path, src: Path, files: list[Path], deadline: float = VERIFY_DEADLINE) -> None:
    """Every file of `files` read whole (page cache dropped first) from `mnt` in a child and
    compared with `src`: AssertionError naming the first wrong one, `StuckReads` past the deadline."""
    spec = {"mode": "verify", "mnt": str(mnt), "src": str(src), "files": [str(f) for f in files], "n": 1}
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        err = _give_up(proc, mnt, "verification reads", deadline)
        with contextlib.suppress(OSError):
            proc.stdout.close()  # type: ignore[union-attr]
        raise err from None
    errors = [line[2:] for line in out.splitlines() if line.startswith("E ")]
    assert not errors and proc.returncode == 0, errors[:3] or f"verifier exited {proc.returncode}"


# -- the child ---------------------------------------------------------------------------------

def _read_uncached(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = []
        while b := os.read(fd, 1 << 20):
            parts.append(b)
        return b"".join(parts)
    finally:
        os.close(fd)


def _child(spec: dict[str, object]) -> int:
    mnt, src = Path(str(spec["mnt"])), Path(str(spec["src"]))
    files = [str(f) for f in spec["files"]]  # type: ignore[attr-defined]
    want = {rel: (src / rel).read_bytes() for rel in files}
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    if spec["mode"] == "verify":
        for rel in files:
            if _read_uncached(str(mnt / rel)) != want[rel]:
                say(f"E wrong bytes in {rel}")
                return 1
        say("D")
        return 0
    stop = threading.Event()
    count = [0]

    def reader(k: int) -> None:
        rng = random.Random(k)
        try:
            while not stop.is_set():
                rel = rng.choice(files)
                got = _read_uncached(str(mnt / rel))
                if got != want[rel]:
                    raise AssertionError(f"wrong bytes in {rel} ({len(got)} vs {len(want[rel])})")
                with out_lock:
                    count[0] += 1
                    sys.stdout.write(f"R {count[0]}\n")
                    sys.stdout.flush()
        except BaseException as e:  # (reported, then this reader stops)
            say(f"E {type(e).__name__}: {e}")

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(int(str(spec["n"])))]
    for t in threads:
        t.start()
    sys.stdin.read()  # until the parent closes it
    stop.set()
    for t in threads:
        t.join()
    say("D")
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
