"""From raw sandbox results and counters to the figures the report shows. Pure logic, no I/O."""

from __future__ import annotations

import statistics
from typing import Any

BASELINE = "conventional"
LAZY = "lazy"
LAZY_VARIANTS = ("lazy", "lazy-prefetch", "lazy-noreadahead", "lazy-cli")
GOALS = {
    "all_started_speedup_min": 4.0,  # lazy >= 4x faster than the conventional path to all-started
    "disk_write_ratio_max": 0.10,  # lazy writes <= 1/10 of the conventional path's bytes
    "fetched_over_read_max": 1.5,  # lazy fetches <= 1.5x the bytes the tasks read
}
# The CRI pair (issue 31): cri-layerstore against cri-overlayfs at 1 Gbit/s, and PullImage alone.
CRI_GOALS = {"all_started_speedup_min": 3.0, "all_finished_speedup_min": 1.0, "pull_s_max": 1.0}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def summarize(raw: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    t0 = float(raw["t0"])
    boxes = raw["sandboxes"]
    started = [b["started"] - t0 for b in boxes if b.get("started") is not None]
    finished = [b["finished"] - t0 for b in boxes if b.get("finished") is not None]
    failed = [b for b in boxes if not (b.get("rc") == 0 and b.get("started") is not None and not b.get("error"))]
    n = len(boxes)
    out: dict[str, Any] = {
        "sandboxes": n,
        "failed": len(failed),
        "all_started_s": round(max(started), 3) if len(started) == n and n else None,
        "all_finished_s": round(max(finished), 3) if len(finished) == n and n else None,
        "p50_started_s": _round(_pct(started, 0.5)),
        "p50_finished_s": _round(_pct(finished, 0.5)),
        "first_started_s": _round(min(started)) if started else None,
        "started_s": sorted(round(s, 3) for s in started),
        "finished_s": sorted(round(f, 3) for f in finished),
        "bytes_fetched": measured.get("link_rx_bytes"),
        **measured,
    }
    tasks = [b["task"] for b in boxes if b.get("task")]
    if tasks:
        for k in ("imports_s", "read_s", "test_s"):
            vals = [float(t[k]) for t in tasks if k in t]
            if vals:
                out[f"task_{k}_median"] = round(statistics.median(vals), 3)
    phases: dict[str, list[float]] = {}
    for b in boxes:
        for k, v in (b.get("phases") or {}).items():
            phases.setdefault(k, []).append(float(v))
    out["phases_median_s"] = {k: round(statistics.median(v), 3) for k, v in phases.items()}
    out["phases_max_s"] = {k: round(max(v), 3) for k, v in phases.items()}
    if failed:
        out["errors"] = [{"index": b["index"], "env": b["env"], "rc": b.get("rc"), "error": b.get("error", "")[-600:]}
                         for b in failed[:5]]
    out["facts"] = raw.get("facts", {})
    sub = subtracted_writes(out.get("disk_write_bytes"), out.get("uppers_disk_write_bytes"), out["facts"])
    if sub is not None:
        out["disk_write_bytes_subtracted"] = sub
    return out


def subtracted_writes(node: int | None, uppers_disk: int | None, facts: dict[str, Any]) -> int | None:
    """The old estimate of node disk writes without the uppers, from the same run: what both disks
    wrote (as if the uppers had been on the node disk) less the uppers' allocated bytes summed at
    each sandbox's end. It misses the journal, metadata and deleted files the tasks cause, which
    the uppers disk now takes by construction."""
    uppers = ((facts or {}).get("disk_breakdown") or {}).get("uppers")
    if not isinstance(node, int) or not isinstance(uppers_disk, int) or not isinstance(uppers, int):
        return None
    return node + uppers_disk - uppers


def charged_writes(node: Any, uppers_disk: Any, base_uppers_disk: Any) -> int | None:
    """Node disk writes charged with what a contender wrote on the uppers disk beyond the baseline's
    (the shim's per-sandbox records, syncs and deletions land there too): the conservative reading."""
    if not all(isinstance(x, int) for x in (node, uppers_disk, base_uppers_disk)):
        return None
    return node + max(0, uppers_disk - base_uppers_disk)


ROUND_KEYS = ("all_started_s", "all_finished_s", "p50_started_s", "p50_finished_s", "bytes_fetched",
              "registry_bytes", "store_bytes",
              "disk_write_bytes", "uppers_disk_write_bytes", "disk_write_bytes_subtracted", "mem_peak_bytes",
              "mem_peak_anon_bytes", "failed", "machine_cpu_busy_s",
              "loadavg_before", "loadavg_after")


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds of one contender: the median of every figure (the machine is shared, and other
    work on it comes and goes), the timeline of the median round, and each round's key figures."""
    if len(rounds) == 1:
        return {**rounds[0], "rounds": [{k: rounds[0].get(k) for k in ROUND_KEYS}]}
    ok = [r for r in rounds if r.get("all_started_s") is not None] or rounds
    mid = sorted(ok, key=lambda r: r.get("all_started_s") or 0)[(len(ok) - 1) // 2]
    out = dict(mid)
    for k, v in mid.items():
        vals = [r.get(k) for r in rounds]
        if isinstance(v, int | float) and not isinstance(v, bool) and all(isinstance(x, int | float) for x in vals):
            med = statistics.median(vals)  # type: ignore[type-var]
            out[k] = int(round(med)) if all(isinstance(x, int) for x in vals) else round(med, 3)
    out["failed"] = max(int(r.get("failed") or 0) for r in rounds)
    out["rounds"] = [{k: r.get(k) for k in ROUND_KEYS} for r in rounds]
    return out


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def add_ratios(results: dict[str, Any]) -> None:
    """Ratios against the conventional path, bytes fetched against bytes read, and the goals."""
    contenders = results.get("contenders", {})
    base = contenders.get(BASELINE)
    read_bytes = (results.get("read_set") or {}).get("read_bytes")
    for c in contenders.values():
        if c.get("skipped"):
            continue
        r: dict[str, float | None] = {}
        if base and not base.get("skipped"):
            r["all_started_speedup"] = _ratio(base.get("all_started_s"), c.get("all_started_s"))
            r["all_finished_speedup"] = _ratio(base.get("all_finished_s"), c.get("all_finished_s"))
            r["disk_write_ratio"] = _ratio(c.get("disk_write_bytes"), base.get("disk_write_bytes"))
            if "uppers_disk_write_bytes" in c:  # the node disk held no uppers: the ratio above leaves them out
                r["uppers_disk_write_ratio"] = _ratio(c.get("uppers_disk_write_bytes"),
                                                      base.get("uppers_disk_write_bytes"))
                r["disk_write_ratio_subtracted"] = _ratio(c.get("disk_write_bytes_subtracted"),
                                                          base.get("disk_write_bytes_subtracted"))
                r["disk_write_ratio_charged"] = _ratio(
                    charged_writes(c.get("disk_write_bytes"), c.get("uppers_disk_write_bytes"),
                                   base.get("uppers_disk_write_bytes")), base.get("disk_write_bytes"))
            r["bytes_fetched_ratio"] = _ratio(c.get("bytes_fetched"), base.get("bytes_fetched"))
            r["mem_peak_ratio"] = _ratio(c.get("mem_peak_bytes"), base.get("mem_peak_bytes"))
        r["fetched_over_read"] = _ratio(c.get("bytes_fetched"), read_bytes)
        c["ratios"] = r
    goals: dict[str, Any] = {}
    for name in LAZY_VARIANTS:
        c = contenders.get(name)
        if not c or c.get("skipped") or "ratios" not in c:
            continue
        r = c["ratios"]
        goals[name] = {
            "all_started_speedup": _goal(r.get("all_started_speedup"), GOALS["all_started_speedup_min"], ">="),
            "disk_write_ratio": _goal(r.get("disk_write_ratio"), GOALS["disk_write_ratio_max"], "<="),
            "fetched_over_read": _goal(r.get("fetched_over_read"), GOALS["fetched_over_read_max"], "<="),
        }
    results["goals"] = goals
    containerd = _containerd_goal(contenders)
    if containerd:
        results["goals_containerd"] = containerd
    cri = _cri_goal(contenders)
    if cri:
        results["goals_cri"] = cri


def _cri_goal(contenders: dict[str, Any]) -> dict[str, Any]:
    """cri-layerstore against cri-overlayfs: all-started at least 3x ahead, all-finished no later."""
    ls, ov = contenders.get("cri-layerstore"), contenders.get("cri-overlayfs")
    if not (ls and ov and not ls.get("skipped") and not ov.get("skipped")):
        return {}
    out: dict[str, Any] = {}
    for key, target in (("all_started", CRI_GOALS["all_started_speedup_min"]),
                        ("all_finished", CRI_GOALS["all_finished_speedup_min"])):
        value = _ratio(ov.get(f"{key}_s"), ls.get(f"{key}_s"))
        ls.setdefault("ratios", {})[f"{key}_speedup_vs_cri"] = value
        out[f"{key}_speedup_vs_cri"] = _goal(value, target, ">=")
    for key in ("disk_write_bytes", "bytes_fetched", "registry_bytes", "mem_peak_bytes"):
        out[f"{key}_ratio_vs_cri"] = {"value": _ratio(ls.get(key), ov.get(key)), "target": "", "met": None}
    return out


def summarize_pulls(raw: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """PullImage alone (crinode.CriNode.time_pulls): every pull, their median and range, per image too,
    and the first round's apart (the first pull of an image on the node: nothing of it known yet)."""
    pulls = raw.get("pulls") or []
    times = [float(p["pull_s"]) for p in pulls if p.get("pull_s") is not None]
    first = [float(p["pull_s"]) for p in pulls if p.get("pull_s") is not None and p.get("round") == 1]
    per_env: dict[str, list[float]] = {}
    for p in pulls:
        if p.get("pull_s") is not None:
            per_env.setdefault(p["env"], []).append(float(p["pull_s"]))
    return {
        "pulls": pulls, "failed": sum(1 for p in pulls if p.get("error")),
        **_spread(times),
        "per_env": {env: _spread(v) for env, v in per_env.items()},
        "first_round_median_s": _round(statistics.median(first)) if first else None,
        "left_snapshots": sum(int(p.get("snapshots_left") or 0) for p in pulls),
        **{k: v for k, v in measured.items() if k.endswith("_bytes") or k.startswith(("loadavg", "machine_cpu"))},
        "facts": raw.get("facts", {}),
    }


def _spread(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "median_s": _round(statistics.median(values)) if values else None,
            "min_s": _round(min(values)) if values else None, "max_s": _round(max(values)) if values else None}


def pull_goal(pulls: dict[str, Any]) -> dict[str, Any]:
    """PullImage of the layerstore image under a second (median), and how far ahead of overlayfs's."""
    ls, ov = pulls.get("cri-layerstore") or {}, pulls.get("cri-overlayfs") or {}
    median = ls.get("median_s")
    return {"layerstore_median_s": _goal(median, CRI_GOALS["pull_s_max"], "<="),
            "layerstore_first_round_s": _goal(ls.get("first_round_median_s"), CRI_GOALS["pull_s_max"], "<="),
            "speedup_vs_overlayfs": _ratio(ov.get("median_s"), median)}


def _containerd_goal(contenders: dict[str, Any]) -> dict[str, Any]:
    """The layerstore snapshotter against containerd's own pull (overlayfs), at least as far ahead as
    the layerstore shim (lazy) is ahead of the conventional path, on time to all-started and
    all-finished."""
    ls, ov = contenders.get("containerd-layerstore"), contenders.get("containerd-overlayfs")
    lazy, conv = contenders.get("lazy"), contenders.get(BASELINE)
    if not all(c and not c.get("skipped") for c in (ls, ov)):
        return {}
    assert ls is not None and ov is not None
    out: dict[str, Any] = {}
    for key in ("all_started_s", "all_finished_s"):
        ours = _ratio(ov.get(key), ls.get(key))
        ref = _ratio(conv.get(key), lazy.get(key)) if lazy and conv and not lazy.get("skipped") else None
        ls.setdefault("ratios", {})[f"{key[:-2]}_speedup_vs_containerd"] = ours
        out[f"{key[:-2]}_speedup_vs_containerd"] = {"value": ours, "target": f">= {ref} (lazy vs conventional)",
                                                     "met": None if ours is None or ref is None else ours >= ref}
    out["disk_write_ratio_vs_containerd"] = {
        "value": _ratio(ls.get("disk_write_bytes"), ov.get("disk_write_bytes")), "target": "", "met": None}
    out["bytes_fetched_ratio_vs_containerd"] = {
        "value": _ratio(ls.get("bytes_fetched"), ov.get("bytes_fetched")), "target": "", "met": None}
    return out


def _goal(value: float | None, target: float, op: str) -> dict[str, Any]:
    met = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"value": value, "target": f"{op} {target}", "met": met}
