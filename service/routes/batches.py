"""Requests about many objects at once: deleting them (`POST /v1/delete`) and reading
content-addressed ones (`POST /v1/batch`, the answer's framing in batch.py)."""

from __future__ import annotations

import json
from functools import partial

from fastapi import APIRouter, Request

from layerstore.backends import http_wire as wire
from layerstore.errors import BadInput, BadKey, PermissionDenied

from ..batch import BatchResponse
from ..checks import check_key, limit_for
from ..deps import Service, Svc, Who
from ..edge import edge_error
from .common import on_object, read_body, readable, run

MAX_DELETE_BODY = 1 << 20
MAX_DELETE_KEYS = 10_000

router = APIRouter()


def keys_of(raw: bytes) -> list[str]:
    """The keys of a body {"keys": ["key", ...]}."""
    try:
        keys = json.loads(raw)["keys"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise BadInput('want {"keys": ["key", ...]}') from None
    return keys


@router.post(wire.DELETE_MANY)
async def delete_many(request: Request, who: Who, svc: Svc) -> dict[str, int]:
    """Remove many objects: {"keys": [...]} -> {"removed": N}; missing keys are not errors."""
    keys = keys_of(await read_body(svc, request, MAX_DELETE_BODY))
    if len(keys) > MAX_DELETE_KEYS:
        raise wire.TooLarge(f"at most {MAX_DELETE_KEYS} keys a request")
    for k in keys:
        check_key(k)
        if not who.may_delete(k):
            raise PermissionDenied(f"token {who.id} may not delete {k}")
    if not who.gc:
        keys = await run(svc.lease_guard.deletable, who, keys)
    return {"removed": await run(svc.backend.delete_many, keys)}


@router.post(wire.BATCH, response_class=BatchResponse, status_code=200,
             responses={200: {"content": {wire.BATCH_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                 "type": "object", "required": ["keys"], "properties": {"keys": {
                     "type": "array", "maxItems": wire.MAX_BATCH_KEYS, "items": {"type": "string"}}}}}}}})
async def batch_read(request: Request, who: Who, svc: Svc) -> BatchResponse:
    """Read several content-addressed objects (chunks, chunk maps, manifests) in one request:
    {"keys": [...]} (at most 64, distinct) -> one frame per key, in order: a line
    "<status> <length> <key>" and that many bytes, the object or the error a GET of it would
    answer. The whole request is refused (4xx) before any item is read if a key is malformed,
    not content-addressed or repeated, or the token may not read."""
    keys = keys_of(await read_body(svc, request, wire.MAX_BATCH_BODY))
    if len(keys) > wire.MAX_BATCH_KEYS:
        raise wire.TooLarge(f"at most {wire.MAX_BATCH_KEYS} keys a batch")
    if len(set(keys)) != len(keys):
        raise BadInput("a batch names each key once")
    for k in keys:
        check_key(k)
        if wire.kind_of(k) not in wire.CONTENT_KINDS:
            raise BadKey(f"a batch reads content-addressed objects only (chunks, blobs, manifests), not {k!r}")
        readable(who, k)
    return BatchResponse(keys, partial(batch_item, svc), partial(quick_item, svc) if svc.cached is not None else None)


def quick_item(svc: Service, key: str) -> tuple[int, bytes | memoryview] | None:
    """An item of a batch if the page cache of a local store holds it (read in the loop)."""
    hit = svc.cached.read(key, limit_for(key)) if svc.cached is not None else None
    return (200, hit[2]) if hit is not None and hit[2] is not None else None


async def batch_item(svc: Service, key: str) -> tuple[int, bytes | memoryview]:
    """One item of a batch: the object, or the error answer a GET of it would get."""
    limit = limit_for(key)
    try:
        hit = quick_item(svc, key)
        if hit is not None:
            return hit
        return 200, await on_object(svc, key, lambda: svc.backend.load(key, max_size=limit))
    except Exception as e:  # every failure is the item's answer
        err = edge_error(e)
        return err.status_code, bytes(err.body)
