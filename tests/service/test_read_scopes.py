"""Issue 27, reads: listing the store's content (chunks/, blobs/, manifests/, tags/sig/, leases/)
needs the gc or admin scope; a plain read token gets 403 on each, a namespace-scoped token pulls
its own environment by name and digests and lists only its own tags. A digest alone reads that one
object (content addressing: knowing it is the capability)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.store_service import make_tokens, threaded_service

from layerstore import keys
from layerstore.backends.http import HttpBackend
from layerstore.errors import PermissionDenied
from layerstore.store import Store

pytestmark = pytest.mark.hostile

CONTENT = ["chunks/", "blobs/", "manifests/", "tags/sig/", "leases/", "", "c", "leases/x", "tags/sig/0"]


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    """A store with two environments (team/app and other/app, each a blob and a manifest, and a
    signature tag of each manifest) and a lease, behind a service in this process."""
    root = tmp_path / "store"
    out: dict[str, object] = {"root": root}
    with Store.open(str(root)) as s:
        s.init()
        for name in ("team", "other"):
            payload = f"{name}'s layer ".encode() * 2000
            src = tmp_path / f"{name}.layer"
            src.write_bytes(payload)
            cm = s.put_blob(src)
            manifest = s.put_manifest(json.dumps({"env": name, "blob": cm.blob}).encode())
            s.set_tag(f"{name}/app:v1", manifest)
            hex_ = manifest.split(":", 1)[1]
            s.backend.replace(f"tags/sig/{hex_}:{'ab' * 32}", (manifest + "\n").encode())
            chunk = s.get_chunk_map(cm.blob).chunks[0].digest
            out[name] = {"blob": cm.blob, "manifest": manifest, "payload": payload, "chunk": chunk}
        s.backend.replace("leases/l1/head", b"{}")
    tokens = make_tokens(tmp_path / "tokens.json", {"read": ["read"], "team": ["read:team/"], "gc": ["gc"],
                                                   "admin": ["admin"], "node": ["read", "lease"]})
    with threaded_service(str(root), tokens=tmp_path / "tokens.json") as url:
        out["url"], out["tokens"] = url, tokens
        yield out


def _list(w: dict[str, object], who: str, prefix: str, info: int = 0) -> httpx.Response:
    tokens = w["tokens"]
    assert isinstance(tokens, dict)
    return httpx.get(f"{w['url']}/v1/list", params={"prefix": prefix, "info": info},
                     headers={"Authorization": f"Bearer {tokens[who]}"}, timeout=30)


@pytest.mark.parametrize("prefix", CONTENT)
def test_a_plain_read_token_may_not_list_content(world: dict[str, object], prefix: str) -> None:
    for who in ("read", "team", "node"):
        for info in (0, 1):
            r = _list(world, who, prefix, info)
            assert r.status_code == 403, (who, prefix, r.text[:300])
            assert r.json()["kind"] == "PermissionDenied"
            assert "gc or admin" in r.json()["error"]
    for who in ("gc", "admin"):
        r = _list(world, who, prefix)
        assert r.status_code == 200, (who, prefix, r.text[:300])
    if prefix == "tags/sig/0":
        return
    if prefix in ("chunks/", "blobs/", "manifests/", "tags/sig/", "leases/"):
        assert _list(world, "gc", prefix).text.strip(), prefix  # something to enumerate


def test_a_namespace_token_pulls_its_environment_and_lists_only_its_tags(world: dict[str, object]) -> None:
    tokens = world["tokens"]
    assert isinstance(tokens, dict)
    team, other = world["team"], world["other"]
    assert isinstance(team, dict) and isinstance(other, dict)
    with Store(HttpBackend(str(world["url"]), token=tokens["team"])) as s:
        manifest = s.get_tag("team/app:v1")
        assert manifest == team["manifest"]
        assert json.loads(s.get_manifest(manifest))["blob"] == team["blob"]
        cm = s.get_chunk_map(team["blob"])
        assert b"".join(s.get_chunk(c.digest) for c in cm.chunks) == team["payload"]
        assert set(s.tags()) == {"team/app:v1"}  # the other environment is not listed
        hex_ = manifest.split(":", 1)[1]  # the signatures of a manifest it names: listed
        assert list(s.backend.list(f"tags/sig/{hex_}:")) == [f"tags/sig/{hex_}:{'ab' * 32}"]
        with pytest.raises(PermissionDenied, match="gc or admin"):
            list(s.list_digests("manifests"))
        with pytest.raises(PermissionDenied, match="manifest's digest"):
            list(s.backend.list("tags/sig/"))
        # A digest is the capability to read that one object, whichever environment it is in.
        assert s.get_chunk(other["chunk"])
    with Store(HttpBackend(str(world["url"]), token=tokens["read"])) as s:
        assert set(s.tags()) == {"team/app:v1", "other/app:v1"}  # sig/ tags are not listed either
        assert list(s.backend.list("tags/sig")) == []  # a listing that overlaps them leaves them out


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_layerctl_store_and_lease_ls_need_the_gc_scope(world: dict[str, object], tmp_path: Path) -> None:
    tokens = world["tokens"]
    assert isinstance(tokens, dict)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for cmd in (("store", "ls"), ("lease", "ls")):
        r = layerctl(*cmd, "--store", str(world["url"]), env={**env, "LAYERSTORE_TOKEN": tokens["read"]})
        assert_clean_failure(r, "needs the gc or admin scope")
        r = layerctl(*cmd, "--store", str(world["url"]), "--json", env={**env, "LAYERSTORE_TOKEN": tokens["gc"]})
        assert r.code == 0, r
    r = layerctl("store", "ls", "--store", str(world["url"]), "--json", env={**env, "LAYERSTORE_TOKEN": tokens["gc"]})
    listed = r.json()
    assert len(listed["manifests"]) == 2 and {"team/app:v1", "other/app:v1"} <= set(listed["tags"])


def test_what_a_principal_may_list() -> None:
    """The rule itself, without a service (pure)."""
    from service.auth import Principal

    hex_ = "0" * 64
    reader, gc = Principal("r", frozenset({"read"})), Principal("g", frozenset({"gc"}))
    leaser = Principal("n", frozenset({"read", "lease"}))
    for prefix in CONTENT + ["blobs/ab", "chunks/00/", "manifests/b3"]:
        assert reader.list_refusal(prefix) is not None, prefix
        assert gc.list_refusal(prefix) is None, prefix
    for prefix in ("tags/", "tags/team/", "gc/runs/", "config", f"tags/sig/{hex_}:"):
        assert reader.list_refusal(prefix) is None, prefix
    assert leaser.list_refusal("leases/l1/") is None and reader.list_refusal("leases/l1/") is not None
    assert not reader.shows(f"tags/sig/{hex_}:x", "tags/") and reader.shows(f"tags/sig/{hex_}:x", f"tags/sig/{hex_}:")
    team = Principal("t", frozenset({"read:team/"}))
    assert team.namespaced and team.lists("team/app") and not team.lists("other/app") and team.sees("other/app")
    assert keys.validate("leases/l1/head")
