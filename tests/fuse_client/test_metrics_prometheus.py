"""Metrics a real Prometheus scrapes (docs/metrics.md): the node daemon (real FUSE mount, reads
through a kernel EROFS mount), the store service and the snapshotter, each on its own TCP
listener; PromQL over Prometheus's HTTP API gives what `layerctl stats`, the eviction answer and
the service's own `/metrics` say; the shipped recording rule gives a burst's fetch rate. And the
doc cannot drift: every `layerstore_*` metric the three processes expose is in docs/metrics.md,
with its type, and the doc names none they do not expose."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from testkit.erofs_helpers import mounted_erofs
from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree
from testkit.prometheus import Prometheus, prometheus_missing, running_prometheus
from testkit.store_service import free_port, running_service

from layerstore.metrics_listen import NODE_ENV, SNAPSHOTTER_ENV, MetricsListener, parse_address
from layerstore.store import Store

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "metrics.md"
RULES = REPO / "fuse_client" / "contrib" / "prometheus-rules.yml"
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
TYPE_SUFFIX = {"counter": "_total", "histogram": "", "gauge": ""}


# -- the doc and the exposition ----------------------------------------------------------------
def documented() -> dict[str, str]:
    """metric name (as PromQL names it) -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `(layerstore_[a-z_]+)` \| (counter|gauge|histogram) \|", DOC.read_text(), re.M)
    return dict(rows)


def exposed(text: str) -> dict[str, str]:
    """The `layerstore_*` families of an exposition, named as PromQL names them -> type."""
    out = {}
    for fam in text_string_to_metric_families(text):
        # (`*_created`: prometheus-client's creation time of each counter and histogram child)
        if fam.name.startswith("layerstore_") and not fam.name.endswith("_created"):
            out[fam.name + TYPE_SUFFIX.get(fam.type, "")] = fam.type
    return out


def in_process_expositions(tmp_path: Path) -> dict[str, str]:
    """What each process exposes, built in this process from the same code (the daemon's counters
    over a real node cache, so its gauges are there too)."""
    from fuse_client.nodecache import open_cache
    from fuse_client.nodecache.stats import Stats
    from service.metrics import REQUESTS, exposition
    from snapshotter.metrics import SnapshotterMetrics

    with contextlib.ExitStack() as stack:
        cache = open_cache(tmp_path / "cache", None, stack)
        stats = Stats(gauges=cache.gauges)
        stats.blob("b3:" + "0" * 64, 1)
        stats.fetch_seconds.labels("demand").observe(0.01)
        node = stats.prometheus().decode()
    sn = SnapshotterMetrics(layers_held=lambda: 0)
    sn.observe("Prepare", "OK", 0.01)
    REQUESTS.labels("/healthz", "GET", "200")  # (a family shows once it has a child)
    return {"node": node, "service": exposition()[0].decode(), "snapshotter": sn.prometheus().decode()}


def test_every_exposed_metric_is_documented_with_its_type(tmp_path: Path) -> None:
    doc = documented()
    seen: dict[str, str] = {}
    for text in in_process_expositions(tmp_path).values():
        seen.update(exposed(text))
    assert len(seen) > 30
    missing = {n: t for n, t in seen.items() if n not in doc}
    assert not missing, f"exposed but not in docs/metrics.md: {missing}"
    wrong = {n: (doc[n], t) for n, t in seen.items() if doc[n] != t}
    assert not wrong, f"documented with another type (doc, exposed): {wrong}"
    stale = set(doc) - set(seen)
    assert not stale, f"in docs/metrics.md but exposed by none: {stale}"


def test_the_shipped_rules_are_valid() -> None:
    if shutil.which("promtool") is None:
        pytest.skip(prometheus_missing() or "needs promtool (Debian's prometheus)")
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rate(layerstore_fuse_fetched_bytes_total[1m])" in RULES.read_text()


# -- the listener ------------------------------------------------------------------------------
def test_listener_addresses_default_to_loopback() -> None:
    assert parse_address("9100") == ("127.0.0.1", 9100)
    assert parse_address(":9100") == ("127.0.0.1", 9100)
    assert parse_address("0.0.0.0:1") == ("0.0.0.0", 1)
    assert parse_address("[::1]:9100") == ("::1", 9100)
    from layerstore.errors import ConfigError

    for bad in ("host:port", "70000", "a:"):
        with pytest.raises(ConfigError):
            parse_address(bad)


def test_the_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from layerstore.metrics_listen import wanted

    monkeypatch.delenv(NODE_ENV, raising=False)
    assert wanted(None, NODE_ENV) is None
    monkeypatch.setenv(NODE_ENV, "127.0.0.1:9411")
    assert wanted(None, NODE_ENV) == "127.0.0.1:9411" and wanted("9500", NODE_ENV) == "9500"
    assert wanted(None, SNAPSHOTTER_ENV) is None  # (a snapshotter's daemons inherit its environment)


