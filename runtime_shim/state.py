"""The shim's persisted picture of a node: sandboxes, shared layer mounts and the node daemon.

Kept in LMDB (one environment under NODE/state): every change is one write transaction, so a
crash leaves either the old picture or the new one, never half of each, and a record costs the
same whether the node has ten sandboxes or ten thousand (a JSON file would be rewritten whole on
every mount). LMDB serialises writers itself; the shim additionally holds the node lock (see
`lock`) across each read-decide-mount-write sequence, since mounts are side effects LMDB cannot
roll back.

Records are JSON objects:
    sandboxes/<id>     Sandbox
    layers/<blob>      LayerMount (`refs` = sandboxes on the node that stack it)
    targets/<path>     sandbox id mounted at that path (for `umount TARGET`)
    meta/daemon        DaemonRecord
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from layerstore.errors import CorruptObject

MAP_SIZE = 1 << 32  # sparse; ~10 KB per sandbox leaves room for far more than a node can mount

# Sandbox status: what the record says the shim was doing. Recovery reads it after a crash.
MOUNTING, MOUNTED, UNMOUNTING, BROKEN = "mounting", "mounted", "unmounting", "broken"


@dataclass
class Sandbox:
    id: str
    env: str  # the reference the caller gave (name:tag or digest)
    manifest: str  # the manifest digest it resolved to
    layers: list[str]  # layer blobs, bottom first
    config: dict[str, Any]
    target: str  # where the composed root is mounted
    upper: str
    work: str
    owned: bool  # upper and work were created by the shim (and are deleted with the sandbox)
    store: str = ""
    status: str = MOUNTING
    error: str = ""
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Sandbox:
        return cls(**obj)


@dataclass
class LayerMount:
    blob: str
    mountpoint: str
    source: str  # the image file the EROFS mount reads
    refs: int = 0
    generation: str = ""  # what served `source` when it was mounted (see blobs.BlobSource)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LayerMount:
        return cls(**obj)


@dataclass
class DaemonRecord:
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells a live daemon from a reused pid
    store: str
    mountpoint: str
    cache: str
    argv: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DaemonRecord:
        return cls(**obj)


# One LMDB environment per path per process: LMDB forbids opening the same file twice in a process.
_envs: dict[str, tuple[lmdb.Environment, int]] = {}
_envs_lock = threading.Lock()


def _open_env(path: Path) -> lmdb.Environment:
    key = os.path.realpath(path)
    with _envs_lock:
        if key in _envs:
            env, n = _envs[key]
            _envs[key] = (env, n + 1)
            return env
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = lmdb.open(key, map_size=MAP_SIZE, max_dbs=4, subdir=True, lock=True, sync=True, metasync=True)
        _envs[key] = (env, 1)
        return env


def _close_env(env: lmdb.Environment) -> None:
    with _envs_lock:
        for key, (e, n) in list(_envs.items()):
            if e is env:
                if n > 1:
                    _envs[key] = (e, n - 1)
                else:
                    del _envs[key]
                    e.close()
                return


class Txn:
    """A view of the state inside one LMDB transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self._txn = txn
        self._dbs = dbs

    def _get(self, db: str, key: str) -> dict[str, Any] | None:
        raw = self._txn.get(key.encode(), db=self._dbs[db])
        if raw is None:
            return None
        try:
            obj = json.loads(raw)
        except ValueError:
            raise CorruptObject(f"node state: {db}/{key} is not JSON") from None
        return obj  # type: ignore[no-any-return]

    def _put(self, db: str, key: str, obj: dict[str, Any]) -> None:
        self._txn.put(key.encode(), json.dumps(obj, sort_keys=True).encode(), db=self._dbs[db])

    def _delete(self, db: str, key: str) -> None:
        self._txn.delete(key.encode(), db=self._dbs[db])

    def _items(self, db: str) -> Iterator[tuple[str, dict[str, Any]]]:
        with self._txn.cursor(db=self._dbs[db]) as cur:
            for k, v in cur:
                yield bytes(k).decode(), json.loads(bytes(v))

    # -- sandboxes -------------------------------------------------------------------
    def sandbox(self, sandbox: str) -> Sandbox | None:
        obj = self._get("sandboxes", sandbox)
        return Sandbox.from_json(obj) if obj is not None else None

    def sandboxes(self) -> list[Sandbox]:
        return [Sandbox.from_json(v) for _, v in self._items("sandboxes")]

    def put_sandbox(self, sb: Sandbox) -> None:
        old = self.sandbox(sb.id)
        if old is not None and old.target != sb.target:
            self._delete("targets", old.target)
        self._put("sandboxes", sb.id, sb.to_json())
        self._put("targets", sb.target, {"sandbox": sb.id})

    def delete_sandbox(self, sandbox: str) -> None:
        old = self.sandbox(sandbox)
        if old is None:
            return
        self._delete("sandboxes", sandbox)
        ref = self._get("targets", old.target)
        if ref is not None and ref.get("sandbox") == sandbox:
            self._delete("targets", old.target)

    def sandbox_at(self, target: str) -> Sandbox | None:
        ref = self._get("targets", target)
        return self.sandbox(ref["sandbox"]) if ref else None

    # -- layers ----------------------------------------------------------------------
    def layer(self, blob: str) -> LayerMount | None:
        obj = self._get("layers", blob)
        return LayerMount.from_json(obj) if obj is not None else None

    def layers(self) -> list[LayerMount]:
        return [LayerMount.from_json(v) for _, v in self._items("layers")]

    def put_layer(self, lm: LayerMount) -> None:
        self._put("layers", lm.blob, lm.to_json())

    def delete_layer(self, blob: str) -> None:
        self._delete("layers", blob)

    # -- daemon ----------------------------------------------------------------------
    def daemon(self) -> DaemonRecord | None:
        obj = self._get("meta", "daemon")
        return DaemonRecord.from_json(obj) if obj is not None else None

    def put_daemon(self, rec: DaemonRecord | None) -> None:
        if rec is None:
            self._delete("meta", "daemon")
        else:
            self._put("meta", "daemon", rec.to_json())


class NodeState:
    """The LMDB environment under NODE/state. Use `read()` and `write()` transactions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._env = _open_env(path)
        self._dbs = {name: self._env.open_db(name.encode()) for name in ("sandboxes", "layers", "targets", "meta")}

    def close(self) -> None:
        if self._env is not None:
            _close_env(self._env)
            self._env = None  # type: ignore[assignment]

    def __enter__(self) -> NodeState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def read(self) -> Iterator[Txn]:
        with self._env.begin(write=False) as txn:
            yield Txn(txn, self._dbs)

    @contextmanager
    def write(self) -> Iterator[Txn]:
        """One atomic change: committed when the block ends normally, aborted if it raises."""
        with self._env.begin(write=True) as txn:
            yield Txn(txn, self._dbs)
