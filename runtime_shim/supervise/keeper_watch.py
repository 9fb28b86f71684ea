"""The watch's care of the fanotify keeper (docs/fanotify.md, "A keeper without systemd"): where the
operator opted in (`LAYERSTORE_FANOTIFY_KEEPER=1`), a keeper that died alone while a daemon on the
fanotify data path runs is started again by the watch (`keeper.ensure`), not only at the next
daemon start; the running daemon hands the new one a copy of the group within a second
(`group.keep_copy`, on its holder check).

Each of the watch's ticks costs one read of the keeper's identity file and one of /proc/PID/stat
(`keeper.running`); the start runs in a thread of its own, so the watch's loop never waits for it.
Starts are rate-limited (`restart_after`, pure): a keeper that dies soon after its start (it
cannot bind, it crashes at import) is started again after 2, 4, 8 ... s, at most every
`BACKOFF_MAX` s, each start logged; one that lived `STABLE` s is started again at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fuse_client.fanotify import keeper

log = logging.getLogger("layerstore.shim.watch")

BACKOFF = 2.0  # seconds before the first start again of a keeper that died soon after its start
BACKOFF_MAX = 300.0
STABLE = 60.0  # a keeper seen alive this long after its start died of something else: no back-off


@dataclass(frozen=True)
class KeeperStarts:
    """What the watch remembers of the keepers it started."""

    started: float | None = None  # when it last started one (monotonic seconds)
    quick: int = 0  # how many of its starts in a row were not seen alive STABLE s after


def backoff(quick: int) -> float:
    """The wait after the last start before the next, after `quick` quick deaths in a row (pure)."""
    return 0.0 if quick <= 0 else min(BACKOFF * 2 ** (quick - 1), BACKOFF_MAX)


def restart_after(prev: KeeperStarts, now: float, seen: float | None) -> KeeperStarts | None:
    """The keeper is missing: start one now? The memory after that start, or None (too soon after
    the last one). `seen`: when the watch last saw a live keeper (pure)."""
    if prev.started is None:
        return KeeperStarts(now, 0)
    lived = seen is not None and seen - prev.started >= STABLE
    quick = 0 if lived else prev.quick + 1
    if now - prev.started < backoff(quick):
        return None
    return KeeperStarts(now, quick)


class KeeperWatch:
    """One per watch process; `tick` on every turn of its loop while a fanotify daemon runs."""

    def __init__(self, cache: Path, env: Mapping[str, str]) -> None:
        self.cache, self.env = cache, env
        self.wanted = keeper.wanted(env)
        self.starts = KeeperStarts()
        self.seen: float | None = None  # the last tick that found a live keeper
        self.seen_pid: int | None = None
        self.waiting: KeeperStarts | None = None  # the memory a back-off was logged for
        self.thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def tick(self, now: float) -> None:
        if not self.wanted or self.busy():
            return
        pid = keeper.running(self.cache)
        if pid is not None:
            self.seen, self.seen_pid = now, pid
            return
        if self.seen_pid is not None:  # (the watch's own child if it started it: reaped)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.seen_pid, os.WNOHANG)
            self.seen_pid = None
        nxt = restart_after(self.starts, now, self.seen)
        if nxt is None:
            if self.waiting != self.starts:
                self.waiting = self.starts
                log.warning("the fanotify keeper died %d time(s) in a row soon after its start: the next start "
                            "in %.0f s (see %s)", self.starts.quick + 1, backoff(self.starts.quick + 1),
                            self.cache / keeper.LOG_NAME)
            return
        if not self.cache.is_dir():
            return  # (the node is being removed: the watch ends; no keeper for a cache that is gone)
        self.starts = nxt
        self.thread = threading.Thread(target=self._start, name="keeper-start", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        pid = keeper.ensure(self.cache, self.env)  # (logs why when it cannot)
        if pid is not None:
            log.warning("the fanotify keeper was gone (the daemon and the holder keep the group): started keeper %d; "
                        "the daemon hands it the group", pid)
