"""Access traces: the first-access order of chunks per blob, recorded by `--record-trace`.

File format (consumed by `layerctl env create --prefetch-trace FILE`):

    {"version": 1, "blobs": {"b3:...": [chunk indexes in first-access order], ...}}

Only demand reads are recorded (prefetch and the metadata fetched at open are not accesses).
"""

from __future__ import annotations

import json
from pathlib import Path

from layerstore import digest as digestmod
from layerstore.errors import BadInput
from layerstore.fileio import write_atomic

TRACE_VERSION = 1


class TraceRecorder:
    def __init__(self) -> None:
        self.order: dict[str, list[int]] = {}
        self._seen: dict[str, bytearray] = {}
        self.dirty = False

    def record(self, blob: str, nchunks: int, start: int, stop: int) -> None:
        seen = self._seen.get(blob)
        if seen is None:
            seen = self._seen[blob] = bytearray(nchunks)
            self.order[blob] = []
        for i in range(start, stop):
            if not seen[i]:
                seen[i] = 1
                self.order[blob].append(i)
                self.dirty = True

    def to_json(self) -> dict[str, object]:
        return {"version": TRACE_VERSION, "blobs": {b: list(o) for b, o in self.order.items()}}


def write_trace(path: Path, data: dict[str, object]) -> None:
    """Replace the file atomically (a reader sees the previous or the new trace)."""
    write_atomic(path, (json.dumps(data, sort_keys=True) + "\n").encode(), mode=0o644)


def parse_trace(data: object) -> dict[str, list[int]]:
    """Validate a trace document; returns blob -> chunk indexes."""
    if not isinstance(data, dict) or data.get("version") != TRACE_VERSION or not isinstance(data.get("blobs"), dict):
        raise BadInput(f"not a version {TRACE_VERSION} access trace")
    out = {}
    for blob, idxs in data["blobs"].items():
        digestmod.parse(blob)
        if not isinstance(idxs, list) or not all(isinstance(i, int) and i >= 0 for i in idxs):
            raise BadInput(f"trace entry for {blob} is not a list of chunk indexes")
        out[blob] = idxs
    return out
