"""The store service's status page (`service/status.py`, docs/status-page.md): a store filled with
layers that share chunks, environments (one of them private), a real garbage collection run, a
loose layer and an unreferenced chunk; the page shows each row and figure, hides what the caller
may not see, survives damaged objects and a hostile gc report, and re-reads only new chunk maps.
Headless Chromium loads it from the service's own app as an anonymous reader: a real PNG
screenshot, and the DOM as the browser built it shows the expected rows (and not the private
ones)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layergc import collect
from testkit import browser
from testkit.store_service import make_tokens, threaded_service

import service.status as status
from layerstore import digest as digestmod
from layerstore import keys
from layerstore.errors import LayerstoreError
from layerstore.store import Store
from manifest.environment import build_manifest, create_environment, load_manifest

CHUNK = 64 * 1024


@dataclass
class Filled:
    root: Path
    blobs: dict[str, str]  # name -> blob digest
    envs: dict[str, list[str]]  # ref -> layer names
    segments: dict[str, bytes]
    layer_segments: dict[str, list[str]]

    def store(self) -> Store:
        return Store.open(str(self.root))

    def size(self, layer: str) -> int:
        return sum(len(self.segments[s]) for s in self.layer_segments[layer])

    def stored_size(self, seg: str) -> int:
        return os.path.getsize(self.root / keys.object_key("chunks", digestmod.of(self.segments[seg])))


def _put(store: Store, tmp: Path, name: str, data: bytes) -> str:
    path = tmp / f"{name}.img"
    path.write_bytes(data)
    return store.put_blob(path, chunk_size=CHUNK).blob


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Filled:
    tmp = tmp_path_factory.mktemp("status")
    rnd = random.Random(17)
    segs = {f"s{i}": rnd.randbytes(CHUNK) for i in (1, 2, 3, 5, 6, 7)}
    segs["zeros"] = bytes(CHUNK)  # compresses to almost nothing
    segs["tail"] = rnd.randbytes(1000)
    layer_segments = {"base": ["s1", "s2", "s3", "zeros"], "toolkit": ["s1", "s2", "s5"], "work": ["s6", "tail"],
                      "private": ["s7"], "loose": ["s3"]}
    envs = {"team/app:v1": ["base", "toolkit", "work"], "team/app:v2": ["base", "toolkit"],
            "secret/x:v1": ["base", "private"]}
    root = tmp / "store"
    blobs: dict[str, str] = {}
    with Store.open(str(root)) as s:
        s.init()
        for name in ("base", "toolkit", "work", "private"):
            blobs[name] = _put(s, tmp, name, b"".join(segs[x] for x in layer_segments[name]))
        for ref, layers in envs.items():
            roles = dict(zip(layers, ["base", *(["toolkit"] * (len(layers) - 2)), "workspace"], strict=True))
            if ref == "team/app:v2":
                roles = {"base": "base", "toolkit": "toolkit"}
            m = build_manifest(s, base=blobs[layers[0]],
                               toolkits=[blobs[n] for n in layers if roles[n] == "toolkit"],
                               workspace=next((blobs[n] for n in layers if roles[n] == "workspace"), None))
            create_environment(s, m, ref)
        s.put_chunk(rnd.randbytes(5000))  # referenced by nothing: the gc run deletes it
    # File times tick coarsely: an object of the collector's own tick is young even with grace 0.
    for dirpath, _dirs, files in os.walk(root / "chunks"):
        for name in files:
            os.utime(os.path.join(dirpath, name), (1, 1))
    with Store.open(str(root)) as s:
        collect(s, grace=0)
    with Store.open(str(root)) as s:
        blobs["loose"] = _put(s, tmp, "loose", segs["s3"])  # after the run: in no environment
        s.put_chunk(rnd.randbytes(3000))  # unreferenced, not collected yet
    return Filled(root, blobs, envs, segs, layer_segments)


# -- reading the page back -------------------------------------------------------------------------
class Page(HTMLParser):
    """Rows by kind (env / layer / figure) with their attributes and text, and the gc section."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.envs: dict[str, str] = {}
        self.layers: dict[str, str] = {}
        self.figures: dict[str, dict[str, object]] = {}
        self.scripts = 0
        self._row: tuple[str, str] | None = None
        self._text: list[str] = []
        self._bytes: list[int] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "tr" and a.get("class") == "env":
            self._row = ("env", a["data-ref"] or "")
        elif tag == "tr" and a.get("class") == "layer":
            self._row = ("layer", a["data-blob"] or "")
        elif tag == "tr" and a.get("data-figure"):
            self._row = ("figure", a["data-figure"] or "")
        if self._row is not None and a.get("data-bytes") is not None:
            self._bytes.append(int(a["data-bytes"] or 0))

    def handle_data(self, data: str) -> None:
        if self._row is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None:
            kind, key = self._row
            text = " ".join(" ".join(self._text).split())
            if kind == "env":
                self.envs[key] = text
            elif kind == "layer":
                self.layers[key] = text
            else:
                self.figures[key] = {"text": text, "bytes": self._bytes[0] if self._bytes else None}
            self._row, self._text, self._bytes = None, [], []


