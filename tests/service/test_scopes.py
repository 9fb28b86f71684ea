"""Every endpoint against every token scope: allowed ones succeed, refused ones get 401 (no or an
unknown token), 403 (a scope that does not allow it) or 404 (a private name the token may not
see), always with the error family's JSON body."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from testkit.store_service import make_tokens, threaded_service

from layerstore import chunkobj, keys
from layerstore.store import STORE_FORMAT, Store

from .conftest import SCOPES, Served

READERS = {"read", "readsecret", "pushteam", "pushall", "gc", "admin", "node"}
PUSHERS = {"pushteam", "pushall", "admin"}
GC = {"gc", "admin"}
ALL = set(SCOPES) | {None, "bogus"}


@dataclass
class Case:
    name: str
    method: str
    path: str
    allowed: set[str | None]
    body: bytes | None = None
    hidden_from: set[str | None] = frozenset()  # type: ignore[assignment]  # answered 404, not 403
    setup: Callable[[Store], None] | None = None
    headers: dict[str, str] | None = None


@pytest.fixture(scope="module")
def world(served: Served) -> dict[str, str]:
    with served.local() as s:
        chunk, _ = s.put_chunk(b"scoped chunk " * 100)
        manifest = s.put_manifest(b'{"scoped": true}')
        for ref in ("team/app:v1", "other/app:v1", "secret/app:v1"):
            s.set_tag(ref, manifest)
        s.backend.replace("leases/l1/head", b"{}")
        s.backend.replace("gc/runs/r1", b"{}")
    new_id, new_obj = chunkobj.encode(b"a chunk pushed over HTTP")
    return {"chunk": keys.object_key("chunks", chunk), "manifest": manifest, "new_chunk": keys.object_key(
        "chunks", new_id), "new_obj": new_obj.hex()}


def _cases(w: dict[str, str]) -> list[Case]:
    obj = "/v1/objects/"
    manifest_ref = (w["manifest"] + "\n").encode()
    config = json.dumps(STORE_FORMAT).encode()

    def recreate(key: str, data: bytes) -> Callable[[Store], None]:
        return lambda s: s.backend.replace(key, data)

    def rechunk(s: Store) -> None:
        s.put_chunk(b"scoped chunk " * 100)

    readers_not_secret = {"read", "pushteam", "pushall", "node"}
    return [
        Case("get chunk", "GET", obj + w["chunk"], READERS),
        Case("head chunk", "HEAD", obj + w["chunk"], READERS),
        Case("get ranged chunk", "GET", obj + w["chunk"], READERS, headers={"Range": "bytes=0-3"}),
        Case("get public tag", "GET", obj + "tags/team/app:v1", READERS),
        Case("get private tag", "GET", obj + "tags/secret/app:v1", {"readsecret", "gc", "admin"},
             hidden_from=readers_not_secret),
        Case("head private tag", "HEAD", obj + "tags/secret/app:v1", {"readsecret", "gc", "admin"},
             hidden_from=readers_not_secret),
        Case("get lease", "GET", obj + "leases/l1/head", READERS),
        Case("get gc state", "GET", obj + "gc/runs/r1", READERS),
        Case("get config", "GET", obj + "config", READERS),
        Case("put chunk", "PUT", obj + w["new_chunk"], PUSHERS, bytes.fromhex(w["new_obj"])),
        Case("put own tag", "PUT", obj + "tags/team/app:v2", PUSHERS, manifest_ref),
        Case("put other tag", "PUT", obj + "tags/other/app:v2", {"pushall", "admin"}, manifest_ref),
        Case("put private tag", "PUT", obj + "tags/secret/app:v2", {"admin"}, manifest_ref),
        Case("put new lease", "PUT", obj + "leases/l2/head", PUSHERS | {"node"}, b"{}",
             setup=lambda s: s.backend.delete_many(["leases/l2/head"])),
        Case("put gc state", "PUT", obj + "gc/runs/r2", GC, b"{}"),
        Case("put config", "PUT", obj + "config", {"admin"}, config),
        Case("put raw key", "PUT", obj + "t/raw", {"admin"}, b"raw"),
        Case("delete chunk", "DELETE", obj + w["chunk"], GC, setup=rechunk),
        Case("delete own tag", "DELETE", obj + "tags/team/app:v1", PUSHERS | GC,
             setup=recreate("tags/team/app:v1", manifest_ref)),
        Case("delete private tag", "DELETE", obj + "tags/secret/app:v1", GC, hidden_from=readers_not_secret,
             setup=recreate("tags/secret/app:v1", manifest_ref)),
        # a head no token owns (written to the backend directly): only gc and admin may drop it
        Case("delete unowned lease", "DELETE", obj + "leases/l1/head", GC, setup=recreate("leases/l1/head", b"{}")),
        Case("delete gc state", "DELETE", obj + "gc/runs/r1", GC, setup=recreate("gc/runs/r1", b"{}")),
        Case("delete config", "DELETE", obj + "config", {"admin"}, setup=recreate("config", config)),
        Case("list", "GET", "/v1/list?prefix=tags/", READERS),
        Case("list info", "GET", "/v1/list?prefix=&info=1", GC),
        Case("list chunks", "GET", "/v1/list?prefix=chunks/", GC),
        Case("list blobs", "GET", "/v1/list?prefix=blobs/", GC),
        Case("list manifests", "GET", "/v1/list?prefix=manifests/", GC),
        Case("list signatures", "GET", "/v1/list?prefix=tags/sig/", GC),
        Case("list leases", "GET", "/v1/list?prefix=leases/", GC),
        Case("list one manifest's signatures", "GET", f"/v1/list?prefix=tags/sig/{'0' * 64}:", READERS),
        Case("list one lease", "GET", "/v1/list?prefix=leases/l1/", PUSHERS | GC | {"node"}),
        Case("list gc state", "GET", "/v1/list?prefix=gc/", READERS),
        Case("delete many", "POST", "/v1/delete", GC, json.dumps({"keys": [w["chunk"]]}).encode(), setup=rechunk),
        Case("check store", "GET", "/v1/store", READERS),
        Case("create store", "POST", "/v1/store", READERS),  # it exists: fine for a reader
        Case("init store", "PUT", obj + "config", READERS, config, headers={"If-None-Match": "*"}),
        Case("status page", "GET", "/status", READERS),
        Case("healthz", "GET", "/healthz", ALL),
        Case("metrics", "GET", "/metrics", ALL),
        Case("openapi", "GET", "/openapi.json", ALL),
    ]


def test_creating_a_missing_store_needs_admin(tmp_path: Path) -> None:
    tokens = make_tokens(tmp_path / "t.json", {"ro": ["read"], "admin": ["admin"]})
    with threaded_service(str(tmp_path / "nothing"), tokens=tmp_path / "t.json") as url:
        assert httpx.post(url + "/v1/store", headers={"Authorization": f"Bearer {tokens['ro']}"}).status_code == 403
        assert httpx.post(url + "/v1/store", headers={"Authorization": f"Bearer {tokens['admin']}"}).status_code == 200
    assert (tmp_path / "nothing").is_dir()


CASE_NAMES = [c.name for c in _cases({"chunk": "c", "manifest": "m", "new_chunk": "n", "new_obj": ""})]


@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_every_scope(served: Served, world: dict[str, str], case_name: str) -> None:
    case = next(c for c in _cases(world) if c.name == case_name)
    tokens = {**served.tokens, "bogus": "lst_bogus_" + "x" * 43}
    outcomes = {}
    with httpx.Client(base_url=served.url, timeout=30) as client, served.local() as local:
        for who in sorted(ALL, key=str):
            if case.setup is not None:
                case.setup(local)
            headers = dict(case.headers or {})
            if who is not None:
                headers["Authorization"] = f"Bearer {tokens[who]}"
            r = client.request(case.method, case.path, content=case.body, headers=headers)
            outcomes[who] = r.status_code
            if who in case.allowed:
                ok = r.status_code < 400 or (case.name == "init store" and r.status_code == 412)
                assert ok, (case.name, who, r.status_code, r.text[:300])
                continue
            want = 401 if who in (None, "bogus") else 404 if who in case.hidden_from else 403
            assert r.status_code == want, (case.name, who, r.status_code, r.text[:300])
            if case.method != "HEAD":
                body = r.json()
                assert body["kind"] in {401: "Unauthenticated", 403: "PermissionDenied", 404: "NotFound"}[want]
                assert body["exit_code"] in (3, 6)
            if want == 401:
                assert r.headers["www-authenticate"].startswith("Bearer")
    assert outcomes


def test_listing_hides_private_names(served: Served, world: dict[str, str]) -> None:
    with served.local() as s:
        s.backend.replace("tags/secret/app:v1", (world["manifest"] + "\n").encode())
        s.backend.replace("tags/team/app:v1", (world["manifest"] + "\n").encode())
    seen = {}
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for who in ("read", "readsecret", "pushteam", "gc"):
            r = client.get("/v1/list", params={"prefix": "tags/"}, headers=served.auth(who))
            assert r.status_code == 200
            seen[who] = {json.loads(line)["k"] for line in r.text.splitlines()}
    assert "tags/secret/app:v1" not in seen["read"] | seen["pushteam"]
    assert "tags/secret/app:v1" in seen["readsecret"] & seen["gc"]
    assert "tags/team/app:v1" in seen["read"] & seen["pushteam"] & seen["gc"]
    assert "tags/team/app:v1" not in seen["readsecret"]  # namespaced: only its own names are listed


def test_token_file_changes_take_effect_without_restart(served: Served) -> None:
    from service.auth import load_token_file, save_token_file

    headers = served.auth("read")
    with httpx.Client(base_url=served.url, timeout=30) as client:
        assert client.get("/v1/store", headers=headers).status_code == 200
        tf = load_token_file(served.tokens_file)
        saved = [dict(t) for t in tf.tokens]
        assert tf.remove("read")
        save_token_file(served.tokens_file, tf)
        try:
            assert client.get("/v1/store", headers=headers).status_code == 401
            new = tf.add("late", ["read"])
            save_token_file(served.tokens_file, tf)
            assert client.get("/v1/store", headers={"Authorization": f"Bearer {new}"}).status_code == 200
        finally:
            tf.tokens = saved
            save_token_file(served.tokens_file, tf)
        assert client.get("/v1/store", headers=headers).status_code == 200
