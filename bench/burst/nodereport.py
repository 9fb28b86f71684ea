"""From a burst_nodes results JSON to a Markdown section of docs/benchmarks-burst-nodes.md (between markers, replaced
in place: the hand-written analysis around it stays).

    python -m bench.burst.nodereport bench/results/burst_nodes-quick.json [--docs docs/benchmarks-burst-nodes.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .report import LABELS, fmt_mb, fmt_s, fmt_x, in_order, update_docs


def shape_markdown(label: str, sh: dict[str, Any]) -> list[str]:
    cs = sh.get("contenders", {})
    lines = [f"#### {sh['nodes']} nodes x {sh['per_node']} sandboxes ({sh['sandboxes']}), shared link "
             f"{sh['rate_mbit']:g} Mbit/s (`{label}`)", "",
             f"Load: `{sh.get('load_before', '')}` before, `{sh.get('load_after', '')}` after.", "",
             "| contender | all started (s) | all finished (s) | store bytes served (MB) | per node fetched, "
             "mean / max (MB) | node disk writes, all nodes (MB) | per node, mean (MB) | peak memory, all "
             "nodes (MB) | busiest node (MB) | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in in_order(cs):
        c = cs[name]
        if c.get("skipped"):
            lines.append(f"| {LABELS.get(name, name)} | skipped: {c['skipped']} |||||||||")
            continue
        pn = c.get("per_node", [])
        fetched = [x["fetched_bytes"] for x in pn]
        writes = [x["disk_write_bytes"] for x in pn]
        lines.append(
            f"| {LABELS.get(name, name)} | {fmt_s(c.get('all_started_s'))} | {fmt_s(c.get('all_finished_s'))} | "
            f"{fmt_mb(c.get('bytes_fetched'))} | {fmt_mb(statistics.mean(fetched) if fetched else None)} / "
            f"{fmt_mb(max(fetched) if fetched else None)} | {fmt_mb(c.get('disk_write_bytes'))} | "
            f"{fmt_mb(statistics.mean(writes) if writes else None)} | {fmt_mb(c.get('mem_peak_bytes'))} | "
            f"{fmt_mb(c.get('mem_peak_node_max_bytes'))} | {c.get('failed')}/{c.get('sandboxes')} |")
    lines += ["", "Node disk writes by owner, summed over the nodes (MB; layer data: node cache chunks, or "
              "tar.gz + extracted; rest: ext4 journal and metadata, rewrites, files deleted):", "",
              "| contender | written | layer data | cache index | uppers | runc + shim state | rest | "
              "written by the daemon / puller |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in in_order(cs):
        d = cs[name].get("disk_split")
        if d:
            up = fmt_mb(d["uppers"])
            if "uppers_disk_written" in d:
                up += f" (not on the node disk; uppers disk: {fmt_mb(d['uppers_disk_written'])} written)"
            lines.append(f"| {LABELS.get(name, name)} | {fmt_mb(d['disk_written'])} | {fmt_mb(d['layer_data'])} | "
                         f"{fmt_mb(d['cache_index'])} | {up} | {fmt_mb(d['state'])} | "
                         f"{fmt_mb(d['rest'])} | "
                         f"{fmt_mb(d['process_written'])} |")
    lines += ["", "| contender | all-started speed-up | all-finished speed-up | store bytes | disk writes | "
              "disk writes without uppers | charged with the uppers disk's excess | same, by subtraction | "
              "uppers disk writes | peak memory |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in in_order(cs):
        r = cs[name].get("ratios")
        if r:
            lines.append(f"| {LABELS.get(name, name)} | {fmt_x(r.get('all_started_speedup'))} | "
                         f"{fmt_x(r.get('all_finished_speedup'))} | {fmt_x(r.get('store_bytes_ratio'))} | "
                         f"{fmt_x(r.get('disk_write_ratio'))} | {fmt_x(r.get('disk_write_ratio_no_uppers'))} | "
                         f"{fmt_x(r.get('disk_write_ratio_charged'))} | "
                         f"{fmt_x(r.get('disk_write_ratio_subtracted'))} | "
                         f"{fmt_x(r.get('uppers_disk_write_ratio'))} | {fmt_x(r.get('mem_peak_ratio'))} |")
    goals = sh.get("goals")
    if goals:
        lines += ["", "Issue 19's goals for lazy: " + "; ".join(
            f"{k} {fmt_x(g['value'])} (target {g['target']}: "
            f"{'met' if g['met'] else '**missed**' if g['met'] is False else 'n/a'})" for k, g in goals.items())
            + "."]
    phases = []
    for name in in_order(cs):
        c = cs[name]
        if c.get("phases_median_s"):
            phases.append(f"- {LABELS.get(name, name)}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in c["phases_median_s"].items()))
    if phases:
        lines += ["", "Where a sandbox's time went (median seconds per sandbox, runner side):", "", *phases]
    return lines + [""]


def markdown(results: dict[str, Any]) -> str:
    code = results.get("code", {})
    mod = code.get("modified") or []
    lines = [f"### Cold burst at cluster shape ({results.get('size')}; provisional: shared machine)", "",
             f"Run {results.get('started')} on {results.get('machine', {}).get('cpus')} CPUs, kernel "
             f"{results.get('machine', {}).get('kernel')}, commit `{code.get('commit', '?')}`"
             + (f" (+ uncommitted changes in {', '.join(mod)})" if mod else "")
             + f". Environments: {', '.join(results.get('environments', {}))}. Machine load at the start: "
             f"`{results.get('load_at_start', '')}`; at the end: `{results.get('load_at_end', '')}`. "
             f"Raw results: `bench/results/{Path(str(results.get('output', 'burst_nodes.json'))).name}`.", ""]
    for label, sh in results.get("shapes", {}).items():
        lines += shape_markdown(label, sh)
    notes = results.get("notes") or []
    if notes:
        lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def markers_for(size: str) -> str:
    return f"nodes-{size}"


def render(results_file: Path, docs: Path | None, more: tuple[Path, ...] = ()) -> str:
    """The section of one results file, plus the shapes of `more` files of the same size (runs
    made apart, e.g. the 250 Mbit/s shapes), each shape with its own load lines."""
    results = json.loads(results_file.read_text())
    results["output"] = str(results_file)
    md = markdown(results)
    for extra in more:
        r = json.loads(extra.read_text())
        r["output"] = str(extra)
        md += "\n" + markdown(r).split("\n", 1)[1]
    if docs is not None and docs.exists():
        update_docs(docs, md, markers_for(str(results.get("size"))))
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+", help="results files of one size (the first names it)")
    ap.add_argument("--docs", type=Path, default=None)
    a = ap.parse_args(argv)
    sys.stdout.write(render(a.results[0], a.docs, tuple(a.results[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
