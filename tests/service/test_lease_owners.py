"""Issue 27, leases: a lease belongs to the token that wrote it. Another token that may write
leases cannot drop it, shorten it, rewrite its keys or delete its shards (403), so the collector
keeps what it holds; gc and admin still may drop it. Two tokens creating one lease at once: one
owns it, the other is refused (the head is written by compare-and-swap)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import layergc
import pytest
from testkit.store_service import make_tokens, threaded_service

from layerstore import keys, leases
from layerstore.backends.http import HttpBackend
from layerstore.errors import PermissionDenied
from layerstore.store import Store

pytestmark = pytest.mark.hostile

TOKENS = {"ci": ["push:team/"], "node": ["read", "lease"], "other": ["read", "lease"], "gc": ["gc"]}


@pytest.fixture
def svc(tmp_path: Path) -> dict[str, object]:
    root = tmp_path / "store"
    with Store.open(str(root)) as s:
        s.init()
        src = tmp_path / "layer"
        src.write_bytes(b"a CI job's layer " * 5000)
        blob = s.put_blob(src).blob  # no tag names it: only a lease keeps it
        chunk = keys.object_key("chunks", s.get_chunk_map(blob).chunks[0].digest)
    tokens = make_tokens(tmp_path / "tokens.json", TOKENS)
    with threaded_service(str(root), tokens=tmp_path / "tokens.json") as url:
        opened: list[HttpBackend] = []
        try:
            yield {"root": root, "url": url, "tokens": tokens, "blob": blob, "chunk": chunk, "opened": opened}
        finally:
            for b in opened:
                b.close()


def _backend(svc: dict[str, object], who: str) -> HttpBackend:
    tokens = svc["tokens"]
    assert isinstance(tokens, dict)
    backend = HttpBackend(str(svc["url"]), token=tokens[who], attempts=1)
    opened = svc["opened"]
    assert isinstance(opened, list)
    opened.append(backend)
    return backend


def test_another_token_cannot_drop_or_shorten_a_lease_and_the_collector_keeps_the_blob(
        svc: dict[str, object]) -> None:
    blob_key = keys.object_key("blobs", str(svc["blob"]))
    ci, other = _backend(svc, "ci"), _backend(svc, "other")
    lease = leases.Lease(ci, kind="push", name="ci-job", ttl=600, renew=False).open([blob_key])
    assert lease.hold([str(svc["chunk"])])  # a shard, owned like its head
    shard = [k for k in ci.list(f"leases/{lease.id}/") if not k.endswith("/head")]
    head = leases.head_key(lease.id)
    stored = json.loads(_backend(svc, "gc").load(head))
    assert stored["owner"] == "ci"

    with pytest.raises(PermissionDenied, match="belongs to token ci"):
        other.delete(head)
    with pytest.raises(PermissionDenied, match="belongs to token ci"):
        other.delete_many([head, *shard])
    with pytest.raises(PermissionDenied, match="belongs to token ci"):
        other.delete(shard[0])
    shorter = {**stored, "expires": time.time() - 3600, "keys": [], "owner": "other"}
    with pytest.raises(PermissionDenied, match="belongs to token ci"):
        other.replace(head, json.dumps(shorter).encode())
    with pytest.raises(PermissionDenied, match="belongs to token ci"):
        other.store_once(f"leases/{lease.id}/s99999999", b"[]")
    assert json.loads(_backend(svc, "gc").load(head)) == stored  # untouched
    tokens = svc["tokens"]
    assert isinstance(tokens, dict)
    for body in (b"[" * 200_000, b"not json", b"[1, 2]"):  # a head the service must parse: never a 500
        r = httpx.put(f"{svc['url']}/v1/objects/leases/odd/head", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {tokens['other']}"})
        assert r.status_code == 422 and r.json()["kind"] == "RejectedObject", r.text[:200]

    with Store.open(str(svc["root"])) as s:  # the collector, straight on the store, no grace
        report = layergc.collect(s, grace=0)
        assert s.has_blob(str(svc["blob"])), report
    lease.check()
    lease.open([blob_key])  # the owner renews (a compare-and-swap of its own head)
    lease.release()  # and drops it
    assert not list(_backend(svc, "gc").list(f"leases/{lease.id}/"))
    with Store.open(str(svc["root"])) as s:  # unheld, the same collection deletes it
        layergc.collect(s, grace=0)
        assert not s.has_blob(str(svc["blob"]))


def test_gc_may_drop_any_lease_and_an_unowned_one_only_gc(svc: dict[str, object]) -> None:
    node, gc = _backend(svc, "node"), _backend(svc, "gc")
    lease = leases.Lease(node, kind="node", ttl=600, renew=False).open(["tags/team/app:v1"])
    assert gc.delete_many([leases.head_key(lease.id)]) == 1
    with Store.open(str(svc["root"])) as s:  # a head written to the backend directly: no owner
        s.backend.replace("leases/direct/head", b'{"expires": 0}')
    with pytest.raises(PermissionDenied, match="no token"):
        node.delete("leases/direct/head")
    gc.delete("leases/direct/head")


def test_two_tokens_creating_one_lease_at_once_one_owns_it(svc: dict[str, object]) -> None:
    tokens = svc["tokens"]
    assert isinstance(tokens, dict)
    for i in range(12):
        key = f"leases/race{i}/head"
        barrier = threading.Barrier(2)
        status: dict[str, int] = {}

        def put(who: str, key: str = key, barrier: threading.Barrier = barrier,
                status: dict[str, int] = status) -> None:
            body = json.dumps({"kind": "push", "expires": time.time() + 600, "keys": [], "who": who}).encode()
            barrier.wait()
            r = httpx.put(f"{svc['url']}/v1/objects/{key}", content=body, timeout=30,
                          headers={"Authorization": f"Bearer {tokens[who]}"})
            status[who] = r.status_code

        threads = [threading.Thread(target=put, args=(w,)) for w in ("node", "other")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(status.values()) in ([201, 403], [200, 403]), status
        with Store.open(str(svc["root"])) as s:
            head = json.loads(s.backend.load(key))
        winner = next(w for w, code in status.items() if code < 400)
        assert head["owner"] == winner and head["who"] == winner
