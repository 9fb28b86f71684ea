"""The service's routes, one router a concern, in the order `create_app` adds them (the order of
the OpenAPI document's paths): objects, listing, batches, admin, the status page. What a route
needs (the store, who asks) comes from the dependencies of `service.deps`."""

from __future__ import annotations

from fastapi import FastAPI

from . import admin, batches, listing, objects, status_page

ROUTERS = (objects.router, listing.router, batches.router, admin.router, status_page.router)


def add_routes(app: FastAPI) -> None:
    """The routers' routes, into the app's own route table, as `@app.get` and the like put them.
    Not `app.include_router`: FastAPI 0.165 keeps an included router behind an `_IncludedRouter`
    that matches each routed request twice (about 60-80 more Python calls a request), and
    `app.routes` would no longer list the routes themselves (the fast path and the metrics look
    routes up there). These routers have no prefix, tags or dependencies of their own, so the
    routes are the same either way (the OpenAPI document is unchanged); `app.dependency_overrides`
    does not reach them (nothing uses it)."""
    for router in ROUTERS:
        app.router.routes.extend(router.routes)
