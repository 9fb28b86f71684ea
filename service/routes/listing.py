"""The listing of keys under a prefix (`GET /v1/list`), streamed a batch of lines at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from layerstore.backends import http_wire as wire
from layerstore.errors import PermissionDenied
from layerstore.keys import validate_prefix

from ..deps import Svc, Who
from .common import run

LIST_BATCH = 512

router = APIRouter()


@router.get(wire.LIST, response_class=StreamingResponse, responses={200: {"content": {"application/x-ndjson": {}}}})
async def list_objects(who: Who, svc: Svc, prefix: Annotated[str, Query(max_length=1024)] = "",
                       info: Annotated[int, Query(ge=0, le=1)] = 0) -> StreamingResponse:
    """Every key under `prefix`, one JSON object a line: {"k": key} or, with info=1,
    {"k": key, "s": size, "m": mtime (seconds, the store's clock)}."""
    validate_prefix(prefix)
    refusal = who.list_refusal(prefix)
    if refusal is not None:
        raise PermissionDenied(refusal)
    source: Iterator[Any] = svc.backend.list_info(prefix) if info else svc.backend.list(prefix)

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
