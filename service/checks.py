"""What a PUT body must be before the service hands it to the backend, per key kind (the table in
docs/service.md). Called in a worker thread: decoding a chunk hashes and decompresses it."""

from __future__ import annotations

import json

from layerstore import chunkmap, chunkobj, keys, leases
from layerstore import digest as digestmod
from layerstore.backends import http_wire as wire
from layerstore.errors import BadKey, CorruptObject, LayerstoreError, NotFound
from layerstore.store import MAX_CONFIG_SIZE, MAX_MANIFEST_BYTES, MAX_OBJECT_SIZE, MAX_TAG_SIZE, Store

MAX_LEASE = max(leases.MAX_HEAD, leases.MAX_SHARD)
MAX_GC = max(leases.MAX_CANDIDATES, leases.MAX_RUN)
MAX_RAW = 256 << 20  # admin's raw objects (the service holds a body in memory while it checks it)
LIMITS = {**MAX_OBJECT_SIZE, "tags": MAX_TAG_SIZE, "leases": MAX_LEASE, "gc": MAX_GC, "config": MAX_CONFIG_SIZE,
          "other": MAX_RAW}


LAYOUT = {*keys.KINDS, *wire.MUTABLE_KINDS}  # the store's top-level prefixes


def limit_for(key: str) -> int:
    """The largest body a PUT of `key` may carry (and the largest object a GET of it reads)."""
    return LIMITS[wire.kind_of(key)]


def check_key(key: str) -> str:
    """`key` if it is in the store's grammar and, for a kind with a grammar of its own (object
    keys with their fan-out, tag keys), in that one too; `BadKey` otherwise."""
    keys.validate(key)
    kind = wire.kind_of(key)
    if kind in wire.CONTENT_KINDS:
        keys.digest_of_key(key)
    elif kind == "tags" and wire.tag_name(key) is None:
        raise BadKey(f"not a tag key (tags/NAME:TAG): {key!r}")
    elif kind == "leases" and key.count("/") != 2:
        raise BadKey(f"not a lease key (leases/ID/NAME, docs/gc.md): {key!r}")
    elif kind == "other" and key.split("/", 1)[0] in LAYOUT:
        raise BadKey(f"{key!r} is a name of the store's layout, not an object")
    return key


def head_size(key: str) -> int:
    """How many first bytes of a PUT body `body_limit` wants (0: none)."""
    return chunkmap.HEADER_SIZE if wire.kind_of(key) == "blobs" else 0


def body_limit(key: str, head: bytes | bytearray) -> int:
    """The exact length a chunk map's body has, from its first `head_size` bytes; `RejectedObject`
    if its header is over the bound (`chunkmap.check_head`): refused before the rest is read."""
    try:
        count, _size = chunkmap.check_head(head, keys.digest_of_key(key)[1])
    except CorruptObject as e:
        raise wire.RejectedObject(f"{key}: {e}") from None
    return chunkmap.encoded_size(count)


def decode_cost(key: str, data: bytes) -> int:
    """The memory `check_body` takes beyond the body: a chunk's or a manifest's payload (its
    header's length), or a chunk map's decoded entries."""
    kind = wire.kind_of(key)
    if kind in ("chunks", "manifests") and len(data) >= chunkobj.HEADER_SIZE:
        return int(chunkobj.HEADER.unpack_from(data)[4])
    if kind == "blobs" and len(data) >= chunkmap.HEADER_SIZE:
        return int.from_bytes(data[8:12], "little") * chunkmap.DECODED_ENTRY
    return 0


def check_body(store: Store, key: str, data: bytes) -> None:
    """Raise unless `data` may become `key`: `RejectedObject` for a body that is not what its key
    says, `NotFound` for a chunk map or tag that points at something the store does not have."""
    kind = wire.kind_of(key)
    try:
        if kind == "chunks":
            chunkobj.decode(data, keys.digest_of_key(key)[1])
        elif kind == "manifests":
            chunkobj.decode(data, keys.digest_of_key(key)[1], MAX_MANIFEST_BYTES)
        elif kind == "blobs":
            cm = chunkmap.ChunkMap.decode(data, keys.digest_of_key(key)[1])
            missing = [d for d in cm.unique_digests() if not store.has_chunk(d)]
            if missing:
                raise NotFound(f"blob {cm.blob}: {len(missing)} chunk(s) missing, e.g. {missing[0]}")
        elif kind == "tags":
            if wire.tag_name(key) is None:
                raise wire.RejectedObject(f"{key}: not a tag key (tags/NAME:TAG)")
            manifest = _tag_value(data, key)
            if not store.backend.exists(keys.object_key("manifests", manifest)):
                raise NotFound(f"manifest {manifest} is not in the store")
        elif kind == "config":
            conf = json.loads(data)
            if not isinstance(conf, dict) or conf.get("format") != "layerstore":
                raise wire.RejectedObject("config: not a layerstore store config")
    except wire.RejectedObject:
        raise
    except CorruptObject as e:
        raise wire.RejectedObject(f"{key}: {e}") from None
    except ValueError:
        raise wire.RejectedObject(f"{key}: not JSON") from None


def _tag_value(data: bytes, key: str) -> str:
    try:
        return digestmod.parse(data.decode("ascii").strip())
    except (UnicodeDecodeError, LayerstoreError):
        raise wire.RejectedObject(f"{key}: a tag holds a manifest digest (b3:...)") from None
