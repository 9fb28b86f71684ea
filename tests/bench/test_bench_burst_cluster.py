"""The pure parts of `bench/burst.py --nodes`: shapes and their parsing, how sandboxes spread over
nodes, link counters parsing, the disk split, the ratios and goals, and the report. No root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.burst import nodereport, spec
from bench.burst.cluster import parse_link_stats, subnet_octet
from bench.burst.nodes import add_cluster_ratios, disk_split

MB = 10**6


def test_shapes_parse_and_sizes() -> None:
    assert spec.Shape.parse("16x4,8x16", 4, (1000.0, 250.0)) == [
        spec.Shape(16, 4, 1000), spec.Shape(16, 4, 250), spec.Shape(8, 16, 1000), spec.Shape(8, 16, 250)]
    assert spec.Shape.parse("3", 2, (1000.0,)) == [spec.Shape(3, 2, 1000)]
    for bad in ("0", "4x0", f"{spec.MAX_NODES + 1}", "x4", "four"):
        with pytest.raises(ValueError):
            spec.Shape.parse(bad, 4, (1000.0,))
    assert spec.NODE_SIZES["quick"] == (spec.Shape(4, 4, 1000),)
    assert {s.label for s in spec.NODE_SIZES["full"]} == {"16x4@1000", "8x16@1000", "16x4@250", "8x16@250"}


def test_spread_over_nodes() -> None:
    plan = spec.Plan.round_robin(("a", "b", "c"), 16).spread(4)
    assert [len(p) for p in plan] == [4, 4, 4, 4]
    assert plan[0] == ["a", "b", "c", "a"]  # sandboxes 0, 4, 8, 12
    assert sorted(e for p in plan for e in p) == sorted(spec.Plan.round_robin(("a", "b", "c"), 16).sandboxes)


def test_tiny_environment_command() -> None:
    cmd = spec.task_command(spec.environment("tiny"))
    assert cmd[:2] == ["/bin/sh", "-c"] and spec.START_MARK in cmd[2] and spec.RESULT_MARK in cmd[2]
    assert spec.environment("web-jinja2") is spec.ENVIRONMENTS["web-jinja2"]
    with pytest.raises(KeyError):
        spec.environment("nope")


def test_link_stats_parsing() -> None:
    text = json.dumps([{"ifname": "lsbr0", "stats64": {"rx": {"bytes": 10}, "tx": {"bytes": 2000}}},
                       {"ifname": "lsp1x0", "stats64": {"rx": {"bytes": 5}, "tx": {"bytes": 700}}},
                       {"ifname": "odd"}])
    assert parse_link_stats(text) == {"lsbr0": (10, 2000), "lsp1x0": (5, 700)}
    assert parse_link_stats("") == {}
    assert all(1 <= subnet_octet(t) <= 250 for t in (0, 249, 250, 99999))


def _contender(name: str, started: float, finished: float, fetched: int, written: int, upper: int,
               data: int) -> dict[str, Any]:
    bd = ({"content": data // 4, "snapshots": data - data // 4, "uppers": upper, "runc_state": 0,
           "agent_write_bytes": data} if name == "conventional" else
          {"cache_data": data, "cache_index": MB, "uppers": upper, "shim_state": MB, "runc_state": 0,
           "daemon_write_bytes": data + MB})
    per_node = [{"disk_write_bytes": written, "facts": {"disk_breakdown": bd}, "fetched_bytes": fetched}] * 2
    return {"all_started_s": started, "all_finished_s": finished, "bytes_fetched": 2 * fetched,
            "disk_write_bytes": 2 * written, "mem_peak_bytes": 10 * MB, "per_node": per_node,
            "disk_split": disk_split(per_node, name), "sandboxes": 4, "failed": 0}


def test_disk_split_and_goals() -> None:
    conv = _contender("conventional", 20.0, 80.0, 160 * MB, 760 * MB, 10 * MB, 700 * MB)
    lazy = _contender("lazy", 1.0, 30.0, 50 * MB, 70 * MB, 10 * MB, 50 * MB)
    d = lazy["disk_split"]
    assert d["disk_written"] == 140 * MB and d["layer_data"] == 100 * MB and d["uppers"] == 20 * MB
    assert d["cache_index"] == 2 * MB and d["state"] == 2 * MB and d["process_written"] == 102 * MB
    assert d["rest"] == 140 * MB - 100 * MB - 2 * MB - 20 * MB - 2 * MB
    assert conv["disk_split"]["layer_data"] == 1400 * MB
    shape: dict[str, Any] = {"nodes": 2, "per_node": 2, "rate_mbit": 1000, "sandboxes": 4,
                             "contenders": {"conventional": conv, "lazy": lazy, "eager": {"skipped": "x"}}}
    add_cluster_ratios(shape)
    r = lazy["ratios"]
    assert r["all_started_speedup"] == 20.0 and r["store_bytes_ratio"] == round(50 / 160, 3)
    assert r["disk_write_ratio_no_uppers"] == round(120 / 1500, 3)
    g = shape["goals"]
    assert g["all_started_speedup"]["met"] is True and g["all_finished_speedup"]["met"] is True
    assert g["disk_write_ratio_no_uppers"]["met"] is True and g["store_bytes_ratio"]["met"] is True
    lazy["all_finished_s"] = 79.0
    add_cluster_ratios(shape)
    assert shape["goals"]["all_finished_speedup"]["met"] is False
    md = "\n".join(nodereport.shape_markdown("2x2@1000", shape))
    assert "| layerstore lazy | 1.00 | 79.00 |" in md and "skipped: x" in md and "**missed**" in md


def test_uppers_disk_split_and_ratios() -> None:
    """With an uppers disk the node disk's writes leave the uppers out by construction: no subtraction,
    and the old estimate (both disks less the uppers' bytes) is kept beside it."""
    conv = _contender("conventional", 20.0, 80.0, 160 * MB, 750 * MB, 10 * MB, 700 * MB)
    lazy = _contender("lazy", 1.0, 30.0, 50 * MB, 60 * MB, 10 * MB, 50 * MB)
    for c, up in ((conv, 30 * MB), (lazy, 32 * MB)):
        for x in c["per_node"]:
            x["uppers_disk_write_bytes"] = up
        c["disk_split"] = disk_split(c["per_node"], "conventional" if c is conv else "lazy")
    d = lazy["disk_split"]
    assert d["uppers_disk_written"] == 64 * MB and d["uppers"] == 20 * MB
    assert d["rest"] == 120 * MB - 100 * MB - 2 * MB - 2 * MB  # the uppers are not on the node disk
    assert d["subtracted"] == 120 * MB + 64 * MB - 20 * MB
    shape: dict[str, Any] = {"nodes": 2, "per_node": 2, "rate_mbit": 1000, "sandboxes": 4,
                             "contenders": {"conventional": conv, "lazy": lazy}}
    add_cluster_ratios(shape)
    r = lazy["ratios"]
    assert r["disk_write_ratio_no_uppers"] == round(120 / 1500, 3) == r["disk_write_ratio"]
    assert r["disk_write_ratio_subtracted"] == round(164 / (1500 + 60 - 20), 3)
    assert r["uppers_disk_write_ratio"] == round(64 / 60, 3)
    assert r["disk_write_ratio_charged"] == round((120 + 4) / 1500, 3)
    md = "\n".join(nodereport.shape_markdown("2x2@1000", shape))
    assert "uppers disk: 64.0 written" in md and f"| {r['disk_write_ratio_subtracted']:.2f}x |" in md


def test_render_into_docs(tmp_path: Path) -> None:
    results = {"size": "quick", "started": "t", "machine": {"cpus": 2, "kernel": "k"}, "code": {"commit": "c"},
               "environments": {"e": []}, "shapes": {}, "notes": ["n1"]}
    f = tmp_path / "burst_nodes-quick.json"
    f.write_text(json.dumps(results))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\nkept\n")
    md = nodereport.render(f, doc)
    nodereport.render(f, doc)  # replaced in place, not appended twice
    text = doc.read_text()
    assert "kept" in text and text.count("burst:nodes-quick:begin") == 1 and "- n1" in md