def expected_figures(f: Filled) -> dict[str, int]:
    in_layers = {seg for segs in f.layer_segments.values() for seg in segs}
    logical = sum(f.size(name) for name in f.layer_segments)
    unique = sum(len(f.segments[s]) for s in in_layers)
    stored = sum(f.stored_size(s) for s in in_layers)
    return {"logical": logical, "unique": unique, "stored": stored, "saved": logical - stored}


def check_page(page: Page, f: Filled, *, private_visible: bool) -> None:
    refs = sorted(r for r in f.envs if private_visible or not r.startswith("secret/"))
    assert sorted(page.envs) == refs
    app_v1 = page.envs["team/app:v1"]
    assert "base" in app_v1 and "toolkit" in app_v1 and "workspace" in app_v1
    total = f.size("base") + f.size("toolkit") + f.size("work")
    assert status.human_bytes(total) in app_v1
    layers = {n for n in f.blobs if private_visible or n != "private"}
    assert set(page.layers) == {f.blobs[n] for n in layers}
    base = page.layers[f.blobs["base"]]
    assert "team/app:v1" in base and "team/app:v2" in base and ("secret/x:v1" in base) == private_visible
    assert "base" in base and " 4 " in f" {base} "  # four chunks
    # the base shares s1, s2 with the toolkit and s3 with the loose layer: 3 of its 4 chunks
    assert f"{status.human_bytes(3 * CHUNK)} (75.0%)" in base
    assert "no environment" in page.layers[f.blobs["loose"]]
    want = expected_figures(f)
    for name, value in want.items():
        assert page.figures[name]["bytes"] == value, (name, page.figures[name], want)
    unref = page.figures["unreferenced"]
    assert unref["bytes"] == os.path.getsize(_only_unreferenced_chunk(f)) and "1 object(s)" in str(unref["text"])
    assert page.figures["deleted"]["text"].startswith("objects deleted 1 ")  # the 5000-byte orphan
    assert page.figures["kind"]["text"] == "kind collection"
    assert "UTC" in str(page.figures["started"]["text"]) and "UTC" in str(page.figures["finished"]["text"])
    assert page.scripts == 0


def _only_unreferenced_chunk(f: Filled) -> Path:
    referenced = {keys.object_key("chunks", digestmod.of(b)) for b in f.segments.values()}
    found = [p for p in (f.root / "chunks").rglob("*") if p.is_file()
             and p.relative_to(f.root).as_posix() not in referenced]
    assert len(found) == 1, found
    return found[0]


# -- the page, rendered ------------------------------------------------------------------------------
def test_the_page_shows_environments_layers_deduplication_and_the_last_gc(filled: Filled) -> None:
    with filled.store() as s:
        check_page(Page(status.render_status(s)), filled, private_visible=True)


