"""The store service's status page (docs/status-page.md): one server-rendered HTML page of the
store's environments and tags, its layers with their sizes, what deduplication and compression
save, and the last garbage collection run.

`render_status(store, visible=...)` is all the app calls (in a worker thread). A refresh of the
figures (`snapshot`) reads the store through `Store` and `manifest`; the chunk maps it has read
stay in a per-store deduplication index (`DedupIndex`), so a refresh reads only new chunk maps.
A snapshot is shared for `SNAPSHOT_TTL` seconds by every caller; what a caller may see
(`visible(name)` of an environment's name) is applied when the page is rendered.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from layergc.report import last_report
from packaging.version import InvalidVersion, Version

from layerstore import digest as digestmod
from layerstore import keys
from layerstore.chunkmap import ChunkMap
from layerstore.errors import LayerstoreError, NotFound
from layerstore.store import Store
from manifest.environment import SIG_TAG_NAME, load_manifest
from manifest.schema import Manifest

from . import nodes as nodesmod

SNAPSHOT_TTL = 5.0  # seconds a snapshot serves every render
LISTING_TTL = 300.0  # seconds between two listings of every chunk object (stored sizes, unreferenced chunks)
MAX_MANIFESTS_CACHED = 4096
TEMPLATES = Path(__file__).parent / "templates"
DIGEST_BYTES = 32

Visible = Callable[[str], bool]


def _everyone(name: str) -> bool:
    return True


# -- the deduplication index (pure: no I/O) --------------------------------------------------------
@dataclass(frozen=True)
class BlobSummary:
    size: int
    chunks: int
    digests: bytes  # its distinct chunk digests, 32 raw bytes each
    lengths: tuple[int, ...]  # their lengths, in the same order


def summarize(cm: ChunkMap) -> BlobSummary:
    seen: dict[bytes, int] = {}
    for ref in cm.chunks:
        seen.setdefault(digestmod.raw_of(ref.digest), ref.length)
    return BlobSummary(cm.size, len(cm.chunks), b"".join(seen), tuple(seen.values()))


class DedupIndex:
    """Which blobs use which chunks: every distinct chunk's length, how many blobs use it, and
    the size of its stored object once known (-1 until then)."""

    def __init__(self) -> None:
        self.blobs: dict[str, BlobSummary] = {}
        self.chunks: dict[bytes, list[int]] = {}  # raw digest -> [length, blobs using it, stored size]
        self.unique_bytes = 0  # sum of the lengths of every distinct chunk
        self.stored_bytes = 0  # sum of the known stored sizes of every distinct chunk
        self.unsized: set[bytes] = set()  # distinct chunks whose stored size is not known

    def add(self, blob: str, s: BlobSummary) -> None:
        if blob in self.blobs:
            return
        self.blobs[blob] = s
        for raw, length in zip(_split(s.digests), s.lengths, strict=True):
            entry = self.chunks.get(raw)
            if entry is None:
                self.chunks[raw] = [length, 1, -1]
                self.unique_bytes += length
                self.unsized.add(raw)
            else:
                entry[1] += 1

    def remove(self, blob: str) -> None:
        s = self.blobs.pop(blob, None)
        if s is None:
            return
        for raw in _split(s.digests):
            entry = self.chunks[raw]
            entry[1] -= 1
            if entry[1] == 0:
                del self.chunks[raw]
                self.unique_bytes -= entry[0]
                self.stored_bytes -= max(entry[2], 0)
                self.unsized.discard(raw)

    def set_stored(self, raw: bytes, size: int) -> bool:
        """Record the stored size of a chunk; False if no blob uses it."""
        entry = self.chunks.get(raw)
        if entry is None:
            return False
        self.stored_bytes += size - max(entry[2], 0)
        entry[2] = size
        self.unsized.discard(raw)
        return True

    @property
    def logical_bytes(self) -> int:
        return sum(s.size for s in self.blobs.values())

    def shared_bytes(self, blob: str) -> int:
        """Bytes of `blob` in chunks that some other blob uses too."""
        s = self.blobs[blob]
        return sum(length for raw, length in zip(_split(s.digests), s.lengths, strict=True)
                   if self.chunks[raw][1] > 1)


def _split(digests: bytes) -> Iterable[bytes]:
    return (digests[i:i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES))


# -- a snapshot of the store ----------------------------------------------------------------------
@dataclass
class EnvRow:
    ref: str
    name: str
    manifest: str
    layers: list[tuple[str, str, int]] = field(default_factory=list)  # (role, blob, size)
    size: int = 0
    error: str = ""


@dataclass
class LayerRow:
    blob: str
    size: int = 0
    chunks: int = 0
    shared_bytes: int = 0
    error: str = ""
    used_by: list[tuple[str, str, str]] = field(default_factory=list)  # (env name, ref, role there)


@dataclass
class Snapshot:
    taken: float
    envs: list[EnvRow]
    layers: list[LayerRow]
    logical_bytes: int
    unique_bytes: int
    unique_chunks: int
    stored_bytes: int  # the stored objects of the distinct chunks the layers use
    missing_chunks: int  # distinct chunks some layer uses whose object is not in the store
    stored_objects: int  # every chunk object, at the last listing
    unreferenced_bytes: int  # chunk objects no chunk map named, at the last listing
    unreferenced_objects: int
    listed: float  # when the chunk objects were last listed (epoch seconds)
    gc: dict[str, Any] | None
    gc_error: str = ""
    nodes: list[nodesmod.NodeRow] = field(default_factory=list)
    other_leases: int = 0
    leases_cut: bool = False  # more leases than nodes.MAX_LEASES: some were not read
    nodes_error: str = ""
    now: float = 0.0  # wall clock of the refresh (the plot's right edge)


class StatusSource:
    """One store's index, manifest cache and last snapshot; refreshes are serialized."""

    def __init__(self) -> None:
        self.index = DedupIndex()
        self.map_errors: dict[str, str] = {}
        self.manifests: dict[str, Manifest] = {}
        self.lock = threading.Lock()
        self.last: Snapshot | None = None
        self.listing: tuple[float, float, int, int, int] | None = None  # (monotonic, epoch, objects, unref bytes, n)

    def snapshot(self, store: Store, ttl: float | None = None) -> Snapshot:
        ttl = SNAPSHOT_TTL if ttl is None else ttl
        with self.lock:
            if self.last is None or time.monotonic() - self.last.taken >= ttl:
                self.last = self._refresh(store)
            return self.last

    def _refresh(self, store: Store) -> Snapshot:
        taken = time.monotonic()
        blobs = set(store.list_digests("blobs"))
        for gone in set(self.index.blobs) - blobs:
            self.index.remove(gone)
        self.map_errors = {b: e for b, e in self.map_errors.items() if b in blobs}
        new = sorted(blobs - set(self.index.blobs))
        futures: list[tuple[str, Future[BlobSummary]]] = [
            (b, store.pool.submit(lambda b=b: summarize(store.get_chunk_map(b)))) for b in new]  # type: ignore[misc]
        for blob, fut in futures:
            try:
                self.index.add(blob, fut.result())
                self.map_errors.pop(blob, None)
            except LayerstoreError as e:
                self.map_errors[blob] = str(e)  # read again at the next refresh

        if self.listing is None or taken - self.listing[0] >= LISTING_TTL:
            self._list_chunks(store, taken)
        else:
            self._size_new_chunks(store)
        _, listed, stored_objects, unref_bytes, unref_objects = self.listing  # type: ignore[misc]

        layers = {b: self._layer_row(b) for b in sorted(blobs)}
        envs = [self._env_row(store, ref, digest, error, layers) for ref, digest, error in environment_tags(store)]
        gc_error = ""
        try:
            gc = last_report(store)
        except LayerstoreError as e:
            gc, gc_error = None, str(e)
        rows = sorted(layers.values(), key=lambda lr: lr.blob)
        snap = Snapshot(taken, envs, rows, self.index.logical_bytes, self.index.unique_bytes, len(self.index.chunks),
                        self.index.stored_bytes, len(self.index.unsized), stored_objects, unref_bytes, unref_objects,
                        listed, gc, gc_error, now=time.time())
        try:
            snap.nodes, snap.other_leases, snap.leases_cut = nodesmod.read_nodes(store.backend, snap.now, store.pool)
        except LayerstoreError as e:
            snap.nodes_error = str(e)
        return snap

    def _list_chunks(self, store: Store, taken: float) -> None:
        """One listing of every chunk object: the stored size of each one a layer uses, and what
        the ones no layer uses hold (nothing per object is kept for those)."""
        listed = time.time()
        objects = unref_bytes = unref_objects = 0
        for info in store.backend.list_info("chunks/"):
            try:
                raw = digestmod.raw_of(keys.digest_of_key(info.key)[1])
            except LayerstoreError:
                continue  # not a chunk object's key (a temporary file, a stray name)
            objects += 1
            if not self.index.set_stored(raw, info.size):
                unref_bytes += info.size
                unref_objects += 1
        self.listing = (taken, listed, objects, unref_bytes, unref_objects)

    def _size_new_chunks(self, store: Store) -> None:
        """Between listings: the stored size of each chunk that a new layer brought, one `size`
        call each (a chunk missing from the store stays unsized: shown as missing)."""
        def size(raw: bytes) -> int | None:
            try:
                return store.backend.size(keys.object_key("chunks", digestmod.from_raw(raw)))
            except LayerstoreError:
                return None

        unsized = sorted(self.index.unsized)
        for raw, n in zip(unsized, store.pool.map(size, unsized), strict=True):
            if n is not None:
                self.index.set_stored(raw, n)

    def _layer_row(self, blob: str) -> LayerRow:
        s = self.index.blobs.get(blob)
        if s is None:
            return LayerRow(blob, error=self.map_errors.get(blob, "not read"))
        return LayerRow(blob, s.size, s.chunks, self.index.shared_bytes(blob))

    def _env_row(self, store: Store, ref: str, digest: str, error: str, layers: dict[str, LayerRow]) -> EnvRow:
        row = EnvRow(ref, ref.rpartition(":")[0], digest, error=error)
        if error:
            return row
        try:
            m = self.manifests.get(digest)
            if m is None:
                m = load_manifest(store, digest)
                if len(self.manifests) >= MAX_MANIFESTS_CACHED:
                    self.manifests.clear()
                self.manifests[digest] = m
        except LayerstoreError as e:
            row.error = str(e)
            return row
        row.layers = [(layer.role, layer.blob, layer.size) for layer in m.layers]
        row.size = m.size
        for layer in m.layers:
            lr = layers.get(layer.blob)
            if lr is None:
                lr = layers[layer.blob] = LayerRow(layer.blob, layer.size, error="missing from the store")
            lr.used_by.append((row.name, ref, layer.role))
        return row


