"""GET, HEAD, PUT and DELETE of one object (`/v1/objects/{key}`).

`answer_get` and `answer_head` are also what `ObjectFastPath` (fastpath.py) calls for the GETs
and HEADs it answers before FastAPI's routing: one piece of code for both paths."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from layerstore.backends import http_wire as wire
from layerstore.errors import BadInput, CorruptObject, NotFound, PermissionDenied

from ..auth import Principal
from ..checks import check_body, check_key, decode_cost, limit_for
from ..deps import Service, Svc, Who
from ..edge import error_response
from .common import on_object, read_body, readable, run

RANGE_PATTERN = r"^bytes=[0-9]{0,19}-[0-9]{0,19}$"  # one range; anything else is a 400
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
OCTETS = "application/octet-stream"
OBJECT = wire.OBJECTS + "{key:path}"

router = APIRouter()


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(offset, length) of a single `bytes=` range of an object of `size` bytes; None when it
    starts at or after the end (416). `BadInput` for anything else than one range."""
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise BadInput(f"unsupported Range header {header[:100]!r} (want one bytes=A-B range)")
    first, last = m.group(1), m.group(2)
    if len(first) > 19 or len(last) > 19:
        raise BadInput("Range out of bounds")
    if not first:  # the last N bytes
        n = int(last)
        return (max(size - n, 0), min(n, size)) if n and size else None
    start = int(first)
    if last and int(last) < start:
        raise BadInput(f"Range {header[:100]!r} ends before it starts")
    if start >= size:
        return None
    end = int(last) if last else size - 1
    return start, min(end, size - 1) - start + 1


def object_headers(key: str, etag: str | None) -> dict[str, str]:
    content = wire.kind_of(key) in wire.CONTENT_KINDS
    headers = {"Accept-Ranges": "bytes", "Cache-Control": wire.IMMUTABLE if content else wire.MUTABLE}
    if etag is not None:
        headers["ETag"] = wire.quote(etag)
    return headers


async def answer_get(svc: Service, who: Principal, key: str, byte_range: str | None,
                     if_none_match: str | None) -> Response:
    """GET of an object: its bytes, one range of them, or 304. One backend call (in a worker
    thread) for a plain GET; content-addressed objects are not re-validated."""
    if byte_range is not None:
        parse_range(byte_range, 1)  # its syntax first (400), as the route's header validation
    check_key(key)
    readable(who, key)
    limit = limit_for(key)
    content = wire.kind_of(key) in wire.CONTENT_KINDS
    backend, cached = svc.backend, svc.cached
    if (content and if_none_match and wire.etag_of(key, b"") in wire.etags_in(if_none_match)
            and await run(backend.exists, key)):
        return Response(status_code=304, headers=object_headers(key, wire.etag_of(key, b"")))
    if content and cached is not None:  # the page cache first, in the loop (cached_reads.py)
        span = None if byte_range is None else (lambda size: parse_range(byte_range, size))
        hit = cached.read(key, limit, span)
        if hit is not None:
            return content_answer(key, byte_range, *hit)
    if byte_range is None:
        data = await on_object(svc, key, lambda: backend.load(key, max_size=limit))
        etag = wire.etag_of(key, data)
        if if_none_match and etag in wire.etags_in(if_none_match):
            return Response(status_code=304, headers=object_headers(key, etag))
        return Response(data, media_type=OCTETS, headers=object_headers(key, etag))
    size, offset, data = await on_object(svc, key, load_range, svc, key, byte_range, limit)  # one thread hop
    return content_answer(key, byte_range, size, offset, data) if content else range_answer(
        key, size, offset, data, None)


def content_answer(key: str, byte_range: str | None, size: int, offset: int,
                   data: bytes | memoryview | None) -> Response:
    if byte_range is None:
        return Response(data, media_type=OCTETS, headers=object_headers(key, wire.etag_of(key, b"")))
    return range_answer(key, size, offset, data, wire.etag_of(key, b""))


def range_answer(key: str, size: int, offset: int, data: bytes | memoryview | None, etag: str | None) -> Response:
    if data is None:
        resp = error_response(wire.RangeNotSatisfiable(f"object {key}: range starts at or past its end ({size})"))
        resp.headers["Content-Range"] = f"bytes */{size}"
        return resp
    headers = object_headers(key, etag)
    headers["Content-Range"] = f"bytes {offset}-{offset + len(data) - 1}/{size}"
    return Response(data, status_code=206, media_type=OCTETS, headers=headers)


def load_range(svc: Service, key: str, byte_range: str, limit: int) -> tuple[int, int, bytes | None]:
    """(the object's size, the range's offset, its bytes or None past the end)."""
    size = svc.backend.size(key)
    if size > limit:
        raise CorruptObject(f"object {key}: {size} bytes, more than such an object can have ({limit})")
    span = parse_range(byte_range, size)
    if span is None:
        return size, 0, None
    offset, length = span
    return size, offset, svc.backend.load(key, offset, length, max_size=limit)


