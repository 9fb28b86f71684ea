"""The single-node Ceph harness itself: it comes up on loopback only, S3 and CephFS work, two
ceph-fuse clients behave like two nodes, and stopping leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import ceph_cluster
from testkit.ceph_cluster import CephCluster, CephError

from layerstore import linux

pytestmark = [pytest.mark.ceph, pytest.mark.root]

HARNESS = Path(ceph_cluster.__file__)


def _listening_addresses(pids: list[int]) -> set[str]:
    """host:port of every TCP socket in LISTEN state owned by `pids` (from /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    host, port = local.split(":")
                    ip = ".".join(str(b) for b in bytes.fromhex(host)[::-1]) if len(host) == 8 else "ipv6:" + host
                    out.add(f"{ip}:{int(port, 16)}")
    return out


def _mounts_under(path: Path) -> list[str]:
    return [m.mountpoint for m in linux.mounts_under(linux.read_mounts(), str(path))]


def test_cluster_is_up_on_loopback_only(ceph: CephCluster) -> None:
    info = ceph.info()
    assert info["endpoint"] == ceph.endpoint and ceph.endpoint.startswith("http://127.0.0.1:")
    assert ceph.access_key and ceph.secret_key
    assert {"mon.a", "mgr.x", "osd.0", "rgw", "mds.a", "fuse.admin"} <= set(ceph.daemons)
    status = json.loads(ceph.ceph("status", "--format=json"))
    assert status["osdmap"]["num_up_osds"] == 1
    assert status["fsmap"]["up"] == 1
    daemon_pids = [d.pid for n, d in ceph.daemons.items() if not n.startswith("fuse.")]
    addresses = _listening_addresses(daemon_pids)
    assert f"127.0.0.1:{ceph.rgw_port}" in addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    state = json.loads((ceph.workdir / "state.json").read_text())
    assert state["pids"] == {n: d.pid for n, d in ceph.daemons.items()}


def test_s3_put_get_with_raw_boto3(s3_client: Any) -> None:
    s3_client.create_bucket(Bucket="harness-raw")
    body = os.urandom(300_000)
    s3_client.put_object(Bucket="harness-raw", Key="a/b", Body=body)
    assert s3_client.get_object(Bucket="harness-raw", Key="a/b")["Body"].read() == body
    got = s3_client.get_object(Bucket="harness-raw", Key="a/b", Range="bytes=10-19")["Body"].read()
    assert got == body[10:20]
    # the fact the S3 backend's create-once rests on
    with pytest.raises(Exception, match="PreconditionFailed"):
        s3_client.put_object(Bucket="harness-raw", Key="a/b", Body=b"other", IfNoneMatch="*")


def test_cephfs_mount_is_writable(ceph: CephCluster) -> None:
    d = ceph.mount_path / "harness-writable"
    d.mkdir(exist_ok=True)
    data = os.urandom(3 << 20)
    with open(d / "f", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    assert (d / "f").read_bytes() == data
    os.rename(d / "f", d / "g")
    assert sorted(os.listdir(d)) == ["g"]


@pytest.fixture(scope="module")
def peer(ceph: CephCluster) -> Iterator[Path]:
    """A second ceph-fuse client (its own session and caches: another node)."""
    path = ceph.mount_client("peer")
    try:
        yield path
    finally:
        ceph.unmount_client("peer")


def _eventually(fn: Any, timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (FileNotFoundError, AssertionError):
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def test_two_clients_see_each_others_files(ceph: CephCluster, peer: Path) -> None:
    a = ceph.mount_path / "harness-xclient"
    b = peer / "harness-xclient"
    a.mkdir(exist_ok=True)
    (a / "from-a").write_bytes(b"written by a")
    assert _eventually(lambda: (b / "from-a").read_bytes()) == b"written by a"
    (b / "from-b").write_bytes(b"written by b")
    assert _eventually(lambda: (a / "from-b").read_bytes()) == b"written by b"
    os.unlink(b / "from-a")

    def gone() -> None:
        assert not (a / "from-a").exists()

    _eventually(gone)


def _race(fns: list[Any]) -> list[Any]:
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fns[i]()
        except OSError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_o_excl_and_link_are_exclusive_across_clients(ceph: CephCluster, peer: Path) -> None:
    roots = [ceph.mount_path / "harness-excl", peer / "harness-excl"]
    roots[0].mkdir(exist_ok=True)
    _eventually(lambda: os.stat(roots[1]))
    for rnd in range(15):
        def create(root: Path, rnd: int = rnd) -> int:
            fd = os.open(root / f"excl-{rnd}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            return 1

        results = _race([lambda r=r: create(r) for r in roots])
        assert sorted(map(repr, results)).count("1") == 1, results
        assert all(r == 1 or (isinstance(r, OSError) and r.errno == errno.EEXIST) for r in results)

        for i, root in enumerate(roots):
            (root / f"tmp-{rnd}-{i}").write_bytes(f"{i}".encode())

        def link(i: int, rnd: int = rnd) -> int:
            os.link(roots[i] / f"tmp-{rnd}-{i}", roots[i] / f"final-{rnd}")
            return i

        results = _race([lambda i=i: link(i) for i in range(2)])
        winners = [r for r in results if isinstance(r, int)]
        assert len(winners) == 1, results
        assert all(isinstance(r, int) or r.errno == errno.EEXIST for r in results)
        for root in roots:
            final = root / f"final-{rnd}"
            assert _eventually(final.read_bytes) == str(winners[0]).encode()


def test_busy_client_is_detached_and_stopped(ceph: CephCluster) -> None:
    path = ceph.mount_client("busy")
    pid = ceph.daemons["fuse.busy"].pid
    f = open(path / "held-open", "w")  # noqa: SIM115 - held open across the unmount on purpose
    try:
        ceph.unmount_client("busy")
    finally:
        try:
            f.close()
        except OSError as e:
            assert e.errno == errno.ENOTCONN
    assert _mounts_under(path) == []
    assert "fuse.busy" not in ceph.daemons
    assert _until(lambda: not _running(pid))


def _until(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_shell_start_and_stop_leave_nothing_behind(tmp_path: Path) -> None:
    """`ceph_cluster.py start DIR` leaves a cluster running; `stop DIR` removes every mount and
    process, even a ceph-fuse that died and left a dead (ENOTCONN) mount."""
    workdir = tmp_path / "cluster"
    p = subprocess.run([sys.executable, str(HARNESS), "start", str(workdir)], capture_output=True, text=True,
                       timeout=120)
    try:
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)
        assert info["mount"] and Path(info["mount"]).is_dir()
        assert info["endpoint"].startswith("http://127.0.0.1:")
        pids = list(info["pids"].values())
        assert all(_running(pid) for pid in pids)
        fuse = info["pids"]["fuse.admin"]
        os.kill(fuse, signal.SIGKILL)
        assert _until(lambda: not _running(fuse))
    finally:
        s = subprocess.run([sys.executable, str(HARNESS), "stop", str(workdir)], capture_output=True, text=True,
                           timeout=120)
    assert s.returncode == 0, s.stderr
    assert _mounts_under(workdir) == []
    assert not any(_running(pid) for pid in pids)
    assert json.loads((workdir / "state.json").read_text())["pids"] == {}


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_missing_ceph_fails_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CephError, match="not found"):
        CephCluster(tmp_path / "c").start()
