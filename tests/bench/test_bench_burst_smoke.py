"""Smoke tests of the cold-burst benchmark's pure parts (bench/burst/): figures and report from a fake
results file, output parsing, counters parsing, and the shaped link's set-up and tear-down. Nothing here
times anything or needs the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.burst import metrics, report, spec
from bench.burst.netlink import Link, link_addresses, tbf_args
from bench.burst.nodedisk import diskstats
from bench.burst.sandbox import SandboxResult, parse_output


def _raw(t0: float, starts: list[float], ends: list[float]) -> dict[str, Any]:
    return {"t0": t0, "t_end": t0 + max(ends), "facts": {"k": 1}, "sandboxes": [
        {"index": i, "env": "sci-networkx", "launched": t0, "started": t0 + s, "finished": t0 + e, "rc": 0,
         "task": {"imports_s": 1.0, "read_s": 0.1, "test_s": 2.0}, "error": "", "phases": {"mount_s": s / 2}}
        for i, (s, e) in enumerate(zip(starts, ends, strict=True))]}


def _measured(fetched: int, written: int) -> dict[str, Any]:
    return {"link_rx_bytes": fetched, "link_tx_bytes": 1000, "disk_write_bytes": written, "disk_read_bytes": 0,
            "mem_peak_bytes": 2 * 10**9, "mem_peak_anon_bytes": 10**9}


def fake_results() -> dict[str, Any]:
    conv = metrics.summarize(_raw(100.0, [4.0, 4.5, 5.0], [10, 11, 12]), _measured(150 * 10**6, 700 * 10**6))
    lazy_rounds = [metrics.summarize(_raw(200.0, [0.5, 0.8, 1.0], [9, 10, 13]), _measured(60 * 10**6, 60 * 10**6)),
                   metrics.summarize(_raw(300.0, [0.6, 0.9, 1.5], [9, 10, 14]), _measured(62 * 10**6, 64 * 10**6))]
    results: dict[str, Any] = {
        "size": "quick", "sandboxes": 3, "rate_mbit": 1000, "rounds": 2, "environments": {"sci-networkx": []},
        "machine": {"cpus": 2, "kernel": "6.18"}, "started": "2026-01-01T00:00:00Z",
        "read_set": {"read_bytes": 50 * 10**6, "content_bytes": 500 * 10**6, "read_fraction": 0.1,
                     "layers": {"base": {"files": 10, "content_bytes": 200, "files_read": 2, "read_bytes": 20}}},
        "contenders": {"conventional": metrics.combine([conv]), "lazy": metrics.combine(lazy_rounds),
                       "eager": {"skipped": "not available yet: layerctl run --eager"}},
        "notes": ["a note"],
    }
    metrics.add_ratios(results)
    return results


def test_summarize_and_ratios() -> None:
    r = fake_results()
    conv, lazy = r["contenders"]["conventional"], r["contenders"]["lazy"]
    assert conv["all_started_s"] == 5.0 and conv["all_finished_s"] == 12.0 and conv["failed"] == 0
    assert lazy["all_started_s"] == 1.25  # the median of the two rounds (1.0 and 1.5)
    assert len(lazy["rounds"]) == 2
    assert lazy["ratios"]["all_started_speedup"] == 4.0
    assert lazy["ratios"]["disk_write_ratio"] == round(62 / 700, 3)
    assert lazy["ratios"]["fetched_over_read"] == round(61 / 50, 3)
    goals = r["goals"]["lazy"]
    assert goals["all_started_speedup"]["met"] is True
    assert goals["disk_write_ratio"]["met"] is True
    assert goals["fetched_over_read"]["met"] is True
    assert "eager" not in r["goals"]


def test_uppers_disk_ratios() -> None:
    """The node disk without the sandboxes' directories, the uppers disk, and the old estimate by
    subtraction from the same run (both disks' writes less the uppers' allocated bytes)."""
    def one(node: int, uppers_disk: int, uppers: int) -> dict[str, Any]:
        raw = dict(_raw(0.0, [1.0], [2.0]), facts={"disk_breakdown": {"uppers": uppers}})
        return metrics.summarize(raw, dict(_measured(1, node), uppers_disk_write_bytes=uppers_disk))

    conv, lazy = one(700 * 10**6, 50 * 10**6, 40 * 10**6), one(60 * 10**6, 52 * 10**6, 40 * 10**6)
    assert lazy["disk_write_bytes_subtracted"] == 72 * 10**6
    results: dict[str, Any] = {"contenders": {"conventional": metrics.combine([conv]), "lazy": metrics.combine([lazy])}}
    metrics.add_ratios(results)
    r = results["contenders"]["lazy"]["ratios"]
    assert r["disk_write_ratio"] == round(60 / 700, 3) and r["uppers_disk_write_ratio"] == round(52 / 50, 3)
    assert r["disk_write_ratio_subtracted"] == round(72 / 710, 3)
    assert r["disk_write_ratio_charged"] == round((60 + 2) / 700, 3)  # the 2 MB more on its uppers disk
    assert metrics.charged_writes(10, 3, 5) == 10 and metrics.charged_writes(10, None, 5) is None
    assert results["contenders"]["lazy"]["rounds"][0]["uppers_disk_write_bytes"] == 52 * 10**6
    no_facts = metrics.summarize(_raw(0.0, [1.0], [2.0]), dict(_measured(1, 5), uppers_disk_write_bytes=3))
    assert "disk_write_bytes_subtracted" not in no_facts  # nothing to subtract: no figure, not a guess


def test_failed_sandbox_has_no_all_started() -> None:
    raw = _raw(0.0, [1.0, 2.0], [3.0, 4.0])
    raw["sandboxes"][1].update(started=None, rc=1, error="boom")
    s = metrics.summarize(raw, _measured(1, 1))
    assert s["failed"] == 1 and s["all_started_s"] is None and s["errors"][0]["error"] == "boom"


def test_markdown_and_docs_update(tmp_path: Path) -> None:
    results = fake_results()
    md = report.markdown(results, {"timeline": "../bench/results/burst-quick-timeline.png"})
    assert "| layerstore lazy | 1.25 |" in md
    assert "skipped: not available yet: layerctl run --eager" in md
    assert "4.00x (met)" in md and "a note" in md
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\nhand-written text\n")
    report.update_docs(doc, md, "quick")
    report.update_docs(doc, md.replace("1.25", "9.99"), "quick")  # replaced in place, not appended twice
    report.update_docs(doc, md, "full")  # each size has its own block
    text = doc.read_text()
    assert text.count(report.markers("quick")[0]) == 1 and text.count(report.markers("full")[0]) == 1
    assert "9.99" in text and "1.25" in text and "hand-written text" in text


def test_render_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    f = tmp_path / "burst-quick.json"
    f.write_text(json.dumps(fake_results()))
    section = report.render(f, tmp_path / "docs" / "benchmarks.md", tmp_path / "plots")
    assert (tmp_path / "plots" / "burst-quick-timeline.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "burst-quick-bars.png").exists()
    assert "burst-quick-bars.png" in section


def test_parse_output() -> None:
    r = SandboxResult(0, "web-jinja2", launched=1.0)
    parse_output(f"noise\n{spec.START_MARK} 1234.5\n{spec.RESULT_MARK} {{\"rc\": 0, \"files\": 3}}\n", r)
    assert r.started == 1234.5 and r.task == {"rc": 0, "files": 3}
    bad = SandboxResult(1, "web-jinja2", launched=1.0)
    parse_output(f"{spec.START_MARK} nan-ish\n{spec.RESULT_MARK} {{broken\n", bad)
    assert bad.started is None and bad.task == {}


def test_task_command_touches_three_layers() -> None:
    for env in spec.ENVIRONMENTS.values():
        cmd = spec.task_command(env)
        assert cmd[:2] == ["/bin/sh", "-c"]
        assert spec.TOOLKIT_ROOT in cmd[2] and spec.TASK_PATH in cmd[2] and spec.START_MARK in cmd[2]
    compile(spec.TASK_SCRIPT, "burst_task.py", "exec")
    plan = spec.Plan.round_robin(("a", "b", "c"), 7)
    assert plan.sandboxes == ["a", "b", "c", "a", "b", "c", "a"]


def test_counters_parsing() -> None:
    text = "   7       3 loop3 10 0 80 5 20 0 4096 9 0 0 0 0 0 0 0 0 0\n 254 0 vda 1 2 3 4 5 6 7 8 9 10 11\n"
    c = diskstats("loop3", text)
    assert (c.read_bytes, c.write_bytes, c.write_ios) == (80 * 512, 4096 * 512, 20)
    with pytest.raises(KeyError):
        diskstats("loop9", text)
    assert link_addresses(0) == ("198.18.0.1", "198.18.0.2")
    node, store = link_addresses(12345)
    assert node.startswith("198.") and node != store
    args = tbf_args(1000)
    assert args[:3] == ["tbf", "rate", "1000mbit"] and int(args[4]) >= 256 * 1024


@pytest.mark.root
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="needs root, ip and tc")
def test_link_setup_and_teardown(tmp_path: Path) -> None:
    tag = str(90000 + os.getpid() % 9999)
    link = Link(tmp_path / "state", rate_mbit=100, tag=tag)
    try:
        link.setup()
        assert link.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", link.node_if], capture_output=True, text=True).stdout
        assert "tbf" in qdisc
        c = link.counters()
        assert c.rx_bytes >= 0 and c.tx_bytes >= 0
        # the two ends talk to each other, and to nothing else
        ping = link.ns("ip", "route", "get", link.node_addr)
        assert link.store_if in ping.stdout
        assert (tmp_path / "state" / f"link-{link.netns}.json").exists()
    finally:
        link.teardown()
    assert link.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", link.node_if], capture_output=True).returncode != 0
    assert not list((tmp_path / "state").glob("link-*.json"))
