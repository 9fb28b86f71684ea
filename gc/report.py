"""What a collection run did, and where the last one is kept (`gc/last-report`)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

from layerstore.backends import ObjectInfo
from layerstore.errors import CorruptObject, NotFound
from layerstore.store import Store

LAST_REPORT = "gc/last-report"
MAX_REPORT = 1 << 20


@dataclass
class Count:
    objects: int = 0
    bytes: int = 0

    @classmethod
    def of(cls, infos: Iterable[ObjectInfo]) -> Count:
        c = cls()
        for i in infos:
            c.add(i)
        return c

    def add(self, info: ObjectInfo) -> None:
        self.objects += 1
        self.bytes += info.size


@dataclass
class Report:
    run: str
    dry_run: bool
    grace: float
    started: float
    finished: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds each phase took
    tags_removed: list[str] = field(default_factory=list)
    listed: Count = field(default_factory=Count)
    marked: Count = field(default_factory=Count)
    kept_grace: Count = field(default_factory=Count)
    kept_lease: Count = field(default_factory=Count)  # reachable only through a lease
    rescued: Count = field(default_factory=Count)  # candidates a writer held or tagged meanwhile
    deleted: Count = field(default_factory=Count)  # would be deleted, in a dry run
    missing_count: int = 0  # references to objects that are not there (damage, not ours)
    missing: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    housekeeping: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.monotonic() - t0, 6)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def write_report(store: Store, report: Report) -> None:
    store.backend.replace(LAST_REPORT, json.dumps(report.to_json(), sort_keys=True).encode())


def last_report(store: Store) -> dict[str, object] | None:
    """The last finished (not dry) run's report, or None if no run finished yet. Keys of note:
    started, finished (epoch seconds), dry_run, deleted/marked ({objects, bytes}), plus the
    flat deleted_objects, deleted_bytes, marked_objects for convenience."""
    try:
        raw = store.backend.load(LAST_REPORT, max_size=MAX_REPORT)
    except NotFound:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        raise CorruptObject(f"{LAST_REPORT}: not JSON") from None
    if not isinstance(obj, dict):
        raise CorruptObject(f"{LAST_REPORT}: not an object")
    for name in ("deleted", "marked"):
        part = obj.get(name) if isinstance(obj.get(name), dict) else {}
        obj[f"{name}_objects"] = part.get("objects", 0)
        if name == "deleted":
            obj["deleted_bytes"] = part.get("bytes", 0)
    return obj
