"""The shim's persisted picture of a node: sandboxes, shared layer mounts and the node daemon.

Kept in LMDB (one environment under NODE/state): every change is one write transaction, so a
crash of the process leaves either the old picture or the new one, never half of each, and a
record costs the same whether the node has ten sandboxes or ten thousand (a JSON file would be
rewritten whole on every mount). LMDB serialises writers itself; the shim additionally holds the
node lock (see `lock`) across each read-decide-mount-write sequence, since mounts are side effects
LMDB cannot roll back.

Durability: the database describes mounts, which live in the kernel and die with it. It is
opened without fsync (`sync=False, metasync=False`): a committed transaction is in the page
cache, which survives any crash of a process, so within one boot the picture is exact. After a
power loss or kernel crash every mount is gone anyway and the database may have lost its last
transactions (or, since LMDB without sync relies on write ordering, be damaged); the boot id
recorded in `meta/boot` tells recovery that the machine restarted, and recovery then rebuilds
the picture from the per-sandbox records (`records`) instead of trusting the database.
This takes the fsync (2-10 ms on a busy disk) out of every mount and every teardown.

Records are JSON objects:
    sandboxes/<id>     Sandbox
    layers/<blob>      LayerMount (`refs` = sandboxes on the node that stack it)
    targets/<path>     sandbox id mounted at that path (for `umount TARGET`), unless the path's
                       last component is the sandbox's id (NODE/roots/<id>, the default)
    uppers/<path>      sandbox id using that upper directory (uniqueness without a scan), unless
                       the path is .../<id>/upper (the upper the shim makes)
                       (the two exceptions are found from the path itself: `_derived`, so that a
                       warm mount writes and a teardown reads two entries fewer)
    pending/<id>       an operation in flight on a sandbox ({"op": "mount"|"unmount", "pid", "start"}):
                       written first, deleted in the transaction that completes the operation, so
                       a crash mid-operation is found without looking at every sandbox; an entry
                       whose process (pid + start time) still runs is in flight, not a crash
    meta/daemon        DaemonRecord
    meta/boot          {"boot_id": ...} of the boot the picture belongs to
    meta/roots         present while the shim's NODE/roots bind mount is made (so that a mount
                       need not ask the kernel)
    meta/hints/<blob>  {"chunks": [...]}: the blob's prefetch hints already sent to the daemon
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import lmdb
import orjson

from layerstore.errors import CorruptObject
from layerstore.fileio import LMDB_FILES, narrow_files, private_dir

from .idmap import SLOTS, base_of, slot_of

ATTACHED_PREFIX = "fanotify:"  # the generation of a mount on a cache file filled on fanotify events
GENERATION_SEP = "|"  # between the group's and the daemon's part of a fanotify node's generation


def group_generation(group: str, daemon: str) -> str:
    """The blob source's generation on the fanotify data path: the group's and the daemon's."""
    return f"{group}{GENERATION_SEP}{daemon}"


def fuse_generation(generation: str) -> str:
    """What a layer mounted on the daemon's FUSE file records: the daemon's part."""
    group, _, daemon = generation.partition(GENERATION_SEP)
    return daemon or group

MAP_SIZE = 1 << 32  # sparse; ~1.5 KB per sandbox leaves room for far more than a node can mount
DBS = ("sandboxes", "layers", "targets", "uppers", "pending", "meta", "idranges")
BOOT_ID = "/proc/sys/kernel/random/boot_id"

# Sandbox status: what the record says the shim was doing. Recovery reads it after a crash.
MOUNTING, MOUNTED, UNMOUNTING, BROKEN = "mounting", "mounted", "unmounting", "broken"


