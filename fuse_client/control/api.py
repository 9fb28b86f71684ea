"""The daemon's control API: a FastAPI app whose routes call the node cache's API
(`fuse_client.nodecache.LazyCache`) and nothing else. It knows no socket: `control.server` serves
it on the daemon's Unix socket, inside the daemon's trio loop, through hypercorn.

    GET  /stats          the JSON of `layerctl stats`
    GET  /metrics        Prometheus text format (counters, gauges, fetch latency histograms)
    GET  /cache          the JSON of `layerctl cache ls`
    POST /cache/verify   re-hash committed chunks, drop bad ones
    POST /cache/evict    {"blob": D} | {"all": true} | {"to_bytes": N} | {} (down to the low watermark)
    POST /cache/gc       {"older_than": SECONDS, "dry_run": bool}: forget unused blobs (docs/gc.md, the node side)
    POST /prefetch       {"blob": D, "chunks": [i...] | "ranges": [[off, len]...] | "all": true, "wait": bool}
    POST /pin            {"blob": D, "holder": H} -> {"blob", "complete": true, "path"} | 409 BlobIncomplete
    POST /unpin          {"blob": D, "holder": H} -> {"blob", "holder", "removed": bool} (idempotent)
    POST /attach         {"blob": D, "holder": H} -> {"path", "generation", "data_path"}: the blob's data
                         file made ready for a direct EROFS mount, filled on fanotify events
                         (docs/fanotify.md); 409 `DataPathUnavailable` when the daemon serves FUSE only
    POST /detach         {"blob": D, "holder": H} -> {"removed": bool} (idempotent)
    GET  /openapi.json   the OpenAPI document of the above

A request body is a JSON object whatever its Content-Type says (so `curl -d` works), at most
`MAX_BODY` bytes; an empty body is `{}`. It is checked against the route's model. Every failure
answers JSON: a project error with the status of its class and `LayerstoreError.to_wire()` (the
blocking client raises the same class again), a malformed body as `BadInput` (400), an unknown
route 404/405 `{"error": "no route ..."}`, anything unexpected 500 (logged).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fuse_client.nodecache import LazyCache, check_holder
from layerstore import digest as digestmod
from layerstore.errors import BadInput, LayerstoreError

from .errors import DataPathUnavailable

log = logging.getLogger("layerstore.fuse.control")

MAX_BODY = 16 << 20
BODY_DEADLINE = 30.0  # seconds for a request's body to arrive once its head has
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


# -- request bodies -------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class EvictRequest(_Body):
    blob: str | None = None
    all_chunks: bool = Field(False, alias="all")
    to_bytes: int | None = None


class GcRequest(_Body):
    older_than: float = Field(ge=0, allow_inf_nan=False)
    dry_run: bool = False


class PrefetchRequest(_Body):
    blob: str
    chunks: list[StrictInt] | None = None
    ranges: list[list[StrictInt]] | None = None
    all_chunks: bool = Field(False, alias="all")
    wait: bool = False


class PinRequest(_Body):
    blob: str
    holder: str


Handler = Callable[[dict[str, Any]], Awaitable[Response]]


class Attachments(Protocol):
    """What a direct-mount front end offers the control API (`fuse_client.fanotify`)."""

    async def attach(self, blob: str, holder: str) -> dict[str, Any]: ...

    async def detach(self, blob: str, holder: str) -> dict[str, Any]: ...

    def stats_json(self) -> dict[str, Any]: ...


class ControlAPI:
    """The routes, over the node cache's API; `app` is the ASGI application. `attachments`: the
    fanotify front end when the daemon's data path is fanotify, else None (FUSE only)."""

    def __init__(self, lazy: LazyCache, attachments: Attachments | None = None, *,
                 data_path_reason: str = "") -> None:
        self.lazy = lazy
        self.data_path_reason = data_path_reason  # why fuse or fanotify (the daemon's choice)
        self.cache = lazy.cache
        self.attachments = attachments
        self.app = FastAPI(title="layerstore node daemon control API", docs_url=None, redoc_url=None)
        self.app.add_exception_handler(StarletteHTTPException, _no_route)  # type: ignore[arg-type]
        routes: list[tuple[str, str, Handler, type[BaseModel] | None, str]] = [
            ("GET", "/stats", self.get_stats, None, "What the daemon fetched and served, per blob"),
            ("GET", "/metrics", self.get_metrics, None, "Prometheus text format"),
            ("GET", "/cache", self.get_cache, None, "The node cache's blobs, usage and pins"),
            ("POST", "/cache/verify", self.post_verify, None, "Re-hash every committed chunk, drop bad ones"),
            ("POST", "/cache/evict", self.post_evict, EvictRequest, "Evict chunks"),
            ("POST", "/cache/gc", self.post_gc, GcRequest, "Forget blobs nothing uses, unused for a while"),
            ("POST", "/prefetch", self.post_prefetch, PrefetchRequest, "Fetch chunks below demand reads"),
            ("POST", "/pin", self.post_pin, PinRequest, "Pin a complete blob: the path of its cache file"),
            ("POST", "/unpin", self.post_unpin, PinRequest, "Drop a pin (idempotent)"),
            ("POST", "/attach", self.post_attach, PinRequest, "Cache file ready for a direct mount"),
            ("POST", "/detach", self.post_detach, PinRequest, "Drop an attachment (idempotent)"),
        ]
        for method, path, handler, model, summary in routes:
            extra = None if model is None else {"requestBody": {"required": False, "content": {
                "application/json": {"schema": model.model_json_schema(by_alias=True)}}}}
            self.app.add_api_route(path, _endpoint(method, path, handler), methods=[method], summary=summary,
                                   openapi_extra=extra, response_class=JSONResponse)

    async def get_stats(self, req: dict[str, Any]) -> Response:
        out = self.lazy.stats.to_json()
        out["data_path"] = "fuse" if self.attachments is None else "fanotify"
        out["data_path_reason"] = self.data_path_reason
        out["pid"] = os.getpid()
        if self.attachments is not None:
            out["fanotify"] = self.attachments.stats_json()
        return _json(out)

    async def get_metrics(self, req: dict[str, Any]) -> Response:
        return Response(self.lazy.stats.prometheus(), media_type=PROMETHEUS_TEXT)

    async def get_cache(self, req: dict[str, Any]) -> Response:
        return _json(self.cache.ls())

    async def post_verify(self, req: dict[str, Any]) -> Response:
        return _json(await self.cache.verifier.verify())

    async def post_evict(self, req: dict[str, Any]) -> Response:
        body = EvictRequest.model_validate(req)
        return _json(await self.cache.evictor.evict(blob=body.blob or None, all_chunks=body.all_chunks,
                                            to_bytes=body.to_bytes))

    async def post_gc(self, req: dict[str, Any]) -> Response:
        body = GcRequest.model_validate(req)
        return _json(await self.cache.forgetting.gc_unused(body.older_than, dry_run=body.dry_run))

    async def post_prefetch(self, req: dict[str, Any]) -> Response:
        body = PrefetchRequest.model_validate(req)
        blob = digestmod.parse(body.blob)
        return _json(await self.lazy.prefetch(blob, chunks=body.chunks, ranges=body.ranges,
                                              all_chunks=body.all_chunks, wait=body.wait))

    async def post_pin(self, req: dict[str, Any]) -> Response:
        blob, holder = _pin_args(req)
        path = await self.lazy.pin_blob(blob, holder)
        return _json({"blob": blob, "holder": holder, "complete": True, "path": os.fspath(path)})

    async def post_unpin(self, req: dict[str, Any]) -> Response:
        blob, holder = _pin_args(req)
        removed = await self.cache.pins.unpin_blob(blob, holder)
        return _json({"blob": blob, "holder": holder, "removed": removed, "holders": self.cache.pins.holders(blob)})


    async def post_attach(self, req: dict[str, Any]) -> Response:
        blob, holder = _pin_args(req)
        if self.attachments is None:
            raise DataPathUnavailable("this daemon serves the FUSE data path only (no fanotify pre-content events)")
        return _json(await self.attachments.attach(blob, holder))

    async def post_detach(self, req: dict[str, Any]) -> Response:
        blob, holder = _pin_args(req)
        if self.attachments is None:
            return _json({"blob": blob, "holder": holder, "removed": False})
        return _json(await self.attachments.detach(blob, holder))


