"""Signing in to the status page from a browser (issue 27; docs/status-page.md, "Signing in").

A person without a token who opens `/status` (or `/`) in a browser (`Accept: text/html`) gets a
page that says how to sign in, with a form, instead of the API's JSON refusal. The form posts
the token to `/status/signin`; a token that may read is answered with a redirect to the status
page and a cookie `layerstore_token` that is `HttpOnly` (no script reads it), `SameSite=Strict`
(no other site's page sends it), `Path=/status` and, over https, `Secure`. The service honours the
cookie on the status page only (`reader`): every API route wants the `Authorization` header, so
a cookie a browser holds authorizes nothing else. `/status/signout` clears it. A sign-in or
sign-out post whose `Origin` is another site is refused (no signing a browser into someone
else's token). API clients (no `text/html` in `Accept`) keep the JSON answers.

Nothing is stored on the service: the cookie is the token itself (the tokens file is still the
only list of who may do what; a removed token stops working at the next request).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from layerstore.backends import http_wire as wire
from layerstore.errors import LayerstoreError, PermissionDenied

from .auth import Principal
from .status import render_page

COOKIE = "layerstore_token"
COOKIE_PATH = "/status"
COOKIE_AGE = 12 * 3600  # seconds; the token itself may live longer
MAX_FORM = 4096
FORM_TIMEOUT = 10.0  # seconds for the form's body (a slow client holds a connection, no more)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "Cache-Control": "no-store",
    "Referrer-Policy": "same-origin",  # no-referrer would make a form post send Origin: null
    "X-Content-Type-Options": "nosniff",
}


def reader(request: Request) -> Principal:
    """Who asks for the status page: the bearer token, or the status page's cookie. Raises
    `Unauthenticated` / `PermissionDenied` (a token that may not read)."""
    header = request.headers.get("authorization")
    if header is None and request.cookies.get(COOKIE):
        header = f"Bearer {request.cookies[COOKIE]}"
    who: Principal = request.app.state.tokens.authenticate(header)
    if not who.can_read:
        raise PermissionDenied(f"token {who.id} may not read")
    return who


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def page(message: str, status: int, *, action: str = "status/signin") -> Response:
    """The sign-in page (`action`: the form's target, relative to the page's own URL)."""
    text = render_page("signin.html", message=message, action=action, hours=COOKIE_AGE // 3600)
    headers = dict(SECURITY_HEADERS)
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="layerstore"'
    return Response(text, status_code=status, media_type="text/html; charset=utf-8", headers=headers)


def refusal(request: Request, e: LayerstoreError) -> Response | None:
    """The sign-in page for a browser the status page refused (None: answer the API's JSON)."""
    if not wants_html(request) or e.http_status not in (401, 403):
        return None
    resp = page(str(e), e.http_status)
    if request.cookies.get(COOKIE):
        _clear(resp)  # a stale or revoked token: forget it
    return resp


def _clear(resp: Response) -> None:
    resp.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")


def install(app: FastAPI) -> None:
    """The sign-in and sign-out routes (browser-only: not in the API's document)."""

    @app.post("/status/signin", include_in_schema=False)
    async def signin(request: Request) -> Response:
        if not _same_origin(request):
            return page("sign-in refused: the form was posted from another site", 403, action="signin")
        body = b""
        try:
            with anyio.fail_after(FORM_TIMEOUT):
                async for part in request.stream():
                    body += part
                    if len(body) > MAX_FORM:
                        return page("sign-in refused: the form is too large", 413, action="signin")
        except TimeoutError:
            return page("sign-in refused: the form did not arrive in time", 408, action="signin")
        token = (parse_qs(body.decode("utf-8", "replace")).get("token") or [""])[0].strip()
        if not token:
            return page("paste a token to sign in", 401, action="signin")
        try:
            who: Principal = request.app.state.tokens.authenticate(f"Bearer {token}")
            if not who.can_read:
                raise PermissionDenied(f"token {who.id} may not read this store")
        except wire.Unauthenticated:
            return page("unknown token: check it and try again", 401, action="signin")
        except PermissionDenied as e:
            return page(str(e), 403, action="signin")
        resp = Response(status_code=303, headers={"Location": "../status", **SECURITY_HEADERS})
        resp.set_cookie(COOKIE, token, max_age=COOKIE_AGE, path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    @app.get("/status/signin", include_in_schema=False)
    async def signin_form() -> Response:
        return page("", 200, action="signin")

    @app.post("/status/signout", include_in_schema=False)
    async def signout(request: Request) -> Response:
        if not _same_origin(request):
            return page("sign-out refused: the form was posted from another site", 403, action="signin")
        resp = Response(status_code=303, headers={"Location": "../status", **SECURITY_HEADERS})
        _clear(resp)
        return resp
