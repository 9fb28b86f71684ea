"""What one sandbox of the burst reports, and how its output is read. Pure logic, no I/O."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field

from . import spec


@dataclass
class SandboxResult:
    index: int
    env: str
    launched: float  # wall clock when the runner asked for it
    started: float | None = None  # the sandbox's own start mark (its first command)
    finished: float | None = None  # wall clock when the runner saw it exit
    rc: int | None = None
    task: dict[str, object] = field(default_factory=dict)  # what the task printed about itself
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # runner-side seconds per step, per contender

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.started is not None and not self.error


def parse_output(text: str, result: SandboxResult) -> None:
    """Fill `started` and `task` from the marks the sandbox printed."""
    for line in text.splitlines():
        if line.startswith(spec.START_MARK + " ") and result.started is None:
            with contextlib.suppress(IndexError, ValueError):
                result.started = float(line.split()[1])
        elif line.startswith(spec.RESULT_MARK + " "):
            with contextlib.suppress(ValueError):
                result.task = dict(json.loads(line[len(spec.RESULT_MARK) + 1:]))


def tail(text: str, n: int = 1500) -> str:
    return text if len(text) <= n else "..." + text[-n:]
