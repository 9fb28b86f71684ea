"""Calls that must not hang: run one in a thread with a deadline, so a test that catches a hang
fails instead of hanging the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest


def bounded(fn: Callable[[], object], unblock: Callable[[], None], deadline: float, what: str) -> object:
    """`fn()` in a thread. Past `deadline` seconds call `unblock` (so that the thread ends and the
    test leaves nothing behind) and fail: `what` hung. An exception of `fn` is raised here."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(deadline)
    if t.is_alive():
        unblock()
        t.join(deadline)
        pytest.fail(f"{what} hung for {deadline} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")