def test_the_daemon_module_takes_the_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import fuse_client.daemon as daemonmod

    seen = []
    monkeypatch.setattr(daemonmod, "serve", lambda cfg, store: seen.append(cfg))
    argv = ["--cache", str(tmp_path / "c"), "--mountpoint", str(tmp_path / "m")]
    assert daemonmod.main([*argv, "--metrics-listen", "127.0.0.1:9411"]) == 0
    assert daemonmod.main(argv) == 0
    assert [c.metrics_listen for c in seen] == ["127.0.0.1:9411", None]


def test_a_taken_port_is_a_config_error() -> None:
    from layerstore.errors import ConfigError

    with MetricsListener("127.0.0.1:0", lambda: b"") as lis, pytest.raises(ConfigError, match="metrics-listen"):
        MetricsListener(f"127.0.0.1:{lis.address[1]}", lambda: b"").start()


def test_listener_serves_metrics_only_and_survives_a_failed_render() -> None:
    calls = {"n": 0}

    def render() -> bytes:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return b"layerstore_test_x 1\n"

    with MetricsListener("127.0.0.1:0", render) as lis:
        host, port = lis.address
        assert host == "127.0.0.1"
        base = f"http://{host}:{port}"
        ok = httpx.get(f"{base}/metrics")
        assert ok.status_code == 200 and ok.text == "layerstore_test_x 1\n"
        assert ok.headers["content-type"].startswith("text/plain")
        assert httpx.get(f"{base}/metrics").status_code == 500
        assert httpx.get(f"{base}/stats").status_code == 404
        assert httpx.get(f"{base}/metrics?x=1").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/metrics", timeout=2)


# -- a real Prometheus over the three processes -------------------------------------------------
@pytest.fixture
def prometheus_run(tmp_path: Path) -> Iterator[Callable[..., contextlib.AbstractContextManager[Prometheus]]]:
    """Start a real Prometheus over the given targets (stopped by PID at the end, even on failure)."""
    why = prometheus_missing()
    if why:
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        def start(targets: dict[str, str], rules: list[Path]) -> Prometheus:
            return stack.enter_context(running_prometheus(tmp_path / "prometheus", targets, rules))
        yield start  # type: ignore[misc]


