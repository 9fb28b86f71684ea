"""The one retry policy: when to try again and when to give up, decided here for every caller
(the S3 backend's requests, the node daemon's chunk and chunk-map fetches). What counts as a
temporary failure is not decided here: the backend says (`Backend.is_temp_failure`) for its own
exceptions, and a project error says with its class (`LayerstoreError.temporary`).

Delays grow exponentially from `first` to `cap`, with full jitter (a uniform draw below the
exponential value, as botocore's standard mode does), until `attempts` tries were made or the
next delay would end past `deadline` seconds after the first try. Pure: a `Schedule` is asked for
the next delay with the current time; the caller sleeps (time.sleep, trio.sleep) itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import LayerstoreError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    first: float = 0.05
    cap: float = 1.0
    attempts: int | None = None  # total tries; None: as many as the deadline allows
    deadline: float | None = None  # seconds from the first try; None: only `attempts` limits
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline is None:
            raise ValueError("a retry policy needs attempts or a deadline")
        if (self.attempts is not None and self.attempts < 1) or self.first < 0 or self.cap < self.first:
            raise ValueError(f"bad retry policy {self}")

    def schedule(self, start: float, rng: Callable[[float, float], float] = random.uniform) -> Schedule:
        return Schedule(self, start, rng)

    def call(self, fn: Callable[[], T], is_temp_failure: Callable[[BaseException], bool], *,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
        """Run `fn` until it returns, a failure is not temporary, or the policy gives up (the last
        failure is raised)."""
        sched = self.schedule(clock())
        while True:
            try:
                return fn()
            except Exception as e:
                if not is_temp_failure(e):
                    raise
                delay = sched.next_delay(clock())
                if delay is None:
                    raise
            sleep(delay)


class Schedule:
    """The delays of one operation's retries."""

    __slots__ = ("policy", "start", "tries", "rng")

    def __init__(self, policy: RetryPolicy, start: float, rng: Callable[[float, float], float]) -> None:
        self.policy = policy
        self.start = start
        self.tries = 1  # the first try is under way
        self.rng = rng

    def next_delay(self, now: float) -> float | None:
        """How long to wait before the next try, or None to give up."""
        p = self.policy
        if p.attempts is not None and self.tries >= p.attempts:
            return None
        ceiling = min(p.cap, p.first * (2 ** (self.tries - 1)))
        delay = self.rng(0.0, ceiling) if p.jitter else ceiling
        if p.deadline is not None and now + delay >= self.start + p.deadline:
            return None
        self.tries += 1
        return delay


def is_temporary(e: BaseException) -> bool:
    """A project error that may pass on its own (`StoreUnavailable` and its kin)."""
    return isinstance(e, LayerstoreError) and e.temporary