def boot_id() -> str:
    """This boot's id: changes at every reboot, kernel crash included."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """/proc/<pid>/stat field 22 of a live (non-zombie) process, else None: with the pid, it names
    one process for the life of the boot (a reused pid has another start time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


_self: tuple[int, int | None] = (0, None)


def _self_start_time() -> int | None:
    global _self
    if _self[0] != os.getpid():  # (re)computed after a fork
        _self = (os.getpid(), start_time(os.getpid()))
    return _self[1]


def owner_alive(info: dict[str, Any]) -> bool:
    """Does the process that wrote a `pending` entry still run?"""
    pid, start = info.get("pid"), info.get("start")
    return isinstance(pid, int) and start is not None and start_time(pid) == start


_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def encode(obj: dict[str, Any]) -> bytes:
    """A record as stored (and as a sandbox's record holds it): compact JSON, keys sorted. orjson:
    a warm mount encodes and decodes about ten records, 6 us each with the json module, under 1
    with this (records written by the json module, with spaces, read the same)."""
    return orjson.dumps(obj, option=_OPTIONS)


decode = orjson.loads  # (raises a ValueError on what is not JSON)


_FIELDS: dict[type, frozenset[str]] = {}


def _known(cls: type, obj: dict[str, Any]) -> dict[str, Any]:
    # Records written by a newer shim may carry fields this one does not know: ignore them.
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in fields(cls))
    if names.issuperset(obj):
        return obj
    return {k: v for k, v in obj.items() if k in names}


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
    utab: bool = False  # an entry in /run/mount/utab sends `umount TARGET` to umount.layerstore
    userns: int | None = None  # the base host id of its user namespace's id range (`idmap`); None: no userns
    # "" = its root is composed on the host (an overlay at `target`, for a container runtime); else
    # the VM backend whose guest composes it from the layer mounts' files (no overlay, `target`
    # never mounted; `upper` is its upper drive, an ext4 image, when it is kept)
    backend: str = ""
    # why its data path died under it ("" = it did not): a layer it stacks was on the FUSE mount of a
    # node daemon that died (`lost`); kept when recovery mounts it again (what ran in it saw errors)
    lost: str = ""

    def to_json(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies every value, a measurable share of a mount
        return {"id": self.id, "env": self.env, "manifest": self.manifest, "layers": list(self.layers),
                "config": self.config, "target": self.target, "upper": self.upper, "work": self.work,
                "owned": self.owned, "store": self.store, "status": self.status, "error": self.error,
                "created": self.created, "utab": self.utab, "userns": self.userns,
                **({"backend": self.backend} if self.backend else {}), **({"lost": self.lost} if self.lost else {})}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Sandbox:
        return cls(**_known(cls, obj))


def this_process() -> dict[str, Any]:
    """How a record names the calling process (see `owner_alive`)."""
    return {"pid": os.getpid(), "start": _self_start_time()}


@dataclass
class LayerMount:
    blob: str
    mountpoint: str
    source: str  # the image file the EROFS mount reads
    refs: int = 0  # sandboxes that stack it, mounted or being mounted
    generation: str = ""  # what served `source` when it was mounted (see blobs.BlobSource)
    # `mounting`: claimed by `owner` (this_process()), which mounts it outside the node lock while
    # holding NODE/locks/<hex>; others wait for the outcome. An owner of None (or a dead one) means
    # nobody is mounting it: the next to look claims it. `error`: why the last attempt failed.
    status: str = MOUNTED
    owner: dict[str, Any] | None = None
    error: str = ""
    # A direct mount: `source` is the blob's complete data file in the node cache, pinned by this
    # holder (the daemon never modifies it meanwhile); it reads a local file, not the daemon's.
    pin: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"blob": self.blob, "mountpoint": self.mountpoint, "source": self.source, "refs": self.refs,
               "generation": self.generation, "status": self.status}
        if self.owner is not None:
            out["owner"] = self.owner
        if self.error:
            out["error"] = self.error
        if self.pin:
            out["pin"] = self.pin
        return out

    def current(self, generation: str | None) -> bool:
        """Does this mount read what the blob source serves now? (A direct mount always does.) On
        the fanotify data path the source's generation names the group and the daemon
        (`group_generation`): a mount attached to the group lives as long as the group, a mount
        on the daemon's FUSE file (a layer whose attach failed) only as long as that daemon."""
        if self.pin:
            return True
        if generation is None:
            return False
        group, _, daemon = generation.partition(GENERATION_SEP)
        if self.generation.startswith(ATTACHED_PREFIX):
            return self.generation == group
        return self.generation == (daemon or group)

    @property
    def in_flight(self) -> bool:
        """Being mounted by a live process (recovery leaves it alone)."""
        return self.status == MOUNTING and self.owner is not None and owner_alive(self.owner)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LayerMount:
        return cls(**_known(cls, obj))