@contextlib.contextmanager
def running_snapshotter(node: Path, store_url: str, metrics: str, log: Path) -> Iterator[Path]:
    sock = node.parent / "snapshotter.sock"
    env = {**os.environ, SNAPSHOTTER_ENV: metrics}
    env.pop("LAYERSTORE_STORE", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen([LAYERCTL, "snapshotter", "--address", str(sock), "--node-dir", str(node),
                                 "--store", store_url], stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, f"the snapshotter died at start:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the snapshotter did not start"
            time.sleep(0.02)
        yield sock
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def converge(check: Callable[[], list[str]], timeout: float = 30.0) -> None:
    """Until `check` finds no difference (Prometheus scrapes every second); else fail with them."""
    end = time.monotonic() + timeout
    while True:
        diffs = check()
        if not diffs or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert not diffs, "\n".join(diffs)


def snapshot_calls(sock: Path) -> None:
    """Prepare, Commit, Remove, Mounts and a Stat of a missing key, over containerd's gRPC API."""
    from snapshotter.stubs import snapshots_pb2 as pb
    from snapshotter.stubs import snapshots_pb2_grpc as pbg

    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pbg.SnapshotsStub(ch)
        stub.Prepare(pb.PrepareSnapshotRequest(snapshotter="layerstore", key="active-1"), timeout=30)
        stub.Mounts(pb.MountsRequest(snapshotter="layerstore", key="active-1"), timeout=30)
        stub.Commit(pb.CommitSnapshotRequest(snapshotter="layerstore", name="committed-1", key="active-1"),
                    timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.Stat(pb.StatSnapshotRequest(snapshotter="layerstore", key="missing"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Remove(pb.RemoveSnapshotRequest(snapshotter="layerstore", key="committed-1"), timeout=30)


def layerctl_json(*args: str) -> dict[str, object]:
    out = subprocess.run([LAYERCTL, *args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.root
@pytest.mark.slow
def test_prometheus_scrapes_daemon_service_and_snapshotter(
        tmp_path: Path, node: Path, prometheus_run: Callable[..., Prometheus]) -> None:
    src = make_tree(tmp_path / "src", small=30, big=(2 << 20,), seed=30)
    store_dir = str(tmp_path / "store")
    with Store.open(store_dir) as store:
        store.init()
        layer = build_and_push(store, src, tmp_path / "image.erofs")
    ports = {job: free_port() for job in ("node", "snapshotter")}
    cache = tmp_path / "cache"
    with running_service(store_dir, tmp_path / "svc") as svc, \
            DaemonProcess(svc.url, cache, tmp_path / "mnt", env={NODE_ENV: f"127.0.0.1:{ports['node']}"}) as d, \
            running_snapshotter(node, svc.url, f"127.0.0.1:{ports['snapshotter']}", tmp_path / "sn.log") as sock:
        service_target = svc.url.removeprefix("http://")
        prom = prometheus_run({"node": f"127.0.0.1:{ports['node']}", "service": service_target,
                               "snapshotter": f"127.0.0.1:{ports['snapshotter']}"}, [RULES])
        prom.wait_up({"node", "service", "snapshotter"})
        with mounted_erofs(d.blob(layer.blob)) as mnt:  # a real read through FUSE
            for f in sorted(mnt.rglob("*")):
                if f.is_file():
                    f.read_bytes()
        # A scrape of the blob's series before more fetches: a series' first sample is not a rise
        # (rate() needs two samples of it), so the re-read below is what the recorded rate sees.
        first = layerctl_json("stats", "--cache", str(cache))["blobs"][layer.blob]["fetched_bytes"]  # type: ignore[index]
        converge(lambda: [] if prom.value(f'layerstore_fuse_fetched_bytes_total{{blob="{layer.blob}"}}') == first
                 else ["the first read was not scraped"])
        evicted = layerctl_json("cache", "evict", "--cache", str(cache), "--all")
        with mounted_erofs(d.blob(layer.blob)) as mnt:  # cold again: misses and fetches
            for f in sorted(mnt.rglob("*"))[:10]:
                if f.is_file():
                    f.read_bytes()
        snapshot_calls(sock)

        # The node: what `layerctl stats` says, per blob and in total, is what PromQL says.
        def node_diffs() -> list[str]:
            st = layerctl_json("stats", "--cache", str(cache))
            blob = st["blobs"][layer.blob]  # type: ignore[index]
            want = {f'layerstore_fuse_{k}_total{{job="node",blob="{layer.blob}"}}': blob[k]
                    for k in ("fetched_bytes", "served_bytes", "hits", "misses")}
            want['sum(layerstore_fuse_fetched_bytes_total{job="node"})'] = sum(
                b["fetched_bytes"] for b in st["blobs"].values())  # type: ignore[union-attr]
            want['layerstore_fuse_corrupt_chunks_total{job="node"}'] = st["corrupt_chunks"]
            want['layerstore_fuse_store_errors_total{job="node"}'] = st["store_errors"]
            want['layerstore_fuse_cache_evicted_chunks{job="node"}'] = evicted["evicted_chunks"]
            want['layerstore_fuse_cache_evicted_bytes{job="node"}'] = evicted["evicted_bytes"]
            return [f"{q}: prometheus {prom.value(q)} != {v}" for q, v in want.items() if prom.value(q) != v]

        converge(node_diffs)
        st = layerctl_json("stats", "--cache", str(cache))
        assert st["blobs"][layer.blob]["misses"] > 0 and st["blobs"][layer.blob]["hits"] > 0  # type: ignore[index]
        assert evicted["evicted_chunks"] > 0  # (so the comparisons above compare something)

        # The service: requests by route, method and status, as its own /metrics counts them
        # (not /metrics itself, which Prometheus's scrapes keep counting).
        def service_diffs() -> list[str]:
            text = httpx.get(f"{svc.url}/metrics", timeout=10).text
            diffs, n = [], 0
            for fam in text_string_to_metric_families(text):
                if fam.name != "layerstore_service_requests":
                    continue
                for s in fam.samples:
                    if not s.name.endswith("_total") or s.labels["route"] == "/metrics":
                        continue
                    n += 1
                    sel = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                    q = f'layerstore_service_requests_total{{job="service",{sel}}}'
                    if prom.value(q) != s.value:
                        diffs.append(f"{q}: prometheus {prom.value(q)} != {s.value}")
            return diffs if n >= 2 else [f"only {n} request series in the service's /metrics"]

        converge(service_diffs)
        assert prom.value('sum(layerstore_service_requests_total{job="service",route!="/metrics"})') > 0

        # The snapshotter: calls by method and status.
        want_sn = {("Prepare", "OK"): 1, ("Mounts", "OK"): 1, ("Commit", "OK"): 1, ("Remove", "OK"): 1,
                   ("Stat", "NOT_FOUND"): 1}

        def snapshotter_diffs() -> list[str]:
            diffs = []
            for (method, status), v in want_sn.items():
                q = f'layerstore_snapshotter_calls_total{{job="snapshotter",method="{method}",status="{status}"}}'
                if prom.value(q) != v:
                    diffs.append(f"{q}: prometheus {prom.value(q)} != {v}")
            if prom.value('layerstore_snapshotter_lazy_layers_mounted{job="snapshotter"}') != 0:
                diffs.append("lazy layers mounted != 0")
            return diffs

        converge(snapshotter_diffs)
        assert prom.value('sum(layerstore_snapshotter_errors_total{job="snapshotter"})') in (None, 0.0)

        # The shipped burst rule: the node fleet's fetch rate rose with the reads above.
        converge(lambda: [] if (prom.value('job:layerstore_fuse_fetched_bytes:rate1m{job="node"}') or 0) > 0
                 else ["the recorded fetch rate stayed 0"])
