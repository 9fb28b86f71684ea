"""From the rounds to the document: medians over rounds, each round's headline figures, the verdicts
against the goals, and the summary printed at the end."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .spec import GOALS, GOALS_VS_PLAIN, log


def median_results(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers: median over the rounds; everything else from the first round."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = median_results([r[k] for r in rounds if isinstance(r.get(k), dict)])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = round(statistics.median(r[k] for r in rounds if isinstance(r.get(k), (int, float))), 3)
        else:
            out[k] = v
    return out


def per_round(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each round's headline figures, with the machine's load while it ran."""

    def headline(r: dict[str, Any]) -> dict[str, Any]:
        return {"mount": r["mount"], "unmount_rate_per_s": r["unmount"]["rate_per_s"],
                "loadavg_1min": r["loadavg_1min"]}

    return {k: [{scale: headline(r[scale]) for scale in r} for r in v] for k, v in rounds.items()}


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, per in doc.get("results", {}).items():
        for scale, r in per.items():
            m = r.get("mount", {})
            out[f"{name}@{scale}"] = {
                "rate_ok": m.get("rate_per_s", 0) >= GOALS["rate_per_s"],
                "p99_ok": m.get("p99_ms", 1e9) <= GOALS["p99_ms"],
            }
    scales = [int(s) for per in doc.get("results", {}).values() for s in per]
    out["mounted_10000_ok"] = bool(scales) and max(scales) >= GOALS["mounted"] and doc.get("leftovers", {}).get("clean")
    return out


def ratios(doc: dict[str, Any]) -> dict[str, Any]:
    """The shim API's mount rate over the plain overlay's, per client count and scale, in the same
    run (medians over rounds, and each round's own pairing), beside the shim's p99, both
    contenders' kernel memory per sandbox and the load average while the shim's step ran."""
    res = doc.get("results", {})
    out: dict[str, Any] = {}
    for key, per in res.items():
        if not key.startswith("layerstore-api/"):
            continue
        clients = key.split("=", 1)[1]
        plain = res.get(f"plain-overlay/clients={clients}", {})
        rounds = doc.get("per_round", {})
        for scale, r in per.items():
            p = plain.get(scale)
            if not p:
                continue
            api_m, plain_m = r["mount"], p["mount"]
            entry = {
                "rate_ratio": round(api_m["rate_per_s"] / plain_m["rate_per_s"], 3),
                "cpu_ratio": round(plain_m["cpu_ms"] / api_m["cpu_ms"], 3),
                "api_rate_per_s": api_m["rate_per_s"], "plain_rate_per_s": plain_m["rate_per_s"],
                "api_p99_ms": api_m["p99_ms"], "plain_p99_ms": plain_m["p99_ms"],
                "api_cpu_ms": api_m["cpu_ms"], "plain_cpu_ms": plain_m["cpu_ms"],
                "api_kmem_per_sandbox_bytes": r["memory_per_sandbox"].get("cgroup_kmem_bytes"),
                "plain_kmem_per_sandbox_bytes": p["memory_per_sandbox"].get("cgroup_kmem_bytes"),
                "api_machine_slab_per_sandbox_bytes": r["memory_per_sandbox"].get("machine_slab_bytes"),
                "plain_machine_slab_per_sandbox_bytes": p["memory_per_sandbox"].get("machine_slab_bytes"),
                "loadavg_1min_api": r.get("loadavg_1min"), "loadavg_1min_plain": p.get("loadavg_1min"),
            }
            api_rounds = rounds.get(key, [])
            plain_rounds = rounds.get(f"plain-overlay/clients={clients}", [])
            if len(api_rounds) > 1:
                entry["per_round_rate_ratio"] = [
                    round(a[scale]["mount"]["rate_per_s"] / b[scale]["mount"]["rate_per_s"], 3)
                    for a, b in zip(api_rounds, plain_rounds, strict=False) if scale in a and scale in b]
            ab = r.get("vs_plain_ab")
            if ab:
                entry["interleaved_rate_ratio"] = ab["rate_ratio"]
            entry["ok"] = (entry["rate_ratio"] >= GOALS_VS_PLAIN["rate_ratio"]
                           and entry["api_p99_ms"] < GOALS_VS_PLAIN["p99_ms"])
            out[f"clients={clients}@{scale}"] = entry
    return out


def write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")


def summary(doc: dict[str, Any]) -> None:
    ab = doc.get("durability_ab")
    if ab:
        for name in ("nosync", "fsync"):
            m, u = ab[name]["mount"], ab[name]["unmount"]
            log(f"durability A/B {name:6s}: mount {m['rate_per_s']:7.1f}/s p50 {m['p50_ms']:6.2f} "
                f"p99 {m['p99_ms']:6.2f} ms | unmount {u['rate_per_s']:7.1f}/s p99 {u['p99_ms']:6.2f} ms")
    for point, r in doc.get("ratios", {}).items():
        kmem = [(r[f"{c}_kmem_per_sandbox_bytes"] or 0) / 1024 for c in ("api", "plain")]
        log(f"layerstore-api / plain-overlay {point}: rate {r['rate_ratio']:.2f}x (goal >= "
            f"{GOALS_VS_PLAIN['rate_ratio']}), shim p99 {r['api_p99_ms']:.2f} ms, kmem/sandbox "
            f"{kmem[0]:.1f} vs {kmem[1]:.1f} KiB, load {r['loadavg_1min_api']}")
    for per in doc.get("results", {}).values():
        for scale, r in per.items():
            ab = r.get("vs_plain_ab")
            if ab:
                p, a = ab["plain-overlay"], ab["layerstore-api"]
                log(f"interleaved A/B at {scale} mounted: plain {p['rate_per_s']:.0f}/s p99 {p['p99_ms']:.2f} ms "
                    f"cpu {p['cpu_ms']:.2f} | shim {a['rate_per_s']:.0f}/s p99 {a['p99_ms']:.2f} ms cpu "
                    f"{a['cpu_ms']:.2f} | ratio {ab['rate_ratio']:.2f}x, load {ab['loadavg_1min']}")
    for name, per in doc.get("results", {}).items():
        for scale, r in per.items():
            m, u, mem = r["mount"], r["unmount"], r["memory_per_sandbox"]
            log(f"{name:30s} {scale:>6s}: {m['rate_per_s']:7.1f}/s p50 {m['p50_ms']:6.2f} p99 {m['p99_ms']:6.2f} ms "
                f"cpu {m['cpu_ms']:5.2f} ms | unmount {u['rate_per_s']:6.1f}/s | kmem "
                f"{mem.get('cgroup_kmem_bytes', 0) / 1024:5.1f} KiB "
                f"(machine slab {mem['machine_slab_bytes'] / 1024:6.1f})")
