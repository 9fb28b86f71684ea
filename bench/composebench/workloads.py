"""What runs: client processes that mount sandboxes (each made usable) and tear them down, phases
that grow the node from one scale to the next while the earlier sandboxes stay mounted, and the
durability A/B of the shim with and without an fsync per state transaction."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .contenders import Api, make_contender
from .probes import node_facts, per_sandbox, rss, settle, snapshot, stats, usable
from .spec import AB_BACKGROUND, AB_BLOCK, VS_PLAIN_BLOCK, log


def worker(kind: str, cfg: dict[str, Any], ids: list[str], barrier: Any, out: Any) -> None:
    """One client: mount `ids` (each made usable), then wait, then unmount them."""
    c = make_contender(kind, cfg)
    c.open()
    lat, handles = [], []
    lock = getattr(c, "lock", None)
    # per operation: the sum of its lock acquisitions (a mount takes the lock once, a teardown twice)
    holds: list[float] = []
    waits: list[float] = []

    def lock_mark() -> tuple[int, int]:
        return (len(lock.holds), len(lock.waits)) if lock else (0, 0)

    def lock_add(mark: tuple[int, int]) -> None:
        if lock:
            holds.append(sum(lock.holds[mark[0]:]))
            waits.append(sum(lock.waits[mark[1]:]))

    barrier.wait()
    t0, cpu0 = time.monotonic(), time.process_time()
    for i in ids:
        t = time.perf_counter()
        mark = lock_mark()
        h, target = c.mount(i)
        lock_add(mark)
        usable(target)
        lat.append(time.perf_counter() - t)
        handles.append(h)
    t1, cpu1 = time.monotonic(), time.process_time()
    res: dict[str, Any] = {"lat": lat, "start": t0, "end": t1, "cpu": cpu1 - cpu0, "rss": rss(os.getpid()),
                           "lock_holds": holds, "lock_waits": waits}
    holds, waits = [], []
    if lock:
        lock.holds, lock.waits = [], []
    out.put(("mounted", res))
    barrier.wait()  # the parent measures memory at the checkpoint meanwhile
    barrier.wait()
    ulat = []
    t0, cpu0 = time.monotonic(), time.process_time()
    for h in handles:
        t = time.perf_counter()
        mark = lock_mark()
        c.unmount(h)
        lock_add(mark)
        ulat.append(time.perf_counter() - t)
    out.put(("unmounted", {"lat": ulat, "start": t0, "end": time.monotonic(), "cpu": time.process_time() - cpu0,
                           "lock_holds": holds}))
    c.close()


def run_phase(kind: str, cfg: dict[str, Any], ids: list[str], clients: int,
              at_checkpoint: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Mount `ids` with `clients` processes, call `at_checkpoint` while they are all mounted, then
    unmount them with the same clients."""
    ctx = multiprocessing.get_context("spawn")  # LMDB handles must not cross a fork
    barrier = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    shares = [ids[k::clients] for k in range(clients)]
    procs = [ctx.Process(target=worker, args=(kind, cfg, shares[k], barrier, out))
             for k in range(clients)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)
        got = [out.get(timeout=3600) for _ in procs]
        mounted = [r for what, r in got if what == "mounted"]
        barrier.wait(timeout=60)
        extra = at_checkpoint()
        barrier.wait(timeout=3600)
        got = [out.get(timeout=3600) for _ in procs]
        unmounted = [r for what, r in got if what == "unmounted"]
    except BaseException:
        barrier.abort()
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=600)
    lat = [x for r in mounted for x in r["lat"]]
    wall = max(r["end"] for r in mounted) - min(r["start"] for r in mounted)
    ulat = [x for r in unmounted for x in r["lat"]]
    uwall = max(r["end"] for r in unmounted) - min(r["start"] for r in unmounted)
    holds = [x for r in mounted for x in r["lock_holds"]]
    waits = [x for r in mounted for x in r["lock_waits"]]
    uholds = [x for r in unmounted for x in r["lock_holds"]]
    cpu = sum(r["cpu"] for r in mounted) / len(lat)
    ucpu = sum(r["cpu"] for r in unmounted) / len(ulat)
    return {"mount": {"rate_per_s": round(len(lat) / wall, 1), **stats(lat), "cpu_ms": round(cpu * 1000, 3),
                      "cpu_bound_rate_per_2_cores": round(2 / cpu, 1)},
            "lock_hold_per_mount": stats(holds), "lock_wait_per_mount": stats(waits),
            "unmount": {"rate_per_s": round(len(ulat) / uwall, 1), **stats(ulat), "cpu_ms": round(ucpu * 1000, 3)},
            "lock_hold_per_unmount": stats(uholds),
            "client_rss_bytes": max(r["rss"] for r in mounted), **extra}


