"""Marking: every object reachable from a set of root keys, through manifests (their layer
blobs) and chunk maps (their chunks). Reads only; objects are loaded in the store's pool.

An object that cannot be found is recorded in `missing` (a dangling reference: a bug or damage
somewhere, reported, never fatal); one that cannot be decoded in `unreadable` (it keeps nothing
alive, since what it refers to is unknown; a signature object, stored like a manifest, has no
references and is not counted as unreadable)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future

from layerstore import keys
from layerstore.errors import CorruptObject, LayerstoreError, NotFound
from layerstore.store import Store
from manifest.errors import InvalidManifest
from manifest.schema import Manifest, referenced_blobs
from manifest.signing import Signature


class Marker:
    def __init__(self, store: Store, progress: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.marked: set[str] = set()
        self.missing: set[str] = set()
        self.unreadable: set[str] = set()
        self._progress = progress

    def mark(self, roots: Iterable[str]) -> set[str]:
        """Mark everything reachable from `roots`; returns the keys this call marked."""
        new: set[str] = set()
        frontier = {k for k in roots if k not in self.marked}
        while frontier:
            self.marked |= frontier
            new |= frontier
            loads: list[tuple[str, Future[list[str]]]] = [
                (k, self.store.pool.submit(self._children, k)) for k in sorted(frontier) if not k.startswith("chunks/")
            ]
            frontier = set()
            for key, fut in loads:
                try:
                    children = fut.result()
                except NotFound:
                    self.missing.add(key)
                    continue
                except (CorruptObject, InvalidManifest, LayerstoreError):
                    self.unreadable.add(key)
                    continue
                frontier.update(c for c in children if c not in self.marked)
            if self._progress:
                self._progress(len(self.marked))
        return new

    def _children(self, key: str) -> list[str]:
        kind, ident = keys.digest_of_key(key)
        if kind == "manifests":
            data = self.store.get_manifest(ident)
            try:
                manifest = Manifest.from_bytes(data, f"manifest {ident}")
            except InvalidManifest:
                if _is_signature(data):
                    return []
                raise
            return [keys.object_key("blobs", b) for b in referenced_blobs(manifest)]
        if kind == "blobs":
            return [keys.object_key("chunks", d) for d in self.store.get_chunk_map(ident).unique_digests()]
        return []


def _is_signature(data: bytes) -> bool:
    try:
        Signature.from_bytes(data)
    except (InvalidManifest, LayerstoreError):
        return False
    return True
