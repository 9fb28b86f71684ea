"""From the rounds' raw samples to the figures: best and median per contender, ratios to the reference
(best/best and the median of same-round ratios), goals met or not, and the JSON document."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from . import spec
from .probes import read_ahead_of
from .spec import COLD_CPU_GOAL, GOALS, REFERENCE, S3_GOAL, SMALL_SOURCE, UNAVAILABLE, MiB

Raw = dict[str, dict[str, list[dict[str, Any]]]]  # workload -> contender -> one sample per round

NOTES = [
    "every run: fresh EROFS mount, fresh daemon, then sync + drop_caches (3), then the timed workload; "
    "`hot`: no drop, an untimed pass first, then a fresh EROFS mount",
    "MBps: best of the rounds; median_MBps: median; ratio best: best/best; paired_median: median over "
    "rounds of the same-round ratio to erofs_local (rounds interleave contenders, order rotating)",
    "_dio: EROFS mounted with -o directio (EROFS reads its backing file with direct I/O)",
    "fuse.requests: FUSE read requests the daemon answered (hits + misses); daemon_cpu_s: the daemon "
    "process's utime+stime during the run (10 ms ticks); main thread: schedstat of the trio thread; "
    "daemon_faults_per_request: the process's page faults (minor + major) per request",
    "reader_thread_ms / daemon_main_thread_ms: time on a CPU and time runnable but waiting for one "
    "(schedstat): on a shared machine every FUSE round trip adds two wake-ups that may wait",
    "fanotify: events the daemon saw during the run (fast_allowed: answered in its event thread, every "
    "chunk present; filled: after a fetch), its CPU per GB fetched; marked_at_end: the blob still marked "
    "(partial: the last data chunk not reached, or reached late)",
    "page_cache_MiB after the run: erofs = EROFS's own page cache (all files), backing = the image file "
    "or the FUSE blob file, node_cache_file = the node cache's data file of the blob",
]


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [s["seconds"] for s in samples]
    nbytes = samples[0]["bytes"]
    if any(s["bytes"] != nbytes for s in samples):
        raise RuntimeError(f"runs read different amounts of data: {[s['bytes'] for s in samples]}")
    best, med = min(secs), statistics.median(secs)
    out: dict[str, Any] = {"bytes": nbytes, "seconds": [round(s, 4) for s in secs],
                           "MBps": round(nbytes / best / 1e6, 1), "median_MBps": round(nbytes / med / 1e6, 1)}
    if "reader" in samples[0]:
        out["reader_thread_ms"] = {
            k.removesuffix("_ns"): round(statistics.median(s["reader"][k] for s in samples) / 1e6, 1)
            for k in ("cpu_ns", "wait_ns")}
    if "mount_s" in samples[0]:
        out["mount_s_median"] = round(statistics.median(s["mount_s"] for s in samples), 4)
    if "pin_s" in samples[0]:
        out["pin_s_median"] = round(statistics.median(s["pin_s"] for s in samples), 4)
        out["daemon_requests"] = max(s["daemon_requests"] for s in samples)
    if "memory" in samples[0]:
        out["page_cache_MiB"] = {k: round(statistics.median(s["memory"][k] for s in samples) / MiB, 1)
                                 for k in samples[0]["memory"]}
    if "fuse" in samples[0]:
        out["fuse"] = summarize_fuse([s["fuse"] for s in samples])
    if "daemon_probe" in samples[0]:  # --daemon-probe: each run's summary, as the tool printed it
        out["daemon_probe"] = [s["daemon_probe"] for s in samples]
    if "fanotify" in samples[0]:
        out["fanotify"] = summarize_fanotify([s["fanotify"] for s in samples])
    return out


def summarize_fanotify(f: list[dict[str, Any]]) -> dict[str, Any]:
    """The daemon's side of a fanotify run: events (answered in the event thread, after a fill,
    denied), bytes fetched, its CPU time (and per GB fetched: the cold goal)."""
    fetched = statistics.median(x["fetched"] for x in f)
    cpu = statistics.median(x["cpu_s"] for x in f)
    return {
        **{k: statistics.median(x[k] for x in f) for k in ("events", "fast_allowed", "filled", "denied")},
        "marked_at_end": [x["marked_at_end"] for x in f],
        "fetched_MiB": round(fetched / MiB, 1),
        "daemon_cpu_s": round(cpu, 3),
        "daemon_cpu_s_per_GB_fetched": round(cpu / fetched * 1e9, 3) if fetched else None,
    }


def cold_cpu_per_gb(r: dict[str, Any]) -> float | None:
    """The daemon's CPU seconds per GB fetched of a cold contender's summary (FUSE or fanotify)."""
    if "fuse" in r:
        f = r["fuse"]
        return f["daemon_cpu_s"] / (f["fetched_MiB"] * MiB) * 1e9 if f["fetched_MiB"] else None
    if "fanotify" in r:
        return r["fanotify"]["daemon_cpu_s_per_GB_fetched"]
    return None


def summarize_fuse(f: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = statistics.median(x["requests"] for x in f)
    served = statistics.median(x["served"] for x in f)
    cpu = statistics.median(x["cpu_s"] for x in f)
    return {
        "requests": reqs, "misses": statistics.median(x["misses"] for x in f),
        "mean_request_KiB": round(served / reqs / 1024, 1) if reqs else None,
        "served_MiB": round(served / MiB, 1),
        "fetched_MiB": round(statistics.median(x["fetched"] for x in f) / MiB, 1),
        "daemon_cpu_s": round(cpu, 3),
        "daemon_cpu_s_per_GB_served": round(cpu / served * 1e9, 3) if served else None,
        "daemon_main_thread_us_per_request": round(statistics.median(x["main_cpu_ns"] for x in f) / reqs / 1e3, 1)
        if reqs else None,
        "daemon_main_thread_ms": {"cpu": round(statistics.median(x["main_cpu_ns"] for x in f) / 1e6, 1),
                                  "wait": round(statistics.median(x["main_wait_ns"] for x in f) / 1e6, 1)},
        "daemon_faults_per_request": round(statistics.median(x["faults"] for x in f) / reqs, 2)
        if reqs and all("faults" in x for x in f) else None,
    }


def ratios(results: dict[str, dict[str, Any]], raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per contender: best/best, and the median of same-round ratios, to the reference."""
    ref = results.get(REFERENCE)
    if ref is None:
        return {}
    out = {}
    for c, r in results.items():
        paired = [raw[REFERENCE][k]["seconds"] / s["seconds"] for k, s in enumerate(raw[c]) if k < len(raw[REFERENCE])]
        out[c] = {"best": round(r["MBps"] / ref["MBps"], 3), "paired_median": round(statistics.median(paired), 3)}
    return out


