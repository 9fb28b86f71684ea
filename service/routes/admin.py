"""The store itself (`/v1/store`: check, create) and the operator's endpoints (`/healthz`,
`/metrics`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from layerstore.backends import http_wire as wire
from layerstore.errors import LayerstoreError, NotFound, PermissionDenied, StoreUnavailable

from ..deps import Svc, Who
from ..metrics import exposition
from .common import run

router = APIRouter()


@router.get(wire.STORE)
async def check_store(who: Who, svc: Svc) -> dict[str, str]:
    """Whether the store's location exists and is usable."""
    if not who.can_read:
        raise PermissionDenied(f"token {who.id} may not read")
    await run(svc.backend.check)
    return {"status": "ok"}


@router.post(wire.STORE)
async def create_store(who: Who, svc: Svc) -> dict[str, str]:
    """Create the store's location (directory, bucket) if needed (a store that exists is
    fine for any reader: `layerctl store init` is idempotent)."""
    if not who.admin:
        if not who.can_read:
            raise PermissionDenied(f"token {who.id} may not create the store")
        try:
            await run(svc.backend.check)
        except NotFound:
            raise PermissionDenied(f"token {who.id} may not create the store") from None
        return {"status": "ok"}
    await run(svc.backend.create)
    return {"status": "ok"}


@router.get("/healthz")
async def healthz(svc: Svc) -> dict[str, str]:
    """Alive, and the store behind answers (503 if it does not)."""
    try:
        await run(svc.backend.check)
    except LayerstoreError as e:
        raise StoreUnavailable(f"the store behind the service: {e}") from None
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics() -> Response:
    """Prometheus text format: requests, bytes and latency per route."""
    text, ctype = exposition()
    return Response(text, media_type=ctype)
