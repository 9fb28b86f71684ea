"""The nodes on the status page (docs/status-page.md, "Nodes"): which node daemons hold leases,
and the figures each publishes beside its lease (`fuse_client.nodecache.report`), with a plot of
their fetch rate drawn as inline SVG.

Everything under `leases/` is written by whoever holds the lease scope: a record is read with a
size cap, parsed strictly (a field of the wrong type makes the record unreadable, shown as such),
names are cut to `MAX_NAME` characters and escaped by the template, and at most `MAX_LEASES`
leases and `MAX_SAMPLES` samples per node are looked at. `read_nodes` does the I/O; the rest is
pure.
"""

from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field

from layerstore import leases
from layerstore.backends import Backend
from layerstore.errors import LayerstoreError, NotFound

MAX_LEASES = 512  # leases read per refresh (the page says when there are more)
MAX_RECORD = 16 << 10  # bytes of one node record
MAX_SAMPLES = 120
MAX_NAME = 120
RECORD_LEAF = "r"
WINDOW = 600.0  # seconds of fetch rate the plot shows
COLOURS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d")


@dataclass(frozen=True)
class NodeFigures:
    time: float
    cached_bytes: int
    fetched_bytes: int
    hits: int
    misses: int
    blobs: int
    samples: tuple[tuple[float, int], ...]  # (time, fetched bytes so far)


@dataclass
class NodeRow:
    lease: str
    name: str
    holder: str
    expires: float
    held: int  # blobs the lease holds
    live: bool
    figures: NodeFigures | None = None
    error: str = ""
    rates: list[tuple[float, float]] = field(default_factory=list)  # (time, bytes/s)

    @property
    def peak(self) -> float | None:
        return max((r for _, r in self.rates), default=None)


def _count(obj: dict[str, object], name: str) -> int:
    return _whole(obj.get(name), name)