async def answer_head(svc: Service, who: Principal, key: str) -> Response:
    """HEAD of an object: its length (Content-Length) and ETag."""
    check_key(key)
    readable(who, key)
    backend = svc.backend
    if wire.kind_of(key) in wire.CONTENT_KINDS:
        size = await on_object(svc, key, backend.size, key)
        etag = wire.etag_of(key, b"")
    else:
        data = await on_object(svc, key, lambda: backend.load(key, max_size=limit_for(key)))
        size, etag = len(data), wire.etag_of(key, data)
    headers = object_headers(key, etag)
    headers["Content-Length"] = str(size)
    return Response(status_code=200, headers=headers, media_type=OCTETS)


def precondition_failed(key: str) -> JSONResponse:
    return error_response(wire.PreconditionFailed(f"{key}: the condition of the write does not hold"))


@router.get(OBJECT, response_class=Response,
            responses={200: {"content": {OCTETS: {}}}, 206: {"content": {OCTETS: {}}}, 304: {}, 416: {}})
async def get_object(key: str, who: Who, svc: Svc,
                     byte_range: Annotated[str | None, Header(alias="range", pattern=RANGE_PATTERN)] = None,
                     if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """An object's bytes, or one range of them. (Served by `ObjectFastPath` before FastAPI's
    routing; this route documents it and answers when the fast path steps aside.)"""
    return await answer_get(svc, who, key, byte_range, if_none_match)


@router.head(OBJECT, response_class=Response)
async def head_object(key: str, who: Who, svc: Svc) -> Response:
    """An object's length (Content-Length) and ETag, without its bytes."""
    return await answer_head(svc, who, key)


@router.put(OBJECT, status_code=201, responses={200: {}, 201: {}, 412: {}},
            openapi_extra={"requestBody": {"required": True, "content": {OCTETS: {"schema": {
                "type": "string", "format": "binary"}}}}})
async def put_object(key: str, request: Request, who: Who, svc: Svc,
                     if_match: Annotated[str | None, Header()] = None,
                     if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """Store an object. `If-None-Match: *`: only if the key is free (412 otherwise);
    `If-Match: "<etag>"`: only if the object still has that ETag (compare-and-swap)."""
    check_key(key)
    backend = svc.backend
    if not who.may_write(key):
        if (if_none_match is not None and if_none_match.strip() == "*" and who.may_read(key)
                and await run(backend.exists, key)):
            return precondition_failed(key)  # create-once of what exists: no write needed (store init)
        raise PermissionDenied(f"token {who.id} may not write {key}")
    if if_match is not None and if_none_match is not None:
        raise BadInput("If-Match and If-None-Match exclude each other")
    if if_none_match is not None and if_none_match.strip() != "*":
        raise BadInput("a PUT takes If-None-Match: * only")
    data = await read_body(svc, request, limit_for(key), key)
    async with svc.budget.hold(decode_cost(key, data)):
        await run(check_body, svc.store, key, data)
    if wire.kind_of(key) == "leases" and not who.gc:
        created, data = await run(lambda: svc.lease_guard.put(
            who, key, data, if_match=None if if_match is None else wire.etags_in(if_match),
            create_only=if_none_match is not None))
        return Response(status_code=201 if created else 200, headers={"ETag": wire.quote(wire.etag_of(key, data))})
    etag = {"ETag": wire.quote(wire.etag_of(key, data))}
    if wire.kind_of(key) in wire.CONTENT_KINDS or if_none_match is not None:
        if await on_object(svc, key, backend.store_once, key, data, writing=True):
            return Response(status_code=201, headers=etag)
        if if_none_match is not None:
            return precondition_failed(key)
        return Response(status_code=200, headers=etag)
    if if_match is not None:
        wanted = wire.etags_in(if_match)
        try:
            current = await on_object(svc, key, lambda: backend.load(key, max_size=limit_for(key)), writing=True)
        except NotFound:
            return precondition_failed(key)
        if "*" not in wanted and wire.etag_of(key, current) not in wanted:
            return precondition_failed(key)
        if not await on_object(svc, key, backend.replace_if, key, data, current, writing=True):
            return precondition_failed(key)
        return Response(status_code=200, headers=etag)
    await on_object(svc, key, backend.replace, key, data, writing=True)
    return Response(status_code=200, headers=etag)


@router.delete(OBJECT, status_code=204, response_class=Response)
async def delete_object(key: str, who: Who, svc: Svc) -> Response:
    """Remove an object (404 if it is not there)."""
    check_key(key)
    if not who.may_delete(key):
        readable(who, key)
        raise PermissionDenied(f"token {who.id} may not delete {key}")
    if wire.kind_of(key) == "leases" and not who.gc:
        await run(svc.lease_guard.check_delete, who, key)
    await on_object(svc, key, svc.backend.delete, key)
    return Response(status_code=204)