def run_contender(kind: str, cfg: dict[str, Any], scales: list[int], clients: int, rnd: int,
                  cli_sample: int, vs_plain_blocks: int = 0) -> dict[str, Any]:
    """Grow from 0 to each scale in turn (the sandboxes of the earlier scales stay mounted), measure at
    each checkpoint, then tear everything down. Each step's figures are for the sandboxes mounted in
    that step (e.g. the 9,000 that take the node from 1,000 to 10,000)."""
    tag = f"r{rnd}-{kind}-{clients}"
    settle()
    load_start = os.getloadavg()[0]
    base = snapshot()
    results: dict[str, Any] = {}
    done = 0
    # Scales are nested: phase k mounts scale[k] - scale[k-1] more while phase k-1's clients hold theirs.
    # Each phase is one run_phase whose checkpoint callback starts the next phase (so that all are
    # mounted at once when the next is measured), then the phases unmount innermost first.

    def phase(k: int) -> dict[str, Any]:
        nonlocal done
        n = scales[k] - (scales[k - 1] if k else 0)
        ids = [f"{tag}-{done + j}" for j in range(n)]
        done += n

        def checkpoint() -> dict[str, Any]:
            snap = snapshot()
            extra: dict[str, Any] = {"memory_per_sandbox": per_sandbox(base, snap, scales[k]),
                                     "mounted": scales[k]}
            extra.update(node_facts(kind, cfg, scales[k], cli_sample))
            log(f"{tag}: {scales[k]} mounted (load {os.getloadavg()[0]:.1f})")
            if k + 1 < len(scales):
                extra["next"] = phase(k + 1)
            elif vs_plain_blocks:
                log(f"{tag}: shim / plain overlay A/B, {vs_plain_blocks} blocks of {VS_PLAIN_BLOCK} each")
                extra["vs_plain_ab"] = vs_plain_ab(cfg, vs_plain_blocks, scales[k])
            return extra

        return run_phase(kind, cfg, ids, clients, checkpoint)

    nested = phase(0)
    k = 0
    while nested is not None:
        nxt = nested.pop("next", None)
        results[str(scales[k])] = nested
        nested, k = nxt, k + 1
    for r in results.values():
        r["loadavg_1min"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # at start, at end
    return results


def durability_ab(cfg: dict[str, Any], blocks: int) -> dict[str, Any]:
    """The shim with (`fsync`) and without (`nosync`) a flush after each state transaction, in
    alternating blocks of AB_BLOCK mounts then AB_BLOCK teardowns, in one process: both see the
    same disk and the same load from elsewhere. About 1,000 sandboxes stay mounted meanwhile."""
    settle()
    variants = {"nosync": Api(Path(cfg["node"]), cfg["store"]), "fsync": Api(Path(cfg["node"]), cfg["store"],
                                                                               fsync=True)}
    for c in variants.values():
        c.open()
    lat: dict[str, dict[str, list[float]]] = {v: {"mount": [], "unmount": []} for v in variants}
    wall: dict[str, dict[str, float]] = {v: {"mount": 0.0, "unmount": 0.0} for v in variants}
    background = [variants["nosync"].mount(f"ab-bg-{i}")[0] for i in range(AB_BACKGROUND)]
    try:
        for b in range(blocks):
            name = ("nosync", "fsync")[b % 2]
            c = variants[name]
            handles = []
            t0 = time.perf_counter()
            for i in range(AB_BLOCK):
                t = time.perf_counter()
                h, target = c.mount(f"ab-{b}-{i}")
                usable(target)
                lat[name]["mount"].append(time.perf_counter() - t)
                handles.append(h)
            t1 = time.perf_counter()
            for h in handles:
                t = time.perf_counter()
                c.unmount(h)
                lat[name]["unmount"].append(time.perf_counter() - t)
            wall[name]["mount"] += t1 - t0
            wall[name]["unmount"] += time.perf_counter() - t1
    finally:
        for h in background:
            variants["nosync"].unmount(h)
        for c in variants.values():
            c.close()
    out: dict[str, Any] = {"blocks": blocks, "block": AB_BLOCK, "mounted_meanwhile": AB_BACKGROUND}
    for name in variants:
        out[name] = {op: {"rate_per_s": round(len(lat[name][op]) / wall[name][op], 1), **stats(lat[name][op])}
                     for op in ("mount", "unmount")}
    return out


def vs_plain_ab(cfg: dict[str, Any], blocks: int, mounted: int) -> dict[str, Any]:
    """The shim API and the plain overlay alternating in blocks of VS_PLAIN_BLOCK mounts (each made
    usable) in this one process, while `mounted` sandboxes of the shim stay mounted: both see the
    same minutes of the machine's load, which the contenders' own runs (one after the other) do
    not. The sandboxes stay mounted until every block ran, then all are torn down."""
    variants: dict[str, Any] = {kind: make_contender(kind, cfg) for kind in ("plain-overlay", "layerstore-api")}
    for c in variants.values():
        c.open()
    lat: dict[str, list[float]] = {v: [] for v in variants}
    wall = dict.fromkeys(variants, 0.0)
    cpu = dict.fromkeys(variants, 0.0)
    handles: dict[str, list[str]] = {v: [] for v in variants}
    load = [round(os.getloadavg()[0], 1)]
    try:
        for b in range(blocks):
            for name in (("plain-overlay", "layerstore-api") if b % 2 == 0 else ("layerstore-api", "plain-overlay")):
                c = variants[name]
                t0, c0 = time.perf_counter(), time.process_time()
                for i in range(VS_PLAIN_BLOCK):
                    t = time.perf_counter()
                    h, target = c.mount(f"vs-{b}-{i}")
                    usable(target)
                    lat[name].append(time.perf_counter() - t)
                    handles[name].append(h)
                wall[name] += time.perf_counter() - t0
                cpu[name] += time.process_time() - c0
        load.append(round(os.getloadavg()[0], 1))
    finally:
        for name, c in variants.items():
            for h in handles[name]:
                c.unmount(h)
            c.close()
    out: dict[str, Any] = {"blocks": blocks, "block": VS_PLAIN_BLOCK, "mounted_meanwhile": mounted,
                           "loadavg_1min": load}
    for name in variants:
        out[name] = {"rate_per_s": round(len(lat[name]) / wall[name], 1), **stats(lat[name]),
                     "cpu_ms": round(cpu[name] / len(lat[name]) * 1000, 3)}
    out["rate_ratio"] = round(out["layerstore-api"]["rate_per_s"] / out["plain-overlay"]["rate_per_s"], 3)
    return out
