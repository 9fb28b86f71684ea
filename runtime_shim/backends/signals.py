"""Stop signals (SIGTERM, SIGINT, SIGHUP) during a shim call as an orderly stop: the first one
raises `Stopped` in the main thread where it arrives (a KeyboardInterrupt: every clean-up that a
Ctrl-C runs, a SIGTERM or SIGHUP now runs too, instead of the process dying with its sandbox
mounted and its container running); later ones are counted, never raised, so that the clean-up
they interrupt is not cut short (`received`: a second signal asks it to hurry).

A backend told to stop a started workload passes the signal on to it, then gives it
`stop_grace()` seconds to end (`await_end`) before it kills it: the same on every backend.

Only the main thread can take signals: off it, `stopping` changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from layerstore.errors import ConfigError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_CODE = 130


POLL = 0.05  # seconds between looks at a workload told to stop


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name` (`ConfigError` if bad)."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: want a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: want a positive number of seconds")
    return value


def stop_grace() -> float:
    """Seconds a workload told to stop has before it is killed (LAYERSTORE_STOP_GRACE)."""
    return env_seconds("LAYERSTORE_STOP_GRACE", 5.0)


def await_end(ended: Callable[[], bool], grace: float) -> bool:
    """Until `ended()`, `grace` seconds have passed, or a second stop signal asks to hurry;
    `ended()` at the end."""
    end = time.monotonic() + grace
    while not ended() and time.monotonic() < end and received() < 2:
        time.sleep(POLL)
    return ended()


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
