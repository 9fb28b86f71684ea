"""Issue 27, the status page in a browser: a person without a token gets a page that says how to
sign in (not the API's JSON); the form sets an HttpOnly, SameSite=Strict cookie for the status
page only, which authorizes no API route. Driven in headless Chromium through the DevTools
protocol (testkit.browser.DevTools)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testkit import browser
from testkit.store_service import make_tokens, threaded_service

from layerstore.store import Store

pytestmark = pytest.mark.hostile


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    root = tmp_path / "store"
    with Store.open(str(root)) as s:
        s.init()
        manifest = s.put_manifest(b'{"env": "app"}')
        s.set_tag("team/app:v1", manifest)
        s.set_tag("other/app:v1", manifest)
    tokens = make_tokens(tmp_path / "tokens.json", {"team": ["read:team/"], "lease": ["lease"]})
    with threaded_service(str(root), tokens=tmp_path / "tokens.json") as url:
        yield url, tokens


def test_without_a_token_a_browser_gets_the_sign_in_page_and_an_api_client_json(
        site: tuple[str, dict[str, str]]) -> None:
    url, tokens = site
    for path in ("/status", "/"):
        r = httpx.get(url + path, headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert r.status_code == 401 and r.headers["content-type"].startswith("text/html"), r.text[:300]
        assert '<form id="signin" method="post"' in r.text and 'name="token"' in r.text
        assert "default-src 'none'" in r.headers["content-security-policy"]
        r = httpx.get(url + path)  # an API client: the error family's JSON, as before
        assert r.status_code == 401 and r.json()["kind"] == "Unauthenticated"
    # a token that may not read: the sign-in page again, saying so
    r = httpx.get(url + "/status", headers={"Accept": "text/html", "Authorization": f"Bearer {tokens['lease']}"})
    assert r.status_code == 403 and "may not read" in r.text
    # a sign-in posted from another site's page is refused, and sets nothing
    r = httpx.post(url + "/status/signin", data={"token": tokens["team"]}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.post(url + "/status/signin", data={"token": "x" * 5000})  # a form bounded in size
    assert r.status_code == 413 and "set-cookie" not in r.headers


def test_the_cookie_is_for_the_status_page_only(site: tuple[str, dict[str, str]]) -> None:
    url, tokens = site
    r = httpx.post(url + "/status/signin", data={"token": tokens["team"]})
    assert r.status_code == 303 and r.headers["location"] == "../status"
    cookie = r.headers["set-cookie"]
    for attr in ("HttpOnly", "SameSite=strict", "Path=/status"):
        assert attr.lower() in cookie.lower(), cookie
    jar = {"layerstore_token": tokens["team"]}
    with httpx.Client(base_url=url, cookies=jar) as client:
        assert client.get("/status").status_code == 200
        for path in ("/v1/store", "/v1/list?prefix=tags/", "/v1/objects/tags/team/app:v1"):
            assert client.get(path).status_code == 401, path  # the API wants the Authorization header


@pytest.mark.skipif(browser.chromium() is None, reason="chromium is not installed")
def test_sign_in_in_headless_chromium(site: tuple[str, dict[str, str]]) -> None:
    url, tokens = site
    with browser.DevTools() as tab:
        tab.navigate(url + "/status")
        assert tab.evaluate("document.title") == "layerstore: sign in"
        assert tab.evaluate("!!document.querySelector('form#signin input[name=token]')")
        # a wrong token: the page says so and no cookie is set
        tab.evaluate("document.querySelector('input[name=token]').value = 'lst_nobody_x';"
                     "document.querySelector('form#signin').submit()", await_load=True)
        assert "unknown token" in str(tab.evaluate("document.getElementById('message').textContent"))
        assert tab.cookies(url + "/status") == []
        # the right one: the status page, with a cookie no script can read
        tab.evaluate(f"document.querySelector('input[name=token]').value = {tokens['team']!r};"
                     "document.querySelector('form#signin').submit()", await_load=True)
        assert tab.evaluate("location.pathname") == "/status"
        assert tab.evaluate("document.title") == "layerstore: store status"
        text = str(tab.evaluate("document.body.innerText"))
        assert "team/app:v1" in text and "other/app" not in text  # a namespaced token: its names only
        assert tab.evaluate("document.cookie") == ""  # HttpOnly
        (cookie,) = tab.cookies(url + "/status")
        assert cookie["name"] == "layerstore_token" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert cookie["path"] == "/status"
        assert tab.cookies(url + "/v1/store") == []  # not sent to the API
        tab.navigate(url + "/status")  # still signed in on a new visit
        assert tab.evaluate("document.title") == "layerstore: store status"
        # sign out: the cookie is gone and the sign-in page is back
        tab.evaluate("document.querySelector('form#signout').submit()", await_load=True)
        assert tab.cookies(url + "/status") == []
        assert tab.evaluate("document.title") == "layerstore: sign in"
