"""Sequential readahead that interleaved readers cannot fool (pure; no I/O, no trio).

Every sandbox on a node reads its layers through the same blob file, so the requests the daemon
sees for one blob interleave reads of different files by different readers. One stream position
per blob mistook that for sequential reading whenever two requests happened to be near each
other, and opened full windows (a burst of sandboxes fetched twice the chunk data it read).

So, as the kernel's on-demand readahead does for a file:

- a blob has several *streams*, each keyed by the byte offset where its last request ended; a
  request continues a stream only if it starts exactly there (strict contiguity), otherwise it
  starts a new stream (the least recently continued one is dropped beyond `MAX_STREAMS`, and a
  stream idle for `STALE` seconds is forgotten);
- a stream's first continuation opens a window after the request of four times the request's
  size (at least `INIT_WINDOW` chunk); when the stream reaches the first chunk of its newest
  window (the "mark"), the next window, twice as large (up to the configured maximum), is opened
  where the previous one ended;
- so a reader that is not sequential never opens a window, and what a stream has been given
  ahead of its reads is at most its last two windows, each a small multiple of what it has read.

Each call is a dict pop and a dict insert, cheap enough for the cache-hit path.
"""

from __future__ import annotations

INIT_WINDOW = 1  # chunks: the first window of a stream
MAX_STREAMS = 8  # per blob: concurrent sequential readers tracked
STALE = 10.0  # seconds without a continuation after which a stream is forgotten


class Stream:
    __slots__ = ("size", "ra_end", "mark", "seen", "run")

    def __init__(self, now: float, run: int) -> None:
        self.size = 0  # chunks in the newest window (0: none yet)
        self.ra_end = 0  # chunk index where the newest window ends
        self.mark = 0  # a read reaching this chunk opens the next window
        self.seen = now
        self.run = run  # bytes read contiguously by this stream so far


class Streams:
    """The sequential streams of one blob. Mutated on the trio thread only."""

    __slots__ = ("by_end",)

    def __init__(self) -> None:
        self.by_end: dict[int, Stream] = {}

    def on_read(self, off: int, end: int, last: int, nchunks: int, max_window: int, now: float,
                chunk_len: int) -> tuple[int, int] | None:
        """A data read of bytes [off, end) whose chunks end at index `last` (exclusive), in a
        blob of `nchunks` chunks of about `chunk_len` bytes. Returns the chunk range
        [start, stop) to read ahead now, or None."""
        by_end = self.by_end
        s = by_end.pop(off, None)
        if s is None or now - s.seen > STALE:
            by_end[end] = Stream(now, end - off)
            if len(by_end) > MAX_STREAMS:
                del by_end[next(iter(by_end))]  # insertion order: the least recently continued
            return None
        s.seen = now
        s.run += end - off
        by_end[end] = s  # re-inserted: now the most recently continued
        if last <= s.mark or max_window <= 0:
            return None
        # The first window: four times the request (as the kernel sizes its first readahead),
        # at least one chunk. A reader of 128 KiB requests gets 1 chunk; 1 MiB requests, which
        # the kernel only sends when its own readahead found the reader sequential, get 4.
        size = min(s.size * 2 or max(INIT_WINDOW, 4 * (end - off) // chunk_len), max_window)
        start = max(s.ra_end, last)
        stop = min(start + size, nchunks)
        s.size, s.mark, s.ra_end = size, start, max(stop, start)
        return (start, stop) if stop > start else None

    def run_to(self, off: int) -> int:
        """How many bytes the stream whose last request ended at `off` has read (0: none
        did); call before `on_read` of a request starting at `off`."""
        s = self.by_end.get(off)
        return 0 if s is None else s.run

    def __len__(self) -> int:
        return len(self.by_end)
