"""The service's error edge: every error leaves through `error_response` (a `LayerstoreError` as
its class's status with `to_wire()`), FastAPI's and Starlette's own refusals as the family's
classes, anything else as a 500 with a JSON body (and a log line)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerstore.errors import BadInput, LayerstoreError, NotFound

log = logging.getLogger("layerstore.service")


def error_response(e: LayerstoreError) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="layerstore"'} if e.http_status == 401 else None
    return JSONResponse(e.to_wire(), status_code=e.http_status, headers=headers)


def edge_error(e: BaseException) -> JSONResponse:
    """The answer to an exception that reached the edge: a `LayerstoreError` as its status, any
    other as a 500 with a JSON body (and a log line)."""
    if isinstance(e, LayerstoreError):
        return error_response(e)
    log.exception("unexpected failure", exc_info=e)
    return error_response(LayerstoreError(f"internal error: {type(e).__name__}"))


async def on_error(_request: Request, e: LayerstoreError) -> JSONResponse:
    return error_response(e)


async def on_invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(BadInput(f"bad request: {str(e.errors())[:300]}"))


async def on_http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
    err: LayerstoreError = NotFound("no such route") if e.status_code == 404 else BadInput(str(e.detail))
    resp = error_response(err)
    resp.status_code = e.status_code if e.status_code >= 400 else 400
    return resp


async def on_bug(_request: Request, e: Exception) -> JSONResponse:
    return edge_error(e)


def install(app: FastAPI) -> None:
    """The exception handlers of `app`."""
    app.add_exception_handler(LayerstoreError, on_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_bug)