@dataclass
class DaemonRecord:
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells a live daemon from a reused pid
    store: str
    mountpoint: str
    cache: str
    argv: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "store": self.store, "mountpoint": self.mountpoint,
                "cache": self.cache, "argv": list(self.argv)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DaemonRecord:
        return cls(**_known(cls, obj))


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
        private_dir(path, parents=True)  # (0700 also if it existed wider)
        narrow_files(path, LMDB_FILES)  # (made 0644 by an older version)
        # No fsync per transaction: see the module docstring (the boot id covers what it would).
        # writemap: a commit writes its pages into the shared map instead of one pwrite(2) each;
        # a warm mount's two transactions cost 11-14 us instead of 25-44 (the more after a mass
        # teardown left a long free list), a teardown's 4-5 instead of 18 (docs/shim-scale.md,
        # "The warm path"). data.mdb then has the map's size as its length: a sparse file, its
        # blocks are the pages in use (`size`).
        env = lmdb.open(key, map_size=MAP_SIZE, max_dbs=len(DBS) + 2, subdir=True, lock=True, sync=False,
                        metasync=False, writemap=True, mode=0o600)
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


def _derived_target(target: str) -> str:
    """The only sandbox a target can belong to without an index entry: its last component."""
    return target.rpartition("/")[2]


def _derived_upper(upper: str) -> str:
    """The same for an upper: the sandbox that .../<id>/upper belongs to ("" for any other path)."""
    parent, _, name = upper.rpartition("/")
    return parent.rpartition("/")[2] if name == "upper" else ""


_DERIVED = {"targets": _derived_target, "uppers": _derived_upper}


