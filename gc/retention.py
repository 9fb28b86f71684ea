"""Which tags a retention policy removes (pure: no store, no clock of its own).

Per environment name, a tag is kept if any rule keeps it: it is among the `keep_last` most
recently written tags of its name (not counting those kept forever), it was written less than
`keep_newer_than` seconds ago, or `name:tag` matches one of `keep_patterns` (shell-style, kept
forever). A policy with neither `keep_last` nor `keep_newer_than` removes nothing: patterns only
protect. Signature tags (`sig/...`) are never removed by a policy; they go with the manifests
they sign.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from layerstore.errors import ConfigError

SIG_PREFIX = "sig/"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '2h', '7d', '1w', or a sum of them ('1h30m') -> seconds."""
    text = text.strip().lower()
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if not m or m.end() == pos:
            raise ConfigError(f"not a duration (want e.g. 90s, 15m, 2h, 7d): {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text:
        raise ConfigError("empty duration")
    return total


@dataclass(frozen=True)
class TagInfo:
    ref: str  # name:tag
    manifest: str
    mtime: float  # when the tag was last written (store clock)

    @property
    def name(self) -> str:
        return self.ref.rpartition(":")[0]


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_newer_than: float | None = None
    keep_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 0:
            raise ConfigError("--keep-last must be 0 or more")
        if self.keep_newer_than is not None and self.keep_newer_than < 0:
            raise ConfigError("--keep-newer-than must not be negative")

    @property
    def removes_anything(self) -> bool:
        return self.keep_last is not None or self.keep_newer_than is not None

    def to_json(self) -> dict[str, object]:
        return {"keep_last": self.keep_last, "keep_newer_than": self.keep_newer_than,
                "keep_patterns": list(self.keep_patterns)}

    def kept_forever(self, ref: str) -> bool:
        return any(fnmatch.fnmatchcase(ref, p) for p in self.keep_patterns)

    def to_remove(self, tags: Iterable[TagInfo], now: float) -> list[TagInfo]:
        """The tags this policy removes, given every tag and the time now (same clock)."""
        if not self.removes_anything:
            return []
        by_name: dict[str, list[TagInfo]] = {}
        for t in tags:
            if not t.ref.startswith(SIG_PREFIX):
                by_name.setdefault(t.name, []).append(t)
        out = []
        for group in by_name.values():
            ranked = sorted((t for t in group if not self.kept_forever(t.ref)), key=lambda t: (t.mtime, t.ref),
                            reverse=True)
            for rank, t in enumerate(ranked):
                if self.keep_last is not None and rank < self.keep_last:
                    continue
                if self.keep_newer_than is not None and now - t.mtime < self.keep_newer_than:
                    continue
                out.append(t)
        return sorted(out, key=lambda t: t.ref)