def _whole(v: object, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
        raise ValueError(f"{name} is not a count")
    return v


def _time(v: object, name: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v < 1e11:
        raise ValueError(f"{name} is not a time")
    return float(v)


def parse_record(raw: bytes) -> NodeFigures:
    """A node record, strictly; ValueError saying why it is not one."""
    if len(raw) > MAX_RECORD:
        raise ValueError(f"larger than {MAX_RECORD} bytes")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(obj, dict) or obj.get("format") != 1:
        raise ValueError("not a node record (format 1)")
    samples = obj.get("samples")
    if not isinstance(samples, list):
        raise ValueError("samples is not a list")
    out = []
    for s in samples[-MAX_SAMPLES:]:
        if not isinstance(s, list) or len(s) < 2:
            raise ValueError("a sample is not [time, fetched, ...]")
        out.append((_time(s[0], "a sample's time"), _whole(s[1], "a sample's fetched bytes")))
    return NodeFigures(_time(obj.get("time"), "time"), _count(obj, "cached_bytes"), _count(obj, "fetched_bytes"),
                       _count(obj, "hits"), _count(obj, "misses"), _count(obj, "blobs"), tuple(out))


def rates(samples: tuple[tuple[float, int], ...]) -> list[tuple[float, float]]:
    """Fetch rate (bytes/s) between consecutive samples, at the later one's time; a counter that
    went down (the daemon restarted) or time that did not move starts over."""
    out = []
    for (t0, f0), (t1, f1) in itertools.pairwise(samples):
        if t1 > t0 and f1 >= f0:
            out.append((t1, (f1 - f0) / (t1 - t0)))
    return out


def clip(text: str) -> str:
    return text if len(text) <= MAX_NAME else text[:MAX_NAME - 1] + "…"


def _load_record(backend: Backend, key: str) -> NodeFigures | str:
    """A node's record, or why it cannot be shown."""
    try:
        return parse_record(backend.load(key, max_size=MAX_RECORD))
    except NotFound:
        return "its record changed while read: shown at the next refresh"
    except (LayerstoreError, ValueError) as e:
        return f"record unreadable: {clip(str(e))}"


def read_nodes(backend: Backend, now: float, pool: Executor | None = None) -> tuple[list[NodeRow], int, bool]:
    """(the node leases with their latest records, how many other leases, whether more leases
    than `MAX_LEASES` were left out). `pool`: loads the records concurrently (a store's)."""
    records: dict[str, tuple[int, str]] = {}  # lease id -> (seq, key) of its latest record
    for key in backend.list(leases.LEASES):
        lease_id, _, leaf = key[len(leases.LEASES):].partition("/")
        if leaf.startswith(RECORD_LEAF) and leaf[1:].isdigit() and len(leaf) <= 20:
            seq = int(leaf[1:])
            if seq >= records.get(lease_id, (-1, ""))[0]:
                records[lease_id] = (seq, key)
    rows: list[NodeRow] = []
    others = 0
    found = list(itertools.islice(leases.read_leases(backend), MAX_LEASES + 1))
    for info in found[:MAX_LEASES]:
        if info.kind != "node":
            others += 1
            continue
        held = sum(1 for k in info.keys if k.startswith("blobs/"))
        row = NodeRow(info.id, clip(info.name), clip(info.holder), info.expires, held, info.live(now))
        row.error = "no figures published yet"
        rows.append(row)
    wanted = [(row, records[row.lease][1]) for row in rows if row.lease in records]
    mapper = pool.map if pool is not None else map
    for (row, _), got in zip(wanted, mapper(lambda rk: _load_record(backend, rk[1]), wanted), strict=True):
        if isinstance(got, str):
            row.error = got
        else:
            row.figures, row.rates, row.error = got, rates(got.samples), ""
    rows.sort(key=lambda r: (not r.live, r.name, r.lease))
    return rows, others, len(found) > MAX_LEASES


# -- the plot (pure) --------------------------------------------------------------------------------
W, H, LEFT, BOTTOM, TOP, RIGHT = 720, 220, 70, 28, 12, 12


def nice_ceiling(x: float) -> float:
    """The axis top for a rate `x` in bytes/s: 1, 2 or 5 times a power of ten of a binary unit
    (B, KiB, MiB, ...), so the labels read 50 MiB/s, not 47.7 MiB/s."""
    if x <= 0:
        return 1.0
    unit = 1024.0 ** min(max(math.floor(math.log(x, 1024)), 0), 5)
    scaled = x / unit
    step = 10 ** math.floor(math.log10(scaled))
    return unit * next(m * step for m in (1, 2, 5, 10) if m * step >= scaled)


def plot(rows: list[NodeRow], now: float, human: object) -> dict[str, object]:
    """What the template draws: one polyline per node over the last `WINDOW` seconds, axes
    scaled to the highest rate. `human`: the bytes formatter for the axis labels."""
    series = []
    top = 0.0
    for row in rows:
        pts = [(t, r) for t, r in row.rates if now - WINDOW <= t <= now + 60]
        if pts:
            top = max(top, max(r for _, r in pts))
            series.append((row, pts))
    ymax = nice_ceiling(top)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def xy(t: float, r: float) -> str:
        x = LEFT + pw * (1 - min(max(now - t, 0.0), WINDOW) / WINDOW)
        return f"{x:.1f},{TOP + ph * (1 - r / ymax):.1f}"

    lines = [{"name": row.name, "colour": COLOURS[i % len(COLOURS)], "points": " ".join(xy(t, r) for t, r in pts),
              "peak": max(r for _, r in pts)} for i, (row, pts) in enumerate(series)]
    fmt = human if callable(human) else str
    yticks = [{"y": TOP + ph * (1 - f), "label": f"{fmt(ymax * f)}/s"} for f in (0, 0.5, 1)]
    xticks = [{"x": LEFT + pw * (1 - m * 60 / WINDOW), "label": "now" if m == 0 else f"-{m} min",
               "anchor": "end" if m == 0 else "middle"}
              for m in range(0, int(WINDOW // 60) + 1, 2)]
    return {"w": W, "h": H, "left": LEFT, "top": TOP, "bottom": H - BOTTOM, "right": W - RIGHT,
            "lines": lines, "yticks": yticks, "xticks": xticks}
