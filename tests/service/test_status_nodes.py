"""Issue 30, the status page's nodes (docs/status-page.md, "Nodes"): the version order of tags,
node records that a hostile lease holder wrote (oversized, not JSON, wrong types, HTML in names:
escaped, capped, never a 500), and end to end: a real node daemon serves reads of a layer, its
lease and its published figures land in the store, and headless Chromium shows the node's row
and a fetch-rate line that match what the store holds."""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from layergc import collect
from layergc.report import last_report
from testkit import browser
from testkit.fuse_helpers import DaemonProcess, build_and_push, force_unmount, make_tree, wait_until
from testkit.store_service import make_tokens, threaded_service

import service.nodes as nodes
import service.status as status
from fuse_client.nodecache import report
from layerstore import keys, leases
from layerstore.backends.http import HttpBackend
from layerstore.errors import PermissionDenied
from layerstore.store import Store


# -- the order of tags ------------------------------------------------------------------------------
def test_tags_sort_by_version_then_naturally() -> None:
    refs = ["app:latest", "app:1.10", "app:1.9", "app:v2.0", "app:1.10rc1", "app:main-10", "app:main-9",
            "app:1.9.1", "app:10", "base:2", "app:0.9"]
    assert sorted(refs, key=status.tag_order) == [
        "app:0.9", "app:1.9", "app:1.9.1", "app:1.10rc1", "app:1.10", "app:v2.0", "app:10",
        "app:latest", "app:main-9", "app:main-10", "base:2"]
    assert sorted(refs) != sorted(refs, key=status.tag_order)  # (string order puts 1.10 before 1.9)


def test_the_page_lists_tags_in_version_order(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        m = s.put_manifest(b'{"env": "x"}')
        for tag in ("1.10", "1.9", "latest", "1.2"):
            s.set_tag(f"team/app:{tag}", m)
        html = status.render_status(s)
    order = [html.index(f'data-ref="team/app:{t}"') for t in ("1.2", "1.9", "1.10", "latest")]
    assert order == sorted(order)


# -- hostile records ----------------------------------------------------------------------------------
def _head(kind: str, name: str, keys: list[str] | None = None, expires: float | None = None) -> bytes:
    return json.dumps({"kind": kind, "name": name, "holder": "h:1", "created": time.time(),
                       "expires": expires or time.time() + 600, "keys": keys or []}).encode()


def _record(**over: object) -> dict[str, object]:
    t = time.time()
    rec: dict[str, object] = {"format": 1, "name": "n", "time": t, "cached_bytes": 5 << 20, "fetched_bytes": 3 << 20,
                              "hits": 7, "misses": 3, "blobs": 1,
                              "samples": [[t - 20, 0, 0, 0], [t - 10, 1 << 20, 1, 1], [t, 3 << 20, 7, 3]]}
    rec.update(over)
    return rec


def test_hostile_node_records_are_capped_escaped_and_never_break_the_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>" + "x" * 500
    records: dict[str, bytes | None] = {
        "node-html": json.dumps(_record(name=evil)).encode(),
        "node-notjson": b"<html>{not json",
        "node-big": json.dumps(_record(pad="y" * (nodes.MAX_RECORD + 10))).encode(),
        "node-types": json.dumps(_record(cached_bytes="<b>lots</b>")).encode(),
        "node-list": b'["blobs/x", "blobs/y"]',
        "node-negative": json.dumps(_record(hits=-1)).encode(),
        "node-badsample": json.dumps(_record(samples=[[1e300, 5], "<i>"])).encode(),
        "node-none": None,
    }
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        b = s.backend
        for lease_id, rec in records.items():
            b.replace(leases.head_key(lease_id), _head("node", evil if lease_id == "node-html" else lease_id,
                                                       ["blobs/ab/cd/x"]))
            if rec is not None:
                b.replace(f"leases/{lease_id}/r00000003", rec)
        b.replace(f"leases/node-html/r{'9' * 30}", b"junk")  # not a record's key: ignored
        b.replace(leases.head_key("push-1"), _head("push", "a push"))
        b.replace(leases.head_key("bad-head"), b"\x00not json")  # skipped, as the collector skips it
        html = status.render_status(s)
        rows = {r.lease: r for r in status.source_for(s).snapshot(s).nodes}

    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert set(rows) == set(records)
    html_row = rows["node-html"]
    assert html_row.figures is not None and html_row.figures.fetched_bytes == 3 << 20 and not html_row.error
    assert len(html_row.name) == nodes.MAX_NAME and html_row.held == 1
    assert html_row.rates and html_row.peak == pytest.approx((2 << 20) / 10, rel=1e-3)
    assert "not JSON" in rows["node-notjson"].error
    assert "more than such an object can have" in rows["node-big"].error
    assert "cached_bytes is not a count" in rows["node-types"].error
    assert "not a node record" in rows["node-list"].error
    assert "hits is not a count" in rows["node-negative"].error
    assert "time" in rows["node-badsample"].error
    assert rows["node-none"].error == "no figures published yet"
    assert "1 other lease(s)" in html
    for r in rows.values():
        assert (r.figures is None) == bool(r.error)
        assert r.error in html.replace("&#39;", "'") or r.error.replace("<", "&lt;") in html

    # a namespaced tenant sees no node (the service's own route decides: the page as it serves it)
    tokens = make_tokens(tmp_path / "tokens.json", {"team": ["read:team/"], "all": ["read"]})
    with threaded_service(str(tmp_path / "store"), tokens=tmp_path / "tokens.json") as url:
        pages = {who: httpx.get(url + "/status", headers={"Authorization": f"Bearer {tokens[who]}"})
                 for who in tokens}
    assert pages["all"].status_code == 200 and 'id="node-table"' in pages["all"].text
    assert pages["team"].status_code == 200 and "node-" not in pages["team"].text and "Nodes" not in pages["team"].text

    monkeypatch.setattr(nodes, "MAX_LEASES", 3)
    with Store.open(str(tmp_path / "store")) as s:
        html = status.render_status(s)
        snap = status.source_for(s).snapshot(s)
    assert snap.leases_cut and len(snap.nodes) + snap.other_leases == 3 and "some are not shown" in html


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                    max_leaves=30)
FIELDS = ("format", "time", "cached_bytes", "fetched_bytes", "hits", "misses", "blobs", "samples")


@pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8) | JSON)
def test_any_json_is_a_record_or_a_reason(obj: object) -> None:
    try:
        fig = nodes.parse_record(json.dumps(obj).encode())
    except ValueError as e:
        assert str(e)
        return
    assert len(fig.samples) <= nodes.MAX_SAMPLES
    assert all(r >= 0 for _, r in nodes.rates(fig.samples))


def test_rates_start_over_when_a_daemon_restarts() -> None:
    samples = ((100.0, 0), (110.0, 1000), (120.0, 200), (130.0, 1200), (130.0, 1300))
    assert nodes.rates(samples) == [(110.0, 100.0), (130.0, 100.0)]


# -- a real node daemon, the page in Chromium -----------------------------------------------------
# where the end-to-end test also writes its screenshot, for a person to look at (unset: a temporary file)
SCREENSHOT = os.environ.get("LAYERSTORE_STATUS_SCREENSHOT")


@dataclass
class NodeRowSeen:
    cells: list[dict[str, str]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class NodePage(HTMLParser):
    """The node rows (cells' data-* attributes, and text) and the plot's lines."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, NodeRowSeen] = {}
        self.lines: dict[str, str] = {}
        self.svg = 0
        self._row: NodeRowSeen | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and a.get("id") == "fetch-rate":
            self.svg += 1
        if tag == "polyline" and a.get("class") == "rate":
            self.lines[a["data-node"]] = a["points"]
        if tag == "tr" and a.get("class") == "node":
            self._row = self.rows[a["data-lease"]] = NodeRowSeen()
        elif tag == "td" and self._row is not None:
            self._row.cells.append(a)

    def handle_data(self, data: str) -> None:
        if self._row is not None:
            self._row.text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None


def _latest_record(store: Store, lease_id: str) -> dict[str, object] | None:
    found = sorted(k for k in store.backend.list(f"leases/{lease_id}/") if k.rpartition("/")[2].startswith("r"))
    return json.loads(store.backend.load(found[-1])) if found else None


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, DaemonProcess, str]]:
    root = tmp_path / "store"
    with Store.open(str(root)) as s:
        s.init()
        layer = build_and_push(s, make_tree(tmp_path / "tree", big=(6 << 20,)), tmp_path / "layer.img")
    d = DaemonProcess(str(root), tmp_path / "cache", tmp_path / "mnt",
                      env={"LAYERSTORE_NODE_REPORT_INTERVAL": "0.3", "LAYERSTORE_NODE_LEASE_INTERVAL": "1"})
    try:
        d.start()
        yield root, d, layer.blob
    finally:
        d.stop()
        force_unmount(tmp_path / "mnt")


@pytest.mark.root
@pytest.mark.skipif(browser.chromium() is None, reason="chromium is not installed (make test installs it)")
def test_a_node_that_served_reads_shows_its_lease_figures_and_fetch_rate(
        node: tuple[Path, DaemonProcess, str], tmp_path: Path) -> None:
    root, daemon, blob = node
    # The layer stays open to the end: in use, so the node lease holds it while the page is read.
    with open(daemon.blob(blob), "rb") as f:
        _check_node_page(root, daemon, blob, tmp_path, f)
    assert daemon.stop() == 0  # a clean stop takes the record and the lease away
    with Store.open(str(root)) as s:
        assert list(s.backend.list(leases.LEASES)) == []


def _check_node_page(root: Path, daemon: DaemonProcess, blob: str, tmp_path: Path, f: BinaryIO) -> None:
    size = f.seek(0, 2)
    for start in range(0, size, size // 3 + 1):  # a burst, a pause, another burst: several samples see fetching
        f.seek(start)
        assert f.read(size // 3 + 1)
        time.sleep(0.8)
    def counters() -> tuple[int, int, int]:
        blobs = daemon.stats()["blobs"].values()
        return tuple(sum(b[k] for b in blobs) for k in ("fetched_bytes", "hits", "misses"))  # type: ignore[return-value]

    with Store.open(str(root)) as s:
        def published() -> bool:  # the daemon is done fetching (readahead too) and its record says so
            ls = [x for x in leases.read_leases(s.backend) if x.kind == "node"]
            rec = _latest_record(s, ls[0].id) if ls else None
            now = counters()
            return rec is not None and (rec["fetched_bytes"], rec["hits"], rec["misses"]) == now == counters()
        wait_until(published, 30, "the node's record to show what it fetched")
        fetched = counters()[0]
        (lease,) = [x for x in leases.read_leases(s.backend) if x.kind == "node"]
        record = _latest_record(s, lease.id)
    assert record is not None and keys.object_key("blobs", blob) in lease.keys

    tokens = tmp_path / "tokens.json"
    make_tokens(tokens, {"admin": ["admin"]}, anonymous=["read"])
    with threaded_service(str(root), tokens=tokens) as url:
        shot = Path(SCREENSHOT) if SCREENSHOT else tmp_path / "status-nodes.png"
        png = browser.screenshot(url + "/", shot, width=1280, height=1400)
        dom = browser.dump_dom(url + "/")
    assert browser.png_size(png) == (1280, 1400) and len(png) > 10_000
    page = NodePage(dom)
    assert list(page.rows) == [lease.id] and page.svg == 1
    row = page.rows[lease.id]
    text = " ".join(" ".join(row.text).split())
    assert lease.name in text and lease.holder in text
    held, cached, fetched_cell, hits, misses = (row.cells[i] for i in range(2, 7))
    assert int(held["data-count"]) == sum(1 for k in lease.keys if k.startswith("blobs/")) >= 1
    assert int(fetched_cell["data-bytes"]) == record["fetched_bytes"] == fetched
    assert int(cached["data-bytes"]) == record["cached_bytes"] > 0
    assert int(hits["data-count"]) == record["hits"] and int(misses["data-count"]) == record["misses"] > 0
    points = [tuple(map(float, p.split(","))) for p in page.lines[lease.name].split()]
    assert len(points) >= 3 and min(y for _, y in points) < nodes.H - nodes.BOTTOM - 1  # a rise above zero


# -- the node's side, without a kernel ------------------------------------------------------------------
@pytest.mark.trio
async def test_the_node_keeps_one_record_with_a_bounded_ring_and_removes_it_at_shutdown(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        lease = leases.Lease(s.backend, kind="node", name="n1", renew=False).open(["blobs/ab/cd/x"])
        counters = {"fetched": 0}
        clock = iter(range(1_000_000, 2_000_000, 10))

        def figures() -> report.Figures:
            counters["fetched"] += 1000
            return report.Figures(4096, counters["fetched"], 1, 2, 1)

        current: list[leases.Lease | None] = [None]
        rep = report.NodeReport(lambda: current[0], figures, name="n1", interval=10, clock=lambda: float(next(clock)))
        await rep.publish()  # no lease yet: nothing written, the sample kept
        assert _records(s, lease.id) == [] and len(rep.samples) == 1
        current[0] = lease
        for _ in range(report.MAX_SAMPLES + 5):
            await rep.publish()
        (key,) = _records(s, lease.id)  # the previous records are gone
        fig = nodes.parse_record(s.backend.load(key))
        assert len(fig.samples) == report.MAX_SAMPLES and fig.fetched_bytes == counters["fetched"]
        assert nodes.rates(fig.samples) == [(t, 100.0) for t, _ in fig.samples[1:]]  # 1000 bytes per 10 s
        (info,) = leases.read_leases(s.backend)
        assert info.keys == {"blobs/ab/cd/x"}  # the record holds nothing
        await rep.release()
        assert _records(s, lease.id) == []
        lease.release()


def _records(store: Store, lease_id: str) -> list[str]:
    return [k for k in store.backend.list(f"leases/{lease_id}/") if k.rpartition("/")[2].startswith("r")]


# -- gc's rescued and lease-kept figures ----------------------------------------------------------------
def _figure_text(html: str, name: str) -> str:
    """The value cell of the gc section's row `name`."""
    start = html.index(f'data-figure="{name}"')
    row = html[start:html.index("</tr>", start)]
    return " ".join(re.sub(r"<[^>]+>", " ", row[row.index("<td"):]).split())


def test_the_last_gc_shows_what_leases_kept_and_what_was_rescued(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        img = tmp_path / "loose.img"
        img.write_bytes(random.Random(5).randbytes(150_000))
        blob = s.put_blob(img, chunk_size=64 << 10).blob  # in no environment: only the lease keeps it
        for dirpath, _dirs, files in os.walk(tmp_path / "store"):
            for name in files:
                os.utime(os.path.join(dirpath, name), (1, 1))  # old: the grace period keeps nothing
        with leases.Lease(s.backend, kind="push", renew=False).open([keys.object_key("blobs", blob)]):
            collect(s, grace=0)
            html = status.render_status(s)
        report = last_report(s)
    assert report is not None and report["kept_lease"]["objects"] >= 4  # the blob and its chunks
    kept = report["kept_lease"]
    assert _figure_text(html, "kept_lease").startswith(f"{kept['objects']} ({status.human_bytes(kept['bytes'])})")
    assert _figure_text(html, "rescued").startswith(f"{report['rescued']['objects']} (")
    assert _figure_text(html, "kept_grace").startswith(f"{report['kept_grace']['objects']} (")

    with Store.open(str(tmp_path / "store")) as s:  # a report written by anyone with the gc scope
        s.backend.replace("gc/last-report", json.dumps({"rescued": {"objects": 2, "bytes": 3 << 20},
                                                        "kept_lease": {"objects": "<b>", "bytes": -1},
                                                        "kept_grace": [1]}).encode())
        status.source_for(s).last = None
        html = status.render_status(s)
    assert _figure_text(html, "rescued").startswith(f"2 ({status.human_bytes(3 << 20)})")
    assert _figure_text(html, "kept_lease").startswith("- (-)") and "<b>" not in html
    assert _figure_text(html, "kept_grace").startswith("- (-)")


# -- through the service: only the lease's owner writes its records ------------------------------------
@pytest.mark.trio
async def test_through_the_service_a_node_publishes_and_no_other_token_can(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(str(root)) as s:
        s.init()
    tokens = make_tokens(tmp_path / "tokens.json", {"node": ["read", "lease"], "other": ["read", "lease"]})
    with threaded_service(str(root), tokens=tmp_path / "tokens.json") as url:
        node = HttpBackend(url, token=tokens["node"], attempts=1)
        other = HttpBackend(url, token=tokens["other"], attempts=1)
        try:
            lease = await trio.to_thread.run_sync(
                lambda: leases.Lease(node, kind="node", name="n1", renew=False).open(["blobs/ab/cd/x"]))
            rep = report.NodeReport(lambda: lease, lambda: report.Figures(1 << 20, 2 << 20, 3, 4, 1), name="n1")
            await rep.publish()
            await rep.publish()
            forged = report.report_key(lease.id, 999)
            with pytest.raises(PermissionDenied):
                await trio.to_thread.run_sync(other.store_once, forged, b'{"format": 1}')
            with Store.open(str(root)) as s:
                (key,) = _records(s, lease.id)
                assert key == report.report_key(lease.id, 1)
                (row,) = status.source_for(s).snapshot(s, ttl=0).nodes
            assert row.figures is not None and row.figures.fetched_bytes == 2 << 20 and row.held == 1
            await rep.release()
            await trio.to_thread.run_sync(lease.release)
        finally:
            node.close()
            other.close()
