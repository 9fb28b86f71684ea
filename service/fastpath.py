"""The hot path of the service: GET and HEAD of one object, answered from the ASGI scope before
FastAPI's routing (docs/service.md, "Where a GET's time goes").

A chunk GET is most of what a node daemon asks for. Through FastAPI's router, dependency solver
and exception middlewares it cost about twice the bare HTTP exchange on the 2-core machine; this
pure ASGI middleware hands the same request to the same answering functions the documented routes
call (`answer_get`, `answer_head` in `routes/objects.py`), so the behaviour (scopes, statuses, headers, error
bodies) is one piece of code, only the path to it is shorter. Anything it does not recognise
goes on to the app unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

Answer = Callable[..., Awaitable[Response]]


@dataclass
class ObjectFastPath:
    app: Any
    prefix: str
    who: Callable[[Request], Awaitable[Any]]
    get: Answer
    head: Answer
    on_error: Callable[[BaseException], Response]
    routes: dict[str, Any]  # method -> the documented route (metrics label by its template)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD") or scope.get("root_path")
                or not scope.get("path", "").startswith(self.prefix)):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        key = scope["path"][len(self.prefix):]
        route = self.routes.get(method)
        if route is not None:
            scope["route"] = route
        try:
            who = await self.who(Request(scope))
            if method == "GET":
                headers = Headers(scope=scope)
                resp = await self.get(who, key, headers.get("range"), headers.get("if-none-match"))
            else:
                resp = await self.head(who, key)
        except Exception as e:  # the same edge as the app's exception handlers
            resp = self.on_error(e)
        await resp(scope, receive, send)