def environment_tags(store: Store) -> list[tuple[str, str, str]]:
    """(ref, manifest digest, "") of every environment tag, sorted; a tag that cannot be read
    (a malformed name or value at a key under `tags/`) is (ref, "", why): one bad tag does not
    hide the others. Signature tags are left out."""
    out = []
    for key in store.backend.list("tags/"):
        ref = keys.tag_of_key(key)
        if ref.startswith(SIG_TAG_NAME + "/"):
            continue
        try:
            out.append((ref, store.get_tag(ref), ""))
        except NotFound:
            continue  # deleted between the listing and the read
        except LayerstoreError as e:
            out.append((ref, "", str(e)))
    return sorted(out, key=lambda row: tag_order(row[0]))


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    """`text` cut into runs of digits (compared as numbers) and of other characters."""
    out: list[tuple[int, int | str]] = []
    for digits, run in itertools.groupby(text, str.isdigit):
        part = "".join(run)
        out.append((0, int(part)) if digits else (1, part))
    return tuple(out)


def tag_order(ref: str) -> tuple[Any, ...]:
    """Sort key of a reference `name:tag`: by name, then the tags that are versions
    (`packaging.version`: 1.9 < 1.10, v2 < v10, 1.0rc1 < 1.0) in version order, then the others
    (`latest`, `main-2024`) in natural order (digit runs as numbers)."""
    name, _, tag = ref.rpartition(":")
    if not name:
        name, tag = ref, ""
    try:
        return (name, 0, Version(tag), ())
    except InvalidVersion:
        return (name, 1, _natural(tag), tag)