def figures(rw: Raw) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, ratios) per workload; every contender must have read the same bytes."""
    res = {w: {c: summarize(s) for c, s in per.items()} for w, per in rw.items()}
    for w, per in res.items():
        sizes = {r["bytes"] for r in per.values()}
        if len(sizes) > 1:
            raise RuntimeError(f"{w}: contenders read different amounts of data: {sizes}")
    return res, {w: ratios(res[w], rw[w]) for w in res}


def goals(ratio: dict[str, Any], s3: dict[str, Any] | None, s3_rates: list[float],
          results: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w, per in (results or {}).items():  # cold: the daemon's CPU per GB fetched, fanotify vs FUSE
        fuse, fan = per.get("fuse_cold"), per.get("fanotify_cold")
        a, b = (cold_cpu_per_gb(fuse), cold_cpu_per_gb(fan)) if fuse and fan else (None, None)
        if a and b is not None:
            out[f"cold_cpu_{w}"] = {"need_at_most": COLD_CPU_GOAL, "fuse_cpu_s_per_GB": round(a, 3),
                                    "fanotify_cpu_s_per_GB": round(b, 3), "fraction": round(b / a, 3),
                                    "met": b / a <= COLD_CPU_GOAL}
    for label, link in (s3 or {}).get("links", {}).items():
        cpu = link["cpu_s_per_GB_median"]
        if "fanotify_cold_cpu_s_per_GB" in cpu:
            a, b = cpu["cold_cpu_s_per_GB"]["daemon"], cpu["fanotify_cold_cpu_s_per_GB"]["daemon"]
            out[f"cold_cpu_s3_{label}"] = {"need_at_most": COLD_CPU_GOAL, "fuse_cpu_s_per_GB": a,
                                           "fanotify_cpu_s_per_GB": b, "fraction": round(b / a, 3) if a else None,
                                           "met": bool(a) and b / a <= COLD_CPU_GOAL}
    goal_table = dict(GOALS)
    for rate in s3_rates:
        goal_table[f"cold_s3_{rate:g}mbit"] = ("s3", f"{rate:g}mbit", S3_GOAL)
    for name, (w, c, need) in goal_table.items():
        if w == "s3":
            if s3 is not None and c in s3["links"]:
                r3 = s3["links"][c]
                out[name] = {"need": need, "ratio_paired_median": r3["ratio_paired_median"],
                             "ratio_best": r3["ratio_best"], "met": r3["ratio_paired_median"] >= need}
        elif c in ratio.get(w, {}):
            r = ratio[w][c]
            out[name] = {"need": need, "ratio_paired_median": r["paired_median"], "ratio_best": r["best"],
                         "met": r["paired_median"] >= need}
    return out


def document(args: argparse.Namespace, work: Path, *, env: dict[str, str], images: dict[str, Any],
             results: dict[str, Any], ratio: dict[str, Any], hot_results: dict[str, Any], hot_ratio: dict[str, Any],
             hit_kernel: list[dict[str, Any]], hit_handler: list[dict[str, Any]], s3: dict[str, Any] | None,
             goal_met: dict[str, Any], load_start: tuple[float, float, float], duration_s: float) -> dict[str, Any]:
    return {
        "benchmark": "read",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "disk_read_ahead_kb": read_ahead_of(work)},
        "params": {"size": args.size, "big_mib": args.big_mib, "reps": args.reps,
                   "s3_mib": args.s3_mib if args.s3 else None, "s3_rates_mbit": args.s3_rates if args.s3 else None,
                   "small_source": str(SMALL_SOURCE),
                   "contenders": args.contenders, "workloads": args.workloads, "daemon_env": env,
                   "daemon_args": spec.DAEMON_ARGS},
        "images": images,
        "reference": REFERENCE,
        "results": results,
        "ratio_to_erofs_local": ratio,
        "hot": {"results": hot_results, "ratio_to_erofs_local": hot_ratio},
        "hit_path": {"through_kernel": hit_kernel, "handler_alone": hit_handler},
        "s3": s3,
        "goals": goal_met,
        "unavailable": UNAVAILABLE,
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "duration_s": duration_s,
        "notes": NOTES,
    }


def write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"ratio_to_erofs_local": doc["ratio_to_erofs_local"], "hot": doc["hot"]["ratio_to_erofs_local"],
                      "goals": doc["goals"]}, indent=1))
    print(f"results written to {out}")


def print_round(rnd: int, workload: str, label: str, r: dict[str, Any], *, requests: bool = True) -> None:
    extra = f", {r['fuse']['requests']} requests" if requests and "fuse" in r else ""
    print(f"round {rnd} {workload:9s} {label:16s} {r['bytes'] / r['seconds'] / 1e6:8.1f} MB/s{extra}", flush=True)


def print_hit_path(hit_kernel: list[dict[str, Any]], hit_handler: list[dict[str, Any]]) -> None:
    for h in hit_kernel:
        print(f"hit path through the kernel, {h['block']:>7} B: {h['wall_us_per_request']:.1f} us/request wall, "
              f"daemon CPU {h['daemon_cpu_us_per_request']:.1f} us/request", flush=True)
    for h in hit_handler:
        print(f"read handler alone, {h['block']:>7} B: {h['handler_us']:.2f} us (a pread of it: "
              f"{h['pread_of_the_same_range_us']:.2f} us)", flush=True)
