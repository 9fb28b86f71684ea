"""The store service: the store's whole surface over HTTP, as a FastAPI app (docs/service.md).

The app holds a `Store` (the backend behind it) and a `TokenTable`, nothing else: every answer is
the backend's, so any number of instances and workers serve one store. Backend calls are blocking
and run in worker threads; a request body is read whole (bounded by its key's kind, within a
deadline) and checked (`checks.check_body`) before the backend sees it.

`create_app` puts the app's state in `app.state` (`deps.Service`, the `TokenTable`), includes the
routers of `service.routes` (objects, listing, batches, admin, the status page; their
dependencies in `deps.py`), installs the error edge (`edge.py`: every error leaves as the error
family's JSON) and the middlewares (metrics, per-token in-flight limit, the objects' fast path)."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

from fastapi import FastAPI

from layerstore.backends import http_wire as wire
from layerstore.store import Store

from . import edge, signin
from .auth import TokenTable
from .deps import DEFAULT_BODY_TIMEOUT, Service, principal
from .fastpath import ObjectFastPath
from .inflight import DEFAULT_MAX_INFLIGHT, MAX_INFLIGHT_ENV, InflightLimit
from .metrics import MetricsMiddleware
from .routes import add_routes, objects

STORE_ENV = "LAYERSTORE_SERVE_STORE"
TOKENS_ENV = "LAYERSTORE_SERVE_TOKENS"
BODY_TIMEOUT_ENV = "LAYERSTORE_SERVE_BODY_TIMEOUT"


def create_app(store: Store, tokens: TokenTable, *, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               max_inflight: int = DEFAULT_MAX_INFLIGHT) -> FastAPI:
    app = FastAPI(title="layerstore store service", version="1",
                  description="The content-addressed store over HTTP: see docs/service.md.")
    app.state.tokens = tokens
    svc = app.state.service = Service.build(store, body_timeout)
    app.state.decode_budget = svc.budget  # checking bodies (budget.py)
    edge.install(app)
    add_routes(app)  # objects, listing, batches, admin, the status page (routes/)
    signin.install(app)
    routes = {m: r for r in app.routes if getattr(r, "path", None) == wire.OBJECTS + "{key:path}"
              for m in getattr(r, "methods", ()) if m in ("GET", "HEAD")}
    app.add_middleware(ObjectFastPath, prefix=wire.OBJECTS, who=lambda request: principal(request, None),
                       get=partial(objects.answer_get, svc), head=partial(objects.answer_head, svc),
                       on_error=edge.edge_error, routes=routes)
    app.add_middleware(InflightLimit, limit=max_inflight, cookie=signin.COOKIE)  # per token (inflight.py)
    app.add_middleware(MetricsMiddleware)  # outermost: it counts the fast path's answers too
    return app


def app_from_env() -> FastAPI:
    """The app of one uvicorn worker, configured by `layerctl serve` through the environment."""
    url = os.environ[STORE_ENV]
    tokens = os.environ.get(TOKENS_ENV) or None
    timeout = float(os.environ.get(BODY_TIMEOUT_ENV) or DEFAULT_BODY_TIMEOUT)
    inflight = int(os.environ.get(MAX_INFLIGHT_ENV) or DEFAULT_MAX_INFLIGHT)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(Store.open(url), TokenTable(Path(tokens) if tokens else None), body_timeout=timeout,
                      max_inflight=inflight)
