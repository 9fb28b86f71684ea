"""The cluster-burst model (bench/burst/model.py): its formulas on hand-computed cases, DSec's volumes
from DSec's own write figures, the calibration, the sensitivities' signs, and the fit on a synthetic
results file. Pure: nothing is timed or started."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bench.burst import model as m

MB = 1e6


def _w(**kw: Any) -> m.Workload:
    base = {"sandboxes": 64, "nodes": 16, "node_bytes": 480 * MB, "access_ratio": 0.12, "task_s": 10.0}
    return m.Workload(**{**base, **kw})


def _c(**kw: Any) -> m.Costs:
    base = {"store_Bps": 125 * MB, "nic_Bps": 1250 * MB, "compression": 3.0, "unpack_Bps": 80 * MB,
            "unpack_streams": 1.0, "create_core_s": 0.1, "cores": 2.0, "cold_mount_s": 0.5, "meta_fraction": 0.05,
            "wire_per_read": 1.0, "lazy_task_factor": 1.0, "cache_write_per_fetched": 3.0}
    return m.Costs(**{**base, **kw})


def test_formulas_by_hand() -> None:
    p = m.predict(_w(), _c())
    conv, lazy = p["conventional"], p["lazy"]
    # conventional: 16 nodes x 160 MB of tar.gz over a shared 125 MB/s = 20.48 s; unpack 480/80 = 6 s;
    # 4 sandboxes x 0.1 core-s / 2 cores = 0.2 s
    assert conv.all_started_s == pytest.approx(20.48 + 6 + 0.2)
    assert conv.all_finished_s == pytest.approx(conv.all_started_s + 10)
    assert conv.store_bytes == pytest.approx(16 * 160 * MB) and conv.node_fetch_bytes == pytest.approx(160 * MB)
    assert conv.node_disk_write_bytes == pytest.approx(640 * MB)
    # lazy: metadata 24 MB per node, 16 nodes over 125 MB/s = 3.072 s; + 0.5 s + 0.2 s
    assert lazy.all_started_s == pytest.approx(0.5 + 3.072 + 0.2)
    # fetch 57.6 MB per node, 16 nodes: 7.3728 s < the task's 10 s
    assert lazy.all_finished_s == pytest.approx(lazy.all_started_s + 10)
    assert lazy.node_disk_write_bytes == pytest.approx(3 * 57.6 * MB)
    s = m.speedups(p)
    assert s["store_bytes"] == pytest.approx(57.6 / 160)


def test_link_bound_lazy_finish_and_scaling() -> None:
    c = _c()
    slow = m.predict(_w(task_s=1.0), replace(c, store_Bps=10 * MB))
    # the fetch, not the task, sets the lazy finish when the store is slow: 16 x 57.6 MB / 10 MB/s
    assert slow["lazy"].all_finished_s == pytest.approx(slow["lazy"].all_started_s + 16 * 57.6 / 10)
    # twice the nodes on the same store: the conventional transfer doubles
    one = m.predict(_w(nodes=8, sandboxes=32), c)["conventional"]
    two = m.predict(_w(nodes=16, sandboxes=64), c)["conventional"]
    assert two.all_started_s - one.all_started_s == pytest.approx(8 * 160 / 125)
    # a node's NIC bounds one node alone
    alone = m.predict(_w(nodes=1, sandboxes=4), replace(c, store_Bps=1e12, nic_Bps=100 * MB))["conventional"]
    assert alone.all_started_s == pytest.approx(1.6 + 6 + 0.2)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        m.predict(_w(nodes=0), _c())
    with pytest.raises(ValueError):
        m.predict(_w(), _c(store_Bps=0))
    with pytest.raises(ValueError):
        m.dsec_volumes(0.9, compression=3.0, lazy_write_per_read=5.0)


@pytest.mark.parametrize("access", m.DSEC_ACCESS)
def test_dsec_volumes_reproduce_dsec_writes(access: float) -> None:
    u, upper = m.dsec_volumes(access, 3.0)
    per_node = m.DSEC_SANDBOXES / m.DSEC_NODES
    eager = m.DSEC_NODES * (u / 3 + u + per_node * upper)
    lazy = m.DSEC_NODES * (access * u + per_node * upper)
    assert eager == pytest.approx(m.DSEC_EAGER_WRITES) and lazy == pytest.approx(m.DSEC_LAZY_WRITES)
    assert 1e9 < u < 1e10 and upper > 0


def test_calibration_and_required_bandwidth() -> None:
    c = _c(store_Bps=100e9, nic_Bps=3e9, cores=64.0)
    w = m.dsec_workload(0.1, 0.0, c.compression)
    task = m.calibrate_task(w, c, 35 * 60)
    w = replace(w, task_s=task)
    p = m.predict(w, c)
    assert p["lazy"].all_finished_s == pytest.approx(35 * 60)
    need = m.required_store_Bps(w, c, 60 * 60)
    assert need is not None and need < c.store_Bps  # only a far slower store makes the eager path take 60 min
    slow = replace(c, store_Bps=need, nic_Bps=max(c.nic_Bps, need))
    assert m.predict(w, slow)["conventional"].all_finished_s == pytest.approx(60 * 60, rel=1e-3)
    assert m.required_store_Bps(w, c, 1.0) is None  # faster than the task itself: impossible


def test_sensitivity_signs() -> None:
    w, c = _w(task_s=20.0), _c()
    s = m.sensitivity(w, c, "all_finished")
    assert s["store_Bps"] < 0  # the lazy finish is the task's: a faster store helps the conventional path more
    assert s["node_bytes"] > 0  # bigger images: more for the eager path to move
    assert s["task_s"] < 0  # a longer task dilutes the start-up difference
    assert s["lazy_task_factor"] < 0
    assert set(s) >= set(m.SENSITIVE)
    # with a short task the lazy finish is the store's (16 x 57.6 MB > 2 s of link): it gains more
    assert m.sensitivity(_w(task_s=2.0), c, "all_finished")["store_Bps"] > 0


def _shape(nodes: int, per_node: int, rate: float) -> dict[str, Any]:
    layers = {"base": {"extract_s": 2.0, "download_s": 1.5}, "tk": {"extract_s": 1.0, "download_s": 1.0}}
    conv = {"bytes_fetched": 100 * MB * nodes, "all_started_s": 4.0, "all_finished_s": 20.0,
            "phases_median_s": {"run_s": 10.0},
            "per_node": [{"facts": {"layers": layers}} for _ in range(nodes)]}
    lazy = {"bytes_fetched": 30 * MB * nodes, "all_started_s": 1.2, "all_finished_s": 15.0,
            "phases_median_s": {"mount_s": 0.4, "run_s": 12.0}, "disk_split": {"layer_data": 90 * MB * nodes},
            "per_node": [{} for _ in range(nodes)]}
    return {"nodes": nodes, "per_node": per_node, "rate_mbit": rate,
            "contenders": {"conventional": conv, "lazy": lazy}}


def test_fit_on_synthetic_results() -> None:
    results = {"machine": {"cpus": 2},
               "layers": {"base": {"content_bytes": 200 * MB, "tar_gz_bytes": 70 * MB},
                          "tk": {"content_bytes": 100 * MB, "tar_gz_bytes": 30 * MB}},
               "environments": {"e": ["base", "tk"]},
               "shapes": {"4x4@1000": _shape(4, 4, 1000)}}
    f = m.fit(results)
    assert f["compression"] == pytest.approx(3.0)
    assert f["unpack_Bps"] == pytest.approx(100 * MB)  # both layers: 100 MB/s
    assert f["create_core_s"] == pytest.approx((1.2 - 0.4) * 2 / 16)
    assert f["lazy_task_factor"] == pytest.approx(1.2)
    assert f["fetched_fraction"] == pytest.approx(30 / 300)
    assert f["cache_write_per_fetched"] == pytest.approx(3.0)
    # 400 MB over 1 Gbit/s would take 3.2 s; the last download ended at 1.5 s -> efficiency 2.13
    assert f["link_efficiency"] == pytest.approx(400 * 8 / 1000 / 1.5, rel=1e-3)
    checks = m.check_against_run(results, f)
    assert checks and checks[0]["shape"] == "4x4@1000"
    rows = m.dsec_table(f, measured_access=0.1)
    assert [r["access_ratio"] for r in rows] == list(m.DSEC_ACCESS)
    for r in rows:
        assert r["predicted"]["lazy"]["all_finished_s"] == pytest.approx(35 * 60)
