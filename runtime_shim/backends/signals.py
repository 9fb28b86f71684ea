"""Stop signals (SIGTERM, SIGINT, SIGHUP) during a shim call as an orderly stop: the first one
raises `Stopped` in the main thread where it arrives (a KeyboardInterrupt: every clean-up that a
Ctrl-C runs, a SIGTERM or SIGHUP now runs too, instead of the process dying with its sandbox
mounted and its container running); later ones are counted, never raised, so that the clean-up
they interrupt is not cut short (`received`: a second signal asks it to hurry).

Only the main thread can take signals: off it, `stopping` changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_CODE = 130


class Stopped(KeyboardInterrupt):
    """A stop signal arrived during a shim call. `signum`: which one."""

    def __init__(self, signum: int, what: str = "") -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (f": {what}" if what else ""))

    def __str__(self) -> str:
        return str(self.args[0])


class _State:
    depth = 0
    count = 0  # stop signals received in the outermost `stopping` block
    shield = 0  # > 0: inside a clean-up (`shielded`), count only


_state = _State()


def received() -> int:
    """How many stop signals arrived since the outermost `stopping` block began."""
    return _state.count


def _handler(signum: int, _frame: FrameType | None) -> None:
    _state.count += 1
    if _state.count == 1 and not _state.shield:
        raise Stopped(signum)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """Within: the first stop signal raises `Stopped`, later ones are counted. Nests (the inner
    block shares the outer's count). Off the main thread: no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    if _state.depth == 0:
        _state.count = 0
        old = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Within: stop signals are counted but never raised (a clean-up in progress)."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