def _indexed(db: str, key: str, sandbox: str) -> bool:
    """Does `key` of `db` need an entry naming `sandbox` (one its path does not name already)?"""
    derive = _DERIVED.get(db)
    return derive is None or derive(key) != sandbox


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
            obj = decode(raw)
        except ValueError:
            raise CorruptObject(f"node state: {db}/{key} is not JSON") from None
        return obj  # type: ignore[no-any-return]

    def _put(self, db: str, key: str, obj: dict[str, Any]) -> None:
        self._txn.put(key.encode(), encode(obj), db=self._dbs[db])

    def _delete(self, db: str, key: str) -> None:
        self._txn.delete(key.encode(), db=self._dbs[db])

    def _items(self, db: str) -> Iterator[tuple[str, dict[str, Any]]]:
        with self._txn.cursor(db=self._dbs[db]) as cur:
            for k, v in cur:
                yield bytes(k).decode(), decode(v)

    def count(self, db: str) -> int:
        return int(self._txn.stat(self._dbs[db])["entries"])

    # -- sandboxes -------------------------------------------------------------------
    def sandbox(self, sandbox: str) -> Sandbox | None:
        obj = self._get("sandboxes", sandbox)
        return Sandbox.from_json(obj) if obj is not None else None

    def sandboxes(self) -> list[Sandbox]:
        return [Sandbox.from_json(v) for _, v in self._items("sandboxes")]

    def put_sandbox(self, sb: Sandbox, old: Sandbox | None = None, *, new: bool = False) -> None:
        """`old`: the record as it is now, when the caller has it (saves a read); `new`: the
        caller knows there is none."""
        if old is None and not new:
            old = self.sandbox(sb.id)
        if old is not None and old.target != sb.target:
            self._delete_ref("targets", old.target, sb.id)
        if old is not None and old.upper != sb.upper:
            self._delete_ref("uppers", old.upper, sb.id)
        self._put("sandboxes", sb.id, sb.to_json())
        for db, key in (("targets", sb.target), ("uppers", sb.upper)):
            if _indexed(db, key, sb.id):
                self._put(db, key, {"sandbox": sb.id})
        if sb.userns is not None:
            self._put("idranges", str(slot_of(sb.userns)), {"sandbox": sb.id})

    def put_status(self, sb: Sandbox, encoded: bytes | None = None) -> None:
        """Rewrite a sandbox's record whose target, upper and id range are unchanged (a status
        change): its index entries stay as they are. `encoded`: `encode(sb.to_json())`, when the
        caller has it."""
        self._txn.put(sb.id.encode(), encoded if encoded is not None else encode(sb.to_json()),
                      db=self._dbs["sandboxes"])

    def delete_sandbox(self, sandbox: str) -> None:
        old = self.sandbox(sandbox)
        if old is None:
            return
        self._delete("sandboxes", sandbox)
        if old.userns is not None:
            self._delete_ref("idranges", str(slot_of(old.userns)), sandbox)
        self._delete_ref("targets", old.target, sandbox)
        self._delete_ref("uppers", old.upper, sandbox)

    def _delete_ref(self, db: str, key: str, sandbox: str) -> None:
        if not _indexed(db, key, sandbox):
            return
        ref = self._get(db, key)
        if ref is not None and ref.get("sandbox") == sandbox:
            self._delete(db, key)

    def allocate_idrange(self, sandbox: str) -> int:
        """A free id range for the sandbox's user namespace (its base host id; `idmap`), taken
        for it in this transaction (`put_sandbox` records it; forgetting the sandbox frees it).
        Slots are handed out round robin from a cursor, so a range is not reused right after it
        was freed; O(1) unless nearly every slot is taken."""
        cur = self._get("meta", "idrange-next")
        start = int(cur["slot"]) if cur else 0
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            ref = self._get("idranges", str(slot))
            if ref is None or ref.get("sandbox") == sandbox:
                self._put("idranges", str(slot), {"sandbox": sandbox})
                self._put("meta", "idrange-next", {"slot": (slot + 1) % SLOTS})
                return base_of(slot)
        raise CorruptObject(f"every one of the {SLOTS} sandbox id ranges is taken")

    def sandbox_at(self, target: str, *, absent: str = "") -> Sandbox | None:
        """The sandbox mounted at `target`. `absent`: a sandbox id the caller knows has no record
        (its own new one: a lookup fewer)."""
        ref = self._get("targets", target)
        if ref:
            return self.sandbox(ref["sandbox"])
        sid = _derived_target(target)
        sb = self.sandbox(sid) if sid != absent else None
        return sb if sb is not None and sb.target == target else None

    def sandbox_with_upper(self, upper: str, *, absent: str = "") -> Sandbox | None:
        """The sandbox using `upper` (`absent`: as for `sandbox_at`)."""
        ref = self._get("uppers", upper)
        if ref:
            return self.sandbox(ref["sandbox"])
        sid = _derived_upper(upper)
        sb = self.sandbox(sid) if sid and sid != absent else None
        return sb if sb is not None and sb.upper == upper else None

    # -- operations in flight --------------------------------------------------------------
    def pending(self) -> dict[str, dict[str, Any]]:
        return dict(self._items("pending"))

    def put_pending(self, sandbox: str, op: str, **info: Any) -> None:
        self._put("pending", sandbox, {"op": op, "pid": os.getpid(), "start": _self_start_time(), **info})

    def dead_pending(self) -> dict[str, dict[str, Any]]:
        """Pending operations whose process is gone (a crash): recovery's to settle. O(operations
        in flight): zero reads of the table when it is empty."""
        if self.count("pending") == 0:
            return {}
        return {sid: info for sid, info in self._items("pending") if not owner_alive(info)}

    def clear_pending(self, sandbox: str) -> None:
        self._delete("pending", sandbox)  # (LMDB: deleting an absent key changes nothing)

    # -- layers ----------------------------------------------------------------------
    def layer(self, blob: str) -> LayerMount | None:
        obj = self._get("layers", blob)
        return LayerMount.from_json(obj) if obj is not None else None

    def layers(self) -> list[LayerMount]:
        return [LayerMount.from_json(v) for _, v in self._items("layers")]

    def ref_if_mounted(self, blob: str) -> bool:
        """One more reference on a layer whose mount is made (status `mounted`); False (nothing
        changed) for any other layer. The warm mount's path: the record stays a dict."""
        obj = self._get("layers", blob)
        if obj is None or obj.get("status") != MOUNTED:
            return False
        obj["refs"] = int(obj.get("refs", 0)) + 1
        self._put("layers", blob, obj)
        return True

    def put_layer(self, lm: LayerMount) -> None:
        self._put("layers", lm.blob, lm.to_json())

    def delete_layer(self, blob: str) -> None:
        self._delete("layers", blob)

    # -- node ------------------------------------------------------------------------
    def daemon(self) -> DaemonRecord | None:
        obj = self._get("meta", "daemon")
        return DaemonRecord.from_json(obj) if obj is not None else None

    def put_daemon(self, rec: DaemonRecord | None) -> None:
        if rec is None:
            if self._get("meta", "daemon") is not None:
                self._delete("meta", "daemon")
        else:
            self._put("meta", "daemon", rec.to_json())

    def hinted(self, blob: str) -> set[int]:
        """Chunks of `blob` whose prefetch hints were sent to the daemon of this node."""
        obj = self._get("meta", f"hints/{blob}")
        return set(obj["chunks"]) if obj else set()

    def add_hinted(self, blob: str, chunks: list[int]) -> None:
        self._put("meta", f"hints/{blob}", {"chunks": sorted(self.hinted(blob).union(chunks))})

    def roots_mounted(self) -> bool:
        """Did the shim make the NODE/roots bind mount (and not remove it since)? See
        `SandboxLifecycle.ensure_roots`: recorded under the node lock with the mount, dropped with it."""
        return self._txn.get(b"roots", db=self._dbs["meta"]) is not None

    def put_roots_mounted(self, mounted: bool) -> None:
        if mounted:
            self._put("meta", "roots", {"mounted": True})
        elif self.roots_mounted():
            self._delete("meta", "roots")

    def boot(self) -> str | None:
        obj = self._get("meta", "boot")
        return str(obj["boot_id"]) if obj else None

    def put_boot(self, boot: str) -> None:
        self._put("meta", "boot", {"boot_id": boot})

    def clear(self) -> None:
        """Forget everything (the machine restarted: the picture is rebuilt from the records)."""
        for name in DBS:
            self._txn.drop(self._dbs[name], delete=False)


