"""Eviction policy (pure): the disk budget's watermarks and which chunks to drop.

Usage is the sum of the lengths of committed chunks (what the budget counts; the index, maps and
partial filesystem blocks are not counted). When usage passes the high watermark, the least
recently used chunks are dropped until usage is at or below the low watermark. A chunk being read
is never a candidate (the caller leaves pinned and busy chunks out); the metadata chunks of blobs
that are open go last, because every EROFS mount on the node needs them on its next lookup.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from layerstore.errors import ConfigError

DEFAULT_HIGH = 0.90
DEFAULT_LOW = 0.75
# Without --cache-size the budget is this fraction of the cache filesystem's size: the rest is
# left to what shares the disk (sandbox uppers, logs, the index), so a burst of sandboxes reading
# cold layers cannot fill the node's disk through the cache.
DEFAULT_FS_FRACTION = 0.5


@dataclass(frozen=True)
class Budget:
    size: int
    high_fraction: float = DEFAULT_HIGH
    low_fraction: float = DEFAULT_LOW
    source: str = "configured"  # or how a default was computed (shown by `cache ls`)

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ConfigError(f"cache size must be positive, got {self.size}")
        if not 0 < self.low_fraction < self.high_fraction <= 1:
            raise ConfigError(f"watermarks must satisfy 0 < low < high <= 1, got "
                              f"{self.low_fraction} and {self.high_fraction}")

    @property
    def high(self) -> int:
        return int(self.size * self.high_fraction)

    @property
    def low(self) -> int:
        return int(self.size * self.low_fraction)

    @classmethod
    def default_for(cls, fs_bytes: int, high_fraction: float = DEFAULT_HIGH,
                    low_fraction: float = DEFAULT_LOW) -> Budget:
        """The budget when none is configured: `DEFAULT_FS_FRACTION` of the cache filesystem."""
        return cls(max(1, int(fs_bytes * DEFAULT_FS_FRACTION)), high_fraction, low_fraction,
                   f"default: {DEFAULT_FS_FRACTION:.0%} of the cache filesystem ({fs_bytes} bytes)")

    def to_json(self) -> dict[str, int | str]:
        return {"size": self.size, "high": self.high, "low": self.low, "source": self.source}


@dataclass(frozen=True, slots=True)
class Candidate:
    blob: str
    index: int
    length: int
    last_use: float
    protected: bool = False  # a metadata chunk of an open blob


def choose_victims(candidates: Iterable[Candidate], usage: int, target: int) -> list[Candidate]:
    """The chunks to drop, in order, so that usage falls to `target` or as close as the
    candidates allow."""
    if usage <= target:
        return []
    out = []
    for c in sorted(candidates, key=lambda c: (c.protected, c.last_use)):
        out.append(c)
        usage -= c.length
        if usage <= target:
            break
    return out