def _pin_args(req: dict[str, Any]) -> tuple[str, str]:
    body = PinRequest.model_validate(req)
    return digestmod.parse(body.blob), check_holder(body.holder)


def _json(obj: object, status: int = 200) -> Response:
    return Response(json.dumps(obj, sort_keys=True).encode(), status_code=status, media_type="application/json")


def _endpoint(method: str, path: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The ASGI endpoint of one route: the body read and parsed, the handler called, every
    failure translated here (the one edge between the project's errors and HTTP statuses)."""
    with_body = method == "POST"

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(await _json_object(request) if with_body else {})
        except ClientDisconnect:  # gone mid-body: nobody to answer
            return _error(BadInput("the client went away before sending its whole request"))
        except ValidationError as e:
            return _error(BadInput(f"bad request: {_validation_message(e)}"))
        except LayerstoreError as e:
            return _error(e)
        except ValueError as e:
            return _error(BadInput(f"bad request: {e}"))
        except Exception as e:
            log.exception("control: %s %s failed", method, path)
            return _error(LayerstoreError(f"{type(e).__name__}: {e}"))

    endpoint.__name__ = f"{method.lower()}_{path.strip('/').replace('/', '_')}"
    return endpoint


async def _json_object(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise BadInput(f"request body over {MAX_BODY} bytes")
    parts: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(BODY_DEADLINE):
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY:
                    raise BadInput(f"request body over {MAX_BODY} bytes")
                parts.append(part)
    except TimeoutError:
        raise BadInput(f"request body not received within {BODY_DEADLINE:g} s") from None
    raw = b"".join(parts)
    if not raw.strip():
        return {}
    try:
        req = json.loads(raw)  # (ValueError: a 400)
    except RecursionError:
        raise BadInput("request body nested too deeply") from None
    if not isinstance(req, dict):
        raise BadInput("request body must be a JSON object")
    return req


def _validation_message(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())


def _error(e: LayerstoreError) -> Response:
    return _json(e.to_wire(), e.http_status)


async def _no_route(request: Request, exc: StarletteHTTPException) -> Response:
    """404/405 from the router, in the shape the client reads (`{"error": ...}`)."""
    answer = _json({"error": f"no route {request.method} {request.url.path}"}, exc.status_code)
    answer.headers.update(exc.headers or {})
    return answer
