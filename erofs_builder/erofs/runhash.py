"""A data run's identity (pure): how the writer recognises a run it, or a parent image,
already holds. Shared by the data area (which hashes runs as it writes them) and the parent
reader (which hashes the parent's runs to find them by content).
"""

from __future__ import annotations

import blake3

from ..chunking import SLICE


class RunHasher:
    """A run's identity, hashed as it is written: the blake3 of each `SLICE` piece from the
    run's start, and the blake3 of those. The chunker cuts big runs at the same offsets, so
    their chunks' digests are already known (build.hash_image does not read them again)."""

    __slots__ = ("_done", "_cur", "_n")

    def __init__(self) -> None:
        self._done: list[bytes] = []
        self._cur = blake3.blake3()
        self._n = 0

    def update(self, buf: bytes | bytearray | memoryview) -> None:
        n = len(buf)
        if self._n + n < SLICE:  # the common case: no slice ends inside `buf`
            self._cur.update(buf)
            self._n += n
            return
        view = memoryview(buf)
        while len(view):
            take = min(len(view), SLICE - self._n)
            self._cur.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == SLICE:
                self._done.append(self._cur.digest())
                self._cur = blake3.blake3()
                self._n = 0

    def slices(self) -> tuple[bytes, ...]:
        return (*self._done, self._cur.digest()) if self._n else tuple(self._done)

    def key(self) -> bytes:
        return run_key(self.slices())


def run_key(slices: tuple[bytes, ...] | list[bytes]) -> bytes:
    return blake3.blake3(b"".join(slices)).digest()