def test_names_the_caller_may_not_see_are_not_on_the_page(filled: Filled) -> None:
    with filled.store() as s:
        html = status.render_status(s, visible=lambda name: not name.startswith("secret/"))
    check_page(Page(html), filled, private_visible=False)
    assert "secret" not in html and filled.blobs["private"] not in html


def test_a_refresh_reads_only_new_chunk_maps_and_lists_chunks_only_now_and_then(
        filled: Filled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    shutil.copytree(filled.root, root)
    monkeypatch.setattr(status, "SNAPSHOT_TTL", 0.0)
    with Store.open(str(root)) as s:
        reads: list[str] = []
        listings: list[str] = []
        real_map, real_list = s.get_chunk_map, s.backend.list_info
        monkeypatch.setattr(s, "get_chunk_map", lambda blob: reads.append(blob) or real_map(blob))
        monkeypatch.setattr(s.backend, "list_info", lambda prefix="": listings.append(prefix) or real_list(prefix))

        def figure(page: Page, name: str) -> int:
            value = page.figures[name]["bytes"]
            assert isinstance(value, int)
            return value

        first = Page(status.render_status(s))
        assert sorted(reads) == sorted(filled.blobs.values()) and listings == ["chunks/"]
        reads.clear()
        new_segment = random.Random(3).randbytes(CHUNK)
        extra = _put(s, tmp_path, "extra", filled.segments["s5"] + new_segment)
        second = Page(status.render_status(s))
        assert reads == [extra] and listings == ["chunks/"]  # no new listing: the new chunk's size is asked
        assert figure(second, "logical") == figure(first, "logical") + 2 * CHUNK
        assert figure(second, "unique") == figure(first, "unique") + CHUNK
        new_object = root / keys.object_key("chunks", digestmod.of(new_segment))
        assert figure(second, "stored") == figure(first, "stored") + new_object.stat().st_size
        assert figure(second, "unreferenced") == figure(first, "unreferenced")  # as of the last listing

        s.backend.delete(keys.object_key("blobs", extra))
        s.backend.delete(keys.object_key("blobs", filled.blobs["loose"]))
        monkeypatch.setattr(status, "LISTING_TTL", 0.0)
        third = Page(status.render_status(s))
        assert reads == [extra] and listings == ["chunks/", "chunks/"]
        assert extra not in third.layers and filled.blobs["loose"] not in third.layers
        assert figure(third, "logical") == figure(first, "logical") - CHUNK
        assert figure(third, "unique") == figure(first, "unique")  # s3 is still the base's
        assert figure(third, "stored") == figure(first, "stored")
        # the extra layer's own chunk is referenced by nothing now
        assert figure(third, "unreferenced") == figure(first, "unreferenced") + new_object.stat().st_size


def test_damaged_objects_and_a_hostile_gc_report_do_not_break_the_page(filled: Filled, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(filled.root, root)
    with Store.open(str(root)) as s:
        path = root / keys.object_key("blobs", filled.blobs["toolkit"])
        path.write_bytes(path.read_bytes()[:-3] + b"xyz")  # the toolkit's chunk map fails to decode
        manifest = s.get_tag("team/app:v2")
        mpath = root / keys.object_key("manifests", manifest)
        mpath.write_bytes(mpath.read_bytes()[:-1] + b"\x00")
        (root / keys.object_key("chunks", digestmod.of(filled.segments["tail"]))).unlink()  # the workspace's
        s.backend.replace("tags/team/bad:v1", b"not a digest\n")  # a tag that holds garbage
        (root / "tags" / "Not A Tag").write_bytes(manifest.encode())  # a stray name under tags/
        s.backend.replace("gc/last-report", json.dumps({
            "started": "<script>alert(1)</script>", "finished": 1e300, "dry_run": "<b>yes</b>",
            "marked": {"objects": "<img src=x onerror=alert(1)>"}, "deleted": {"objects": [1, 2], "bytes": "lots"},
            "note": "<img src=x onerror=alert(1)>",
        }).encode())
        html = status.render_status(s)
        map_error = _error_of(lambda: s.get_chunk_map(filled.blobs["toolkit"]))
        manifest_error = _error_of(lambda: load_manifest(s, manifest))
    page = Page(html)
    assert page.scripts == 0 and "<img" not in html and "<b>" not in html
    assert page.figures["marked"]["text"] == "objects marked (kept) -"
    assert page.figures["deleted"]["text"] == "objects deleted - (-)"
    assert set(page.envs) == set(filled.envs) | {"team/bad:v1", "Not A Tag"}
    assert "does not hold a manifest digest" in page.envs["team/bad:v1"]
    assert "not a tag reference" in page.envs["Not A Tag"]
    assert manifest_error in page.envs["team/app:v2"] and "toolkit" not in page.envs["team/app:v2"]
    assert map_error in page.layers[filled.blobs["toolkit"]]
    assert "toolkit" in page.layers[filled.blobs["toolkit"]]  # its role, from the manifests that still read
    assert page.figures["started"]["text"] == "started -" and page.figures["finished"]["text"] == "finished -"
    assert "1 chunk(s) missing from the store" in str(page.figures["stored"]["text"])

    with Store.open(str(root)) as s:
        s.backend.replace("gc/last-report", b"[not json")
        html = status.render_status(s)
    assert "cannot be read" in html and "not JSON" in html


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
REPORT_KEYS = ("started", "finished", "dry_run", "deleted", "marked", "deleted_objects", "deleted_bytes",
               "marked_objects")


@pytest.fixture(scope="module")
def scratch(filled: Filled, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("scratch") / "store"
    shutil.copytree(filled.root, root)
    with Store.open(str(root)) as s:
        yield s


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(report=st.dictionaries(st.sampled_from(REPORT_KEYS) | st.text(max_size=8), JSON, max_size=8)
       | JSON | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_any_gc_report_renders(scratch: Store, report: object) -> None:
    """`gc/` is written by whoever holds the gc scope: whatever is there, the page renders."""
    raw = report.encode() if isinstance(report, str) else json.dumps(report).encode()
    scratch.backend.replace("gc/last-report", raw)
    status.source_for(scratch).last = None  # a fresh snapshot
    html = status.render_status(scratch)
    assert "Last garbage collection" in html and Page(html).scripts == 0


def _error_of(fn: Callable[[], object]) -> str:
    with pytest.raises(LayerstoreError) as ei:
        fn()
    return str(ei.value)


# -- in a browser ------------------------------------------------------------------------------------
@pytest.fixture
def served_page(filled: Filled, tmp_path: Path) -> Iterator[str]:
    """The service's own app (route `/`, its auth) on a loopback port, in this process: anonymous
    callers may read, names under `secret/` are private."""
    tokens = tmp_path / "tokens.json"
    make_tokens(tokens, {"admin": ["admin"]}, private=["secret/"], anonymous=["read"])
    with threaded_service(str(filled.root), tokens=tokens) as url:
        yield url + "/"


def _png_pixels_vary(png: bytes) -> bool:
    """Whether the decoded image has more than a couple of distinct byte values (not blank)."""
    pos, idat = 8, b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind = png[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(idat))) > 8


@pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
@pytest.mark.skipif(browser.chromium() is None, reason="chromium is not installed (make test installs it)")
def test_headless_chromium_shows_the_page(served_page: str, filled: Filled, tmp_path: Path) -> None:
    png = browser.screenshot(served_page, tmp_path / "status.png", width=1280, height=1600)
    assert browser.png_size(png) == (1280, 1600)
    assert 10_000 < len(png) < 20_000_000 and _png_pixels_vary(png)
    dom = browser.dump_dom(served_page)
    assert "<title>layerstore: store status</title>" in dom
    check_page(Page(dom), filled, private_visible=False)
