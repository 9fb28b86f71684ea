"""The snapshotter's records, in LMDB (one environment under SNAP/metadata).

    snapshots/<key>            Snapshot (JSON): id, kind, parent key, labels, times, blob
    children/<parent>\\0<key>   present while <key> names <parent> as its parent (O(1) refusal
                               of Remove on a parent, O(children) listing)
    layers/<blob>              written by earlier versions (a layer mount of their own under
                               SNAP/layers): emptied at start; layers are the node's now (`layers`)
    meta/next-id               the next snapshot id (directories are named by id, never reused)

Every change is one write transaction. Unlike the shim's node state (which describes mounts that
die with the kernel), these records describe directories that outlive a reboot, so transactions are
synced (LMDB's defaults).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from layerstore.errors import CorruptObject

VIEW, ACTIVE, COMMITTED = "view", "active", "committed"
KINDS = (VIEW, ACTIVE, COMMITTED)
MAP_SIZE = 1 << 32
DBS = ("snapshots", "children", "layers", "meta")


@dataclass
class Snapshot:
    key: str
    id: int
    kind: str
    parent: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    blob: str = ""  # a layerstore blob: the snapshot is that layer's EROFS mount (committed, read-only)
    size: int = -1  # committed local snapshots: bytes used, measured at commit (-1: unknown)
    inodes: int = -1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "parent": self.parent, "labels": self.labels,
                               "created": self.created, "updated": self.updated}
        if self.blob:
            out["blob"] = self.blob
        if self.size >= 0:
            out["size"], out["inodes"] = self.size, self.inodes
        return out

    @classmethod
    def from_json(cls, key: str, obj: dict[str, Any]) -> Snapshot:
        try:
            snap = cls(key, int(obj["id"]), str(obj["kind"]), str(obj.get("parent", "")),
                       {str(k): str(v) for k, v in dict(obj.get("labels") or {}).items()},
                       float(obj.get("created", 0.0)), float(obj.get("updated", 0.0)), str(obj.get("blob", "")),
                       int(obj.get("size", -1)), int(obj.get("inodes", -1)))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptObject(f"snapshotter metadata: record {key!r} is malformed ({e})") from None
        if snap.kind not in KINDS:
            raise CorruptObject(f"snapshotter metadata: record {key!r} has kind {snap.kind!r}")
        return snap


def _k(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


class Txn:
    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self.txn = txn
        self.dbs = dbs

    def get(self, key: str) -> Snapshot | None:
        raw = self.txn.get(_k(key), db=self.dbs["snapshots"])
        if raw is None:
            return None
        try:
            return Snapshot.from_json(key, json.loads(bytes(raw)))
        except ValueError:
            raise CorruptObject(f"snapshotter metadata: record {key!r} is not JSON") from None

    def put(self, snap: Snapshot) -> None:
        self.txn.put(_k(snap.key), json.dumps(snap.to_json(), sort_keys=True).encode(), db=self.dbs["snapshots"])

    def add(self, snap: Snapshot) -> None:
        """A new record (and its place among its parent's children)."""
        self.put(snap)
        if snap.parent:
            self.txn.put(_k(snap.parent) + b"\0" + _k(snap.key), b"", db=self.dbs["children"])

    def delete(self, snap: Snapshot) -> None:
        self.txn.delete(_k(snap.key), db=self.dbs["snapshots"])
        if snap.parent:
            self.txn.delete(_k(snap.parent) + b"\0" + _k(snap.key), db=self.dbs["children"])

    def children(self, key: str) -> list[str]:
        prefix = _k(key) + b"\0"
        out = []
        with self.txn.cursor(db=self.dbs["children"]) as cur:
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    k = bytes(k)
                    if not k.startswith(prefix):
                        break
                    out.append(k[len(prefix):].decode("utf-8", "surrogateescape"))
        return out

    def all(self) -> Iterator[Snapshot]:
        with self.txn.cursor(db=self.dbs["snapshots"]) as cur:
            for k, v in cur:
                key = bytes(k).decode("utf-8", "surrogateescape")
                try:
                    yield Snapshot.from_json(key, json.loads(bytes(v)))
                except ValueError:
                    raise CorruptObject(f"snapshotter metadata: record {key!r} is not JSON") from None

    def chain(self, key: str) -> list[Snapshot]:
        """The snapshot and its ancestors, itself first."""
        out: list[Snapshot] = []
        seen: set[str] = set()
        cur = self.get(key)
        while cur is not None:
            if cur.key in seen:
                raise CorruptObject(f"snapshotter metadata: parent loop at {cur.key!r}")
            seen.add(cur.key)
            out.append(cur)
            if not cur.parent:
                break
            parent = self.get(cur.parent)
            if parent is None:
                raise CorruptObject(f"snapshotter metadata: {cur.key!r} names a missing parent {cur.parent!r}")
            cur = parent
        return out

    def next_id(self) -> int:
        raw = self.txn.get(b"next-id", db=self.dbs["meta"])
        n = int(bytes(raw)) if raw is not None else 1
        self.txn.put(b"next-id", str(n + 1).encode(), db=self.dbs["meta"])
        return n

    # -- layer mounts of earlier versions ----------------------------------------------------
    def delete_layer(self, blob: str) -> None:
        self.txn.delete(_k(blob), db=self.dbs["layers"])

    def layers(self) -> dict[str, dict[str, Any]]:
        with self.txn.cursor(db=self.dbs["layers"]) as cur:
            return {bytes(k).decode(): dict(json.loads(bytes(v))) for k, v in cur}

    def blob_users(self, blob: str) -> int:
        return sum(1 for s in self.all() if s.blob == blob)


class Metadata:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.env = lmdb.open(os.fspath(path), map_size=MAP_SIZE, max_dbs=len(DBS) + 1, subdir=True)
        self.dbs = {name: self.env.open_db(name.encode()) for name in DBS}
        self._mu = threading.Lock()

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def read(self) -> Iterator[Txn]:
        with self.env.begin(write=False) as txn:
            yield Txn(txn, self.dbs)

    @contextmanager
    def write(self) -> Iterator[Txn]:
        with self._mu, self.env.begin(write=True) as txn:
            yield Txn(txn, self.dbs)
