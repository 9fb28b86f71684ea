"""`bench/burst.py --nodes` end to end at the tiny size: 2 nodes x 2 sandboxes of the busybox
environment, conventional and lazy, on the real single-node Ceph behind one shaped bridge. Checks the
plumbing (every node fetched its layers through its own port, the store side saw them all, each node
wrote its own disk, nothing failed) and that nothing of the run is left behind. Times nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.root, pytest.mark.ceph,
    pytest.mark.skipif(any(shutil.which(b) is None for b in ("ip", "tc", "nsenter", "runc", "losetup", "mkfs.ext4",
                                                             "ceph-mon", "radosgw", "busybox")),
                       reason="needs ip, tc, nsenter, runc, losetup, mkfs.ext4, busybox and Ceph"),
]


@pytest.fixture
def run_root() -> Iterator[Path]:
    """The runs' live state, under a short path: the node daemon's control socket lives in the
    node directory, and AF_UNIX paths are limited to 108 bytes (pytest's tmp_path is too deep)."""
    root = Path(tempfile.mkdtemp(prefix="lsbt-", dir="/var/tmp"))
    try:
        yield root
    finally:
        subprocess.run(["umount", "-R", "-l", str(root)], capture_output=True)  # only if a run left one
        shutil.rmtree(root, ignore_errors=True)


def _leftovers(tag: str, run_root: Path, settle: float = 20.0) -> list[str]:
    """What the run left, after up to `settle` s: an unmounted image's loop device is autocleared
    only once no mount namespace (another shard's runc, say) holds a copy of its mount."""
    deadline = time.monotonic() + settle
    while (left := _scan(tag, run_root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _scan(tag: str, run_root: Path) -> list[str]:
    left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if n.startswith((f"lsbl{tag}", f"lsbn{tag}x"))]
    left += [ln for ln in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
             if str(run_root) in ln]
    left += [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(run_root) in ln]
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/lsburst-{tag}")]
    return left


def test_burst_two_nodes_tiny(tmp_path: Path, run_root: Path) -> None:
    out = tmp_path / "burst_nodes-tiny.json"
    env = {**os.environ, "LAYERSTORE_BENCH_CACHE": str(tmp_path / "cache"), "LAYERSTORE_BENCH_RUN_DIR": str(run_root)}
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "burst.py"), "--nodes", "2", "--per-node", "2",
                          "--size", "tiny", "--no-docs", "--output", str(out)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.terminate()  # the bench cleans up on SIGTERM
            p.wait(timeout=120)
    tag = str(p.pid % 100000)
    assert p.returncode == 0, stderr[-3000:]  # a contender that did not run fails the bench
    res = json.loads(out.read_text())
    shape = res["shapes"]["2x2@1000"]
    layers = res["layers"]
    tar_gz = sum(v["tar_gz_bytes"] for v in layers.values())
    for name in ("conventional", "lazy"):
        c = shape["contenders"][name]
        assert not c.get("skipped"), (c, res.get("notes"), stderr[-2000:])
        assert c["sandboxes"] == 4 and c["failed"] == 0, c.get("errors")
        assert c["all_finished_s"] is not None
        assert len(c["per_node"]) == 2
        for node in c["per_node"]:
            assert node["sandboxes"] == 2 and node["failed"] == 0
            assert node["fetched_bytes"] > 0 and node["disk_write_bytes"] > 0
            assert node["uppers_disk_write_bytes"] > 0  # the sandboxes' directories were on their own disk
            assert node["mem_peak_bytes"] > 0
        # the store side carried what every node received (frames: a little more than the payload)
        assert c["store_bridge_tx_bytes"] >= 0.9 * c["bytes_fetched"]
        assert c["disk_split"]["disk_written"] == c["disk_write_bytes"]
    conv = shape["contenders"]["conventional"]
    for node in conv["per_node"]:
        assert node["fetched_bytes"] >= tar_gz  # every node pulled every layer whole, through its own port
    assert conv["bytes_fetched"] >= 2 * tar_gz
    assert shape["contenders"]["lazy"]["ratios"]["store_bytes_ratio"] is not None
    assert "### Cold burst at cluster shape (tiny" in stdout
    assert _leftovers(tag, run_root) == []
    assert not any(run_root.glob("run-*"))


def test_interrupted_burst_leaves_nothing(tmp_path: Path, run_root: Path) -> None:
    """Ctrl-C while the nodes' runners are up: the namespaces, veths, loop devices, mounts,
    cgroups and processes of the run are gone when it exits."""
    env = {**os.environ, "LAYERSTORE_BENCH_CACHE": str(tmp_path / "cache"), "LAYERSTORE_BENCH_RUN_DIR": str(run_root)}
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "burst.py"), "--nodes", "2", "--per-node", "1",
                          "--size", "tiny", "--no-docs", "--contenders", "conventional", "--output",
                          str(tmp_path / "out.json")],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tag = str(p.pid % 100000)
    seen = []
    try:
        assert p.stderr is not None
        for line in p.stderr:
            seen.append(line)
            if "round 1/1: conventional" in line:  # the nodes' runners are being started
                break
        else:
            pytest.fail("the bench ended before its burst: " + "".join(seen)[-2000:])
        nodes = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                 if n.startswith(f"lsbn{tag}x")]
        assert len(nodes) == 2  # the run was really up
        cg = Path("/sys/fs/cgroup/memory") / f"lsburst-{tag}"
        procs = [cg / f"conventional-n{i}" / "cgroup.procs" for i in (0, 1)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(f.exists() and f.read_text().strip() for f in procs):
            time.sleep(0.2)  # until both nodes' runners sit in their cgroups
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert _leftovers(tag, run_root) == []
    assert not any(run_root.glob("run-*"))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    assert not [ln for ln in ps if str(run_root) in ln]