class _Transaction:
    """`with` block of one LMDB transaction (a class: a warm mount opens two, and a generator-based
    context manager costs a few microseconds more each)."""

    __slots__ = ("_env", "_dbs", "_write", "_txn")

    def __init__(self, env: lmdb.Environment, dbs: dict[str, Any], *, write: bool) -> None:
        self._env, self._dbs, self._write = env, dbs, write

    def __enter__(self) -> Txn:
        self._txn = self._env.begin(write=self._write)
        return Txn(self._txn, self._dbs)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self._write:
            self._txn.commit()
        else:
            self._txn.abort()


class NodeState:
    """The LMDB environment under NODE/state. Use `read()` and `write()` transactions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._env = _open_env(path)
        except (lmdb.CorruptedError, lmdb.InvalidError):
            # Unreadable (a power loss without fsync can leave that): the records rebuild it.
            os.rename(path, path.with_name(f"{path.name}.damaged-{int(time.time())}"))
            self._env = _open_env(path)
        try:
            self._dbs = {name: self._env.open_db(name.encode()) for name in DBS}
        except BaseException:
            _close_env(self._env)
            raise

    def close(self) -> None:
        if self._env is not None:
            _close_env(self._env)
            self._env = None  # type: ignore[assignment]

    def __enter__(self) -> NodeState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> _Transaction:
        return _Transaction(self._env, self._dbs, write=False)

    def write(self) -> _Transaction:
        """One atomic change: committed when the block ends normally, aborted if it raises."""
        return _Transaction(self._env, self._dbs, write=True)

    def reset(self) -> None:
        """Forget the whole picture (it belongs to an earlier boot). When the database cannot even
        be written (damaged by a power loss: without fsync LMDB relies on write ordering), its
        files are moved aside to state.damaged-<time> and a new one is started."""
        try:
            with self.write() as t:
                t.clear()
            return
        except lmdb.Error:
            pass
        _close_env(self._env)
        if os.path.realpath(self.path) in _envs:  # other users in this process: they keep the old one
            raise CorruptObject(f"node state {self.path} is damaged and in use; restart the shim")
        aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
        os.rename(self.path, aside)
        self._env = _open_env(self.path)
        self._dbs = {name: self._env.open_db(name.encode()) for name in DBS}

    def sync(self) -> None:
        """Flush committed transactions to disk (not needed for correctness; see the module docstring)."""
        self._env.sync(True)

    def size(self) -> dict[str, int]:
        """Bytes: `used` = pages holding records now (every table), `file` = data.mdb's blocks on disk."""
        psize = int(self._env.stat()["psize"])
        pages = 0
        with self._env.begin() as txn:
            for db in [None, *self._dbs.values()]:
                st = txn.stat(db) if db is not None else self._env.stat()
                pages += int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
        data = self.path / "data.mdb"
        on_disk = os.stat(data).st_blocks * 512 if data.exists() else 0
        return {"used": pages * psize, "file": on_disk}
