"""The status page (`/status`, `/`): environments and tags, layers, deduplication, the last GC
run (rendered by service/status.py); a browser without a token that may read gets the sign-in
page instead (signin.py, whose routes sit under `/status/`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from layerstore.errors import NotFound, PermissionDenied

from .. import signin
from ..deps import Svc
from .common import run

HTML = {200: {"content": {"text/html": {}}}}

router = APIRouter()


@router.get("/", response_class=Response, responses=HTML)
@router.get("/status", response_class=Response, responses=HTML)
async def status_page(request: Request, svc: Svc) -> Response:
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
    html = await run(lambda: render(svc.store, visible=who.lists, nodes=not who.namespaced))
    return Response(html, media_type="text/html; charset=utf-8")


def status_renderer() -> Any:
    """`status.render_status`, None if the status page's module cannot load (no jinja2)."""
    try:
        from .. import status
    except ImportError:
        return None
    return getattr(status, "render_status", None)