_sources: weakref.WeakKeyDictionary[Store, StatusSource] = weakref.WeakKeyDictionary()
_sources_lock = threading.Lock()


def source_for(store: Store) -> StatusSource:
    with _sources_lock:
        src = _sources.get(store)
        if src is None:
            src = _sources[store] = StatusSource()
        return src


# -- the page -------------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _epoch(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e11


def when(epoch: object) -> str:
    if not _epoch(epoch):
        return "-"
    try:
        return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "-"


def clock(epoch: object) -> str:
    """The time of day only (the full date is in the cell's title)."""
    return when(epoch)[11:] if _epoch(epoch) else "-"


def short(digest: str) -> str:
    return digest[:15] + "…" if len(digest) > 16 else digest


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_env.filters.update(bytes=human_bytes, when=when, clock=clock, short=short)
_env.globals.update(percent=percent)


def _count(value: object) -> int | None:
    """A count from the gc report (written by whoever may write `gc/`): a non-negative integer, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _part(report: dict[str, Any], name: str) -> dict[str, Any]:
    value = report.get(name)
    return value if isinstance(value, dict) else {}


def page_model(snap: Snapshot, visible: Visible) -> dict[str, Any]:
    """What the template shows to a caller who sees the names `visible` accepts."""
    envs = [e for e in snap.envs if visible(e.name)]
    layers = []
    for lr in snap.layers:
        users = [(ref, role) for name, ref, role in lr.used_by if visible(name)]
        if lr.used_by and not users:
            continue  # used only by environments the caller may not know of
        layers.append({"row": lr, "users": sorted({ref for ref, _ in users}),
                       "roles": sorted({role for _, role in users})})
    gc = snap.gc
    gc_view = None
    if gc is not None:
        started, finished = gc.get("started"), gc.get("finished")
        duration = finished - started if _epoch(started) and _epoch(finished) and finished >= started else None
        gc_view = {"started": started, "finished": finished, "duration": duration,
                   "marked_objects": _count(gc.get("marked_objects")),
                   "deleted_objects": _count(gc.get("deleted_objects")),
                   "deleted_bytes": _count(gc.get("deleted_bytes")), "dry_run": gc.get("dry_run") is True,
                   **{f"{part}_{unit}": _count(_part(gc, part).get(unit))
                      for part in ("rescued", "kept_lease", "kept_grace") for unit in ("objects", "bytes")}}
    referenced = snap.stored_bytes  # the stored bytes of the layers' distinct chunks
    return {
        "envs": envs, "layers": layers, "snap": snap, "gc": gc_view, "referenced_bytes": referenced,
        "listed": when(snap.listed),
        "dedup_saved": snap.logical_bytes - snap.unique_bytes,
        "compression_saved": snap.unique_bytes - referenced,
        "total_saved": snap.logical_bytes - referenced,
        "ratio": f"{snap.logical_bytes / referenced:.2f}x" if referenced else "-",
        "generated": when(time.time()),
        "plot": nodesmod.plot(snap.nodes, snap.now, human_bytes), "window_min": int(nodesmod.WINDOW // 60),
    }


def render_page(template: str, **context: Any) -> str:
    """One of the service's pages (`templates/`), autoescaped."""
    return _env.get_template(template).render(**context)


def render_status(store: Store, *, visible: Visible = _everyone, nodes: bool = True) -> str:
    """The status page of `store` as the caller who sees the environment names `visible` accepts;
    `nodes`: whether it may see the nodes (their names, leases and figures are the operator's,
    not a namespaced tenant's: another tenant's burst shows in them)."""
    snap = source_for(store).snapshot(store)
    return _env.get_template("status.html").render(**page_model(snap, visible), show_nodes=nodes)
