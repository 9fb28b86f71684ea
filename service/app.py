"""The store service: the store's whole surface over HTTP, as a FastAPI app (docs/service.md).

The app holds a `Store` (the backend behind it) and a `TokenTable`, nothing else: every answer is
the backend's, so any number of instances and workers serve one store. Backend calls are blocking
and run in worker threads; a request body is read whole (bounded by its key's kind, within a
deadline) and checked (`checks.check_body`) before the backend sees it.

Errors leave in one place (`error_response`): a `LayerstoreError` as its class's status with
`to_wire()`, FastAPI's and Starlette's own refusals as the family's classes, anything else as a
500 with a JSON body (and a log line)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerstore.backends import http_wire as wire
from layerstore.errors import (
    BadInput,
    BadKey,
    CorruptObject,
    LayerstoreError,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
)
from layerstore.keys import validate_prefix
from layerstore.store import Store

from . import signin
from .auth import Principal, TokenTable
from .batch import BatchResponse
from .budget import ByteBudget, budget_from_env
from .cached_reads import CachedReader
from .checks import body_limit, check_body, check_key, decode_cost, head_size, limit_for
from .fastpath import ObjectFastPath
from .inflight import DEFAULT_MAX_INFLIGHT, MAX_INFLIGHT_ENV, InflightLimit
from .leaseowner import LeaseGuard
from .metrics import MetricsMiddleware, exposition

log = logging.getLogger("layerstore.service")

STORE_ENV = "LAYERSTORE_SERVE_STORE"
TOKENS_ENV = "LAYERSTORE_SERVE_TOKENS"
BODY_TIMEOUT_ENV = "LAYERSTORE_SERVE_BODY_TIMEOUT"
DEFAULT_BODY_TIMEOUT = 120.0
MAX_DELETE_BODY = 1 << 20
MAX_DELETE_KEYS = 10_000
LIST_BATCH = 512
RANGE_PATTERN = r"^bytes=[0-9]{0,19}-[0-9]{0,19}$"  # one range; anything else is a 400
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
OCTETS = "application/octet-stream"

bearer = HTTPBearer(auto_error=False, description="A token of `layerctl serve token add`")


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


async def principal(request: Request,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """Who is asking: the bearer token looked up in the app's token table (the status page's
    cookie counts on the status page only: `signin.reader`)."""
    return request.app.state.tokens.authenticate(request.headers.get("authorization"))


Who = Annotated[Principal, Depends(principal)]


def error_response(e: LayerstoreError) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="layerstore"'} if e.http_status == 401 else None
    return JSONResponse(e.to_wire(), status_code=e.http_status, headers=headers)


def create_app(store: Store, tokens: TokenTable, *, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               max_inflight: int = DEFAULT_MAX_INFLIGHT) -> FastAPI:
    app = FastAPI(title="layerstore store service", version="1",
                  description="The content-addressed store over HTTP: see docs/service.md.")
    app.state.tokens = tokens
    backend = store.backend
    cached = CachedReader.for_backend(backend)
    lease_guard = LeaseGuard(backend)  # leases belong to their writer's token (leaseowner.py)
    budget = app.state.decode_budget = ByteBudget(budget_from_env())  # checking bodies (budget.py)

    # -- the error edge --------------------------------------------------------------------
    @app.exception_handler(LayerstoreError)
    async def on_error(_request: Request, e: LayerstoreError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(BadInput(f"bad request: {str(e.errors())[:300]}"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        err: LayerstoreError = NotFound("no such route") if e.status_code == 404 else BadInput(str(e.detail))
        resp = error_response(err)
        resp.status_code = e.status_code if e.status_code >= 400 else 400
        return resp

    @app.exception_handler(Exception)
    async def on_bug(_request: Request, e: Exception) -> JSONResponse:
        return edge_error(e)

    def readable(who: Principal, key: str) -> None:
        if who.may_read(key):
            return
        if key.startswith("tags/") and who.can_read:
            raise NotFound(f"object {key}: not found")  # a private name is not revealed
        raise PermissionDenied(f"token {who.id} may not read {key}")

    async def run(fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args)

    def is_prefix(key: str) -> bool:
        return next(iter(backend.list(key + "/")), None) is not None

    async def on_object(key: str, fn: Any, *args: Any, writing: bool = False) -> Any:
        """A backend call on one object. A key that names a prefix of other keys (a directory
        on POSIX) is no object: NotFound to read or delete it, BadKey to write it, not the
        backend's CorruptObject (502) or failure (503)."""
        try:
            return await run(fn, *args)
        except (CorruptObject, StoreUnavailable, PermissionDenied) as e:
            if not await run(is_prefix, key):
                raise
            if writing:
                raise BadKey(f"{key}: a prefix of other keys, not an object") from None
            raise NotFound(f"object {key}: not found (a prefix of other keys)") from e

    async def read_body(request: Request, limit: int, key: str = "") -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit() or len(length) > 19:
                raise BadInput(f"bad Content-Length {length[:40]!r}")
            if int(length) > limit:
                raise wire.TooLarge(f"body of {length} bytes, more than {limit} for this key")
        buf = bytearray()
        head = head_size(key) if key else 0  # a chunk map: its header bounds the rest (before it is read)
        try:
            with anyio.fail_after(body_timeout):
                async for part in request.stream():
                    buf += part
                    if head and len(buf) >= head:
                        limit, head = min(limit, body_limit(key, buf[:head])), 0
                    if len(buf) > limit:
                        raise wire.TooLarge(f"body of more than {limit} bytes for this key")
        except TimeoutError:
            raise wire.SlowRequest(f"request body not received within {body_timeout:g} s") from None
        return bytes(buf)

    def object_headers(key: str, etag: str | None) -> dict[str, str]:
        content = wire.kind_of(key) in wire.CONTENT_KINDS
        headers = {"Accept-Ranges": "bytes", "Cache-Control": wire.IMMUTABLE if content else wire.MUTABLE}
        if etag is not None:
            headers["ETag"] = wire.quote(etag)
        return headers

    # -- objects -----------------------------------------------------------------------------
    async def answer_get(who: Principal, key: str, byte_range: str | None, if_none_match: str | None) -> Response:
        """GET of an object: its bytes, one range of them, or 304. One backend call (in a worker
        thread) for a plain GET; content-addressed objects are not re-validated."""
        if byte_range is not None:
            parse_range(byte_range, 1)  # its syntax first (400), as the route's header validation
        check_key(key)
        readable(who, key)
        limit = limit_for(key)
        content = wire.kind_of(key) in wire.CONTENT_KINDS
        if (content and if_none_match and wire.etag_of(key, b"") in wire.etags_in(if_none_match)
                and await run(backend.exists, key)):
            return Response(status_code=304, headers=object_headers(key, wire.etag_of(key, b"")))
        if content and cached is not None:  # the page cache first, in the loop (cached_reads.py)
            span = None if byte_range is None else (lambda size: parse_range(byte_range, size))
            hit = cached.read(key, limit, span)
            if hit is not None:
                return content_answer(key, byte_range, *hit)
        if byte_range is None:
            data = await on_object(key, lambda: backend.load(key, max_size=limit))
            etag = wire.etag_of(key, data)
            if if_none_match and etag in wire.etags_in(if_none_match):
                return Response(status_code=304, headers=object_headers(key, etag))
            return Response(data, media_type=OCTETS, headers=object_headers(key, etag))
        size, offset, data = await on_object(key, load_range, key, byte_range, limit)  # one thread hop
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

    def load_range(key: str, byte_range: str, limit: int) -> tuple[int, int, bytes | None]:
        """(the object's size, the range's offset, its bytes or None past the end)."""
        size = backend.size(key)
        if size > limit:
            raise CorruptObject(f"object {key}: {size} bytes, more than such an object can have ({limit})")
        span = parse_range(byte_range, size)
        if span is None:
            return size, 0, None
        offset, length = span
        return size, offset, backend.load(key, offset, length, max_size=limit)

    async def answer_head(who: Principal, key: str) -> Response:
        """HEAD of an object: its length (Content-Length) and ETag."""
        check_key(key)
        readable(who, key)
        if wire.kind_of(key) in wire.CONTENT_KINDS:
            size = await on_object(key, backend.size, key)
            etag = wire.etag_of(key, b"")
        else:
            data = await on_object(key, lambda: backend.load(key, max_size=limit_for(key)))
            size, etag = len(data), wire.etag_of(key, data)
        headers = object_headers(key, etag)
        headers["Content-Length"] = str(size)
        return Response(status_code=200, headers=headers, media_type=OCTETS)

    @app.get(wire.OBJECTS + "{key:path}", response_class=Response,
             responses={200: {"content": {OCTETS: {}}}, 206: {"content": {OCTETS: {}}}, 304: {}, 416: {}})
    async def get_object(key: str, who: Who,
                         byte_range: Annotated[str | None, Header(alias="range", pattern=RANGE_PATTERN)] = None,
                         if_none_match: Annotated[str | None, Header()] = None) -> Response:
        """An object's bytes, or one range of them. (Served by `ObjectFastPath` before FastAPI's
        routing; this route documents it and answers when the fast path steps aside.)"""
        return await answer_get(who, key, byte_range, if_none_match)

    @app.head(wire.OBJECTS + "{key:path}", response_class=Response)
    async def head_object(key: str, who: Who) -> Response:
        """An object's length (Content-Length) and ETag, without its bytes."""
        return await answer_head(who, key)

    @app.put(wire.OBJECTS + "{key:path}", status_code=201, responses={200: {}, 201: {}, 412: {}},
             openapi_extra={"requestBody": {"required": True, "content": {OCTETS: {"schema": {
                 "type": "string", "format": "binary"}}}}})
    async def put_object(key: str, request: Request, who: Who,
                         if_match: Annotated[str | None, Header()] = None,
                         if_none_match: Annotated[str | None, Header()] = None) -> Response:
        """Store an object. `If-None-Match: *`: only if the key is free (412 otherwise);
        `If-Match: "<etag>"`: only if the object still has that ETag (compare-and-swap)."""
        check_key(key)
        if not who.may_write(key):
            if (if_none_match is not None and if_none_match.strip() == "*" and who.may_read(key)
                    and await run(backend.exists, key)):
                return precondition_failed(key)  # create-once of what exists: no write needed (store init)
            raise PermissionDenied(f"token {who.id} may not write {key}")
        if if_match is not None and if_none_match is not None:
            raise BadInput("If-Match and If-None-Match exclude each other")
        if if_none_match is not None and if_none_match.strip() != "*":
            raise BadInput("a PUT takes If-None-Match: * only")
        data = await read_body(request, limit_for(key), key)
        async with budget.hold(decode_cost(key, data)):
            await run(check_body, store, key, data)
        if wire.kind_of(key) == "leases" and not who.gc:
            created, data = await run(lambda: lease_guard.put(
                who, key, data, if_match=None if if_match is None else wire.etags_in(if_match),
                create_only=if_none_match is not None))
            return Response(status_code=201 if created else 200, headers={"ETag": wire.quote(wire.etag_of(key, data))})
        etag = {"ETag": wire.quote(wire.etag_of(key, data))}
        if wire.kind_of(key) in wire.CONTENT_KINDS or if_none_match is not None:
            if await on_object(key, backend.store_once, key, data, writing=True):
                return Response(status_code=201, headers=etag)
            if if_none_match is not None:
                return precondition_failed(key)
            return Response(status_code=200, headers=etag)
        if if_match is not None:
            wanted = wire.etags_in(if_match)
            try:
                current = await on_object(key, lambda: backend.load(key, max_size=limit_for(key)), writing=True)
            except NotFound:
                return precondition_failed(key)
            if "*" not in wanted and wire.etag_of(key, current) not in wanted:
                return precondition_failed(key)
            if not await on_object(key, backend.replace_if, key, data, current, writing=True):
                return precondition_failed(key)
            return Response(status_code=200, headers=etag)
        await on_object(key, backend.replace, key, data, writing=True)
        return Response(status_code=200, headers=etag)

    def precondition_failed(key: str) -> JSONResponse:
        return error_response(wire.PreconditionFailed(f"{key}: the condition of the write does not hold"))

    @app.delete(wire.OBJECTS + "{key:path}", status_code=204, response_class=Response)
    async def delete_object(key: str, who: Who) -> Response:
        """Remove an object (404 if it is not there)."""
        check_key(key)
        if not who.may_delete(key):
            readable(who, key)
            raise PermissionDenied(f"token {who.id} may not delete {key}")
        if wire.kind_of(key) == "leases" and not who.gc:
            await run(lease_guard.check_delete, who, key)
        await on_object(key, backend.delete, key)
        return Response(status_code=204)

    # -- listings and batches ------------------------------------------------------------------
    @app.get(wire.LIST, response_class=StreamingResponse, responses={200: {"content": {"application/x-ndjson": {}}}})
    async def list_objects(who: Who, prefix: Annotated[str, Query(max_length=1024)] = "",
                           info: Annotated[int, Query(ge=0, le=1)] = 0) -> StreamingResponse:
        """Every key under `prefix`, one JSON object a line: {"k": key} or, with info=1,
        {"k": key, "s": size, "m": mtime (seconds, the store's clock)}."""
        validate_prefix(prefix)
        refusal = who.list_refusal(prefix)
        if refusal is not None:
            raise PermissionDenied(refusal)
        source: Iterator[Any] = backend.list_info(prefix) if info else backend.list(prefix)

        def batch() -> bytes:
            out = []
            for item in source:
                key = item.key if info else item
                if not who.shows(key, prefix):
                    continue
                out.append(wire.list_line(key, item.size, item.mtime) if info else wire.list_line(key))
                if len(out) >= LIST_BATCH:
                    break
            return b"".join(out)

        first = await run(batch)  # the listing's errors before the answer starts have a status

        async def body() -> Any:
            part = first
            while part:
                yield part
                part = await run(batch)

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.post(wire.DELETE_MANY)
    async def delete_many(request: Request, who: Who) -> dict[str, int]:
        """Remove many objects: {"keys": [...]} -> {"removed": N}; missing keys are not errors."""
        raw = await read_body(request, MAX_DELETE_BODY)
        try:
            obj = json.loads(raw)
            keys = obj["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise BadInput('want {"keys": ["key", ...]}') from None
        if len(keys) > MAX_DELETE_KEYS:
            raise wire.TooLarge(f"at most {MAX_DELETE_KEYS} keys a request")
        for k in keys:
            check_key(k)
            if not who.may_delete(k):
                raise PermissionDenied(f"token {who.id} may not delete {k}")
        if not who.gc:
            keys = await run(lease_guard.deletable, who, keys)
        return {"removed": await run(backend.delete_many, keys)}

    @app.post(wire.BATCH, response_class=BatchResponse, status_code=200,
              responses={200: {"content": {wire.BATCH_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "type": "object", "required": ["keys"], "properties": {"keys": {
                      "type": "array", "maxItems": wire.MAX_BATCH_KEYS, "items": {"type": "string"}}}}}}}})
    async def batch_read(request: Request, who: Who) -> BatchResponse:
        """Read several content-addressed objects (chunks, chunk maps, manifests) in one request:
        {"keys": [...]} (at most 64, distinct) -> one frame per key, in order: a line
        "<status> <length> <key>" and that many bytes, the object or the error a GET of it would
        answer. The whole request is refused (4xx) before any item is read if a key is malformed,
        not content-addressed or repeated, or the token may not read."""
        raw = await read_body(request, wire.MAX_BATCH_BODY)
        try:
            keys = json.loads(raw)["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise BadInput('want {"keys": ["key", ...]}') from None
        if len(keys) > wire.MAX_BATCH_KEYS:
            raise wire.TooLarge(f"at most {wire.MAX_BATCH_KEYS} keys a batch")
        if len(set(keys)) != len(keys):
            raise BadInput("a batch names each key once")
        for k in keys:
            check_key(k)
            if wire.kind_of(k) not in wire.CONTENT_KINDS:
                raise BadKey(f"a batch reads content-addressed objects only (chunks, blobs, manifests), not {k!r}")
            readable(who, k)
        return BatchResponse(keys, batch_item, quick_item if cached is not None else None)

    def quick_item(key: str) -> tuple[int, bytes | memoryview] | None:
        """An item of a batch if the page cache of a local store holds it (read in the loop)."""
        hit = cached.read(key, limit_for(key)) if cached is not None else None
        return (200, hit[2]) if hit is not None and hit[2] is not None else None

    async def batch_item(key: str) -> tuple[int, bytes | memoryview]:
        """One item of a batch: the object, or the error answer a GET of it would get."""
        limit = limit_for(key)
        try:
            hit = quick_item(key)
            if hit is not None:
                return hit
            return 200, await on_object(key, lambda: backend.load(key, max_size=limit))
        except Exception as e:  # every failure is the item's answer
            err = edge_error(e)
            return err.status_code, bytes(err.body)

    # -- the store itself ----------------------------------------------------------------------
    @app.get(wire.STORE)
    async def check_store(who: Who) -> dict[str, str]:
        """Whether the store's location exists and is usable."""
        if not who.can_read:
            raise PermissionDenied(f"token {who.id} may not read")
        await run(backend.check)
        return {"status": "ok"}

    @app.post(wire.STORE)
    async def create_store(who: Who) -> dict[str, str]:
        """Create the store's location (directory, bucket) if needed (a store that exists is
        fine for any reader: `layerctl store init` is idempotent)."""
        if not who.admin:
            if not who.can_read:
                raise PermissionDenied(f"token {who.id} may not create the store")
            try:
                await run(backend.check)
            except NotFound:
                raise PermissionDenied(f"token {who.id} may not create the store") from None
            return {"status": "ok"}
        await run(backend.create)
        return {"status": "ok"}

    # -- operations ----------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Alive, and the store behind answers (503 if it does not)."""
        try:
            await run(backend.check)
        except LayerstoreError as e:
            raise StoreUnavailable(f"the store behind the service: {e}") from None
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        """Prometheus text format: requests, bytes and latency per route."""
        text, ctype = exposition()
        return Response(text, media_type=ctype)

    @app.get("/", response_class=Response, responses={200: {"content": {"text/html": {}}}})
    @app.get("/status", response_class=Response, responses={200: {"content": {"text/html": {}}}})
    async def status_page(request: Request) -> Response:
        """The status page: environments and tags, layers, deduplication, the last GC run. A
        browser without a token that may read gets the sign-in page (signin.py)."""
        try:
            who = signin.reader(request)
        except PermissionDenied as e:
            page = signin.refusal(request, e)
            if page is None:
                raise
            return page
        render = status_renderer()
        if render is None:
            raise NotFound("this service has no status page")
        html = await run(lambda: render(store, visible=who.lists))
        return Response(html, media_type="text/html; charset=utf-8")

    signin.install(app)
    routes = {m: r for r in app.routes if getattr(r, "path", None) == wire.OBJECTS + "{key:path}"
              for m in getattr(r, "methods", ()) if m in ("GET", "HEAD")}
    app.add_middleware(ObjectFastPath, prefix=wire.OBJECTS, who=lambda request: principal(request, None),
                       get=answer_get, head=answer_head, on_error=edge_error, routes=routes)
    app.add_middleware(InflightLimit, limit=max_inflight, cookie=signin.COOKIE)  # per token (inflight.py)
    app.add_middleware(MetricsMiddleware)  # outermost: it counts the fast path's answers too
    return app


def edge_error(e: BaseException) -> JSONResponse:
    """The answer to an exception that reached the edge: a `LayerstoreError` as its status, any
    other as a 500 with a JSON body (and a log line)."""
    if isinstance(e, LayerstoreError):
        return error_response(e)
    log.exception("unexpected failure", exc_info=e)
    return error_response(LayerstoreError(f"internal error: {type(e).__name__}"))


def status_renderer() -> Any:
    try:
        from . import status  # type: ignore[attr-defined]
    except ImportError:
        return None
    return getattr(status, "render_status", None)


def app_from_env() -> FastAPI:
    """The app of one uvicorn worker, configured by `layerctl serve` through the environment."""
    url = os.environ[STORE_ENV]
    tokens = os.environ.get(TOKENS_ENV) or None
    timeout = float(os.environ.get(BODY_TIMEOUT_ENV) or DEFAULT_BODY_TIMEOUT)
    inflight = int(os.environ.get(MAX_INFLIGHT_ENV) or DEFAULT_MAX_INFLIGHT)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(Store.open(url), TokenTable(Path(tokens) if tokens else None), body_timeout=timeout,
                      max_inflight=inflight)
