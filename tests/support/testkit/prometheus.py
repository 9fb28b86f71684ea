"""A real Prometheus (Debian's `prometheus`) for tests: a config that scrapes the given targets
every second (and loads the given rule files), started on a free loopback port with its storage
in a temporary directory, ready when `/-/ready` answers, stopped by its PID (SIGTERM, then
SIGKILL) even when the test fails; queried over its HTTP API."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from testkit.store_service import free_port

BINARY = "prometheus"


def prometheus_missing() -> str:
    """Why this machine cannot run a Prometheus ("" if it can)."""
    return "" if shutil.which(BINARY) else "needs Debian's prometheus (.ci/install-deps.sh)"


def write_config(path: Path, targets: dict[str, str], rules: Sequence[Path] = ()) -> None:
    """job name -> HOST:PORT, each scraped every second at /metrics. (JSON is YAML.)"""
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
           "rule_files": [str(r) for r in rules],
           "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                              for job, target in targets.items()]}
    path.write_text(json.dumps(cfg, indent=1))


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, promql: str) -> list[dict[str, object]]:
        """The instant vector (or scalar as one sample) of `promql` now."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"PromQL {promql!r}: {body}")
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, promql: str) -> float | None:
        """The one sample's value of `promql`, None when the vector is empty."""
        res = self.query(promql)
        if not res:
            return None
        assert len(res) == 1, f"{promql!r} gave {len(res)} series: {res}"
        return float(res[0]["value"][1])  # type: ignore[index]

    def wait_value(self, promql: str, want: float, timeout: float = 30.0) -> float | None:
        """Poll until `promql` gives `want` (scrapes are 1 s apart); the last value otherwise."""
        end = time.monotonic() + timeout
        got = None
        while time.monotonic() < end:
            got = self.value(promql)
            if got == want:
                return got
            time.sleep(0.25)
        return got

    def targets_up(self) -> dict[str, str]:
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return {t["labels"]["job"]: t["health"] for t in r["data"]["activeTargets"]}

    def wait_up(self, jobs: set[str], timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            up = self.targets_up()
            if all(up.get(j) == "up" for j in jobs):
                return
            time.sleep(0.25)
        raise AssertionError(f"targets not up: {self.targets_up()}\n{self.log_text()[-2000:]}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_ready(prom: Prometheus, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if prom.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {prom.proc.returncode}:\n{prom.log_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"prometheus not ready within {timeout} s:\n{prom.log_text()[-3000:]}")


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: dict[str, str], rules: Sequence[Path] = (),
                       ready_timeout: float = 60.0) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (job -> HOST:PORT), its storage under `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    write_config(config, targets, rules)
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_ready(prom, ready_timeout)
        yield prom
    finally:
        prom.stop()
