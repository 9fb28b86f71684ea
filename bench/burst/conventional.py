"""The conventional path: what containerd's overlayfs snapshotter does with tar.gz layers.

Per node: every layer an environment needs is downloaded whole from the store (one stream per layer,
into the node's content directory, as containerd's content store does), then extracted with GNU tar
into a directory of its own (a snapshot). A layer is pulled once per node and shared (single flight:
sandboxes that need a layer being pulled wait for it). Each sandbox gets an overlay of its layers' snapshot
directories with a private upper, and runc runs the task on it. Layers are pulled in parallel and
extracted as soon as each one arrives: the favourable reading of containerd (which also limits
concurrent downloads per pull and unpacks a chain in order).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from . import oci
from .inputs import env_layers
from .sandbox import SandboxResult, parse_output, tail

S3_PREFIX = "conventional/"
SANDBOX_CGROUP_PARENT = "lsburst-sandboxes"
STREAM_BLOCK = 1 << 20


def s3_client(endpoint: str, pool: int = 16) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, config=Config(max_pool_connections=pool, retries={"max_attempts": 5},
                                                   s3={"addressing_style": "path"}))


def upload_layers(client: Any, bucket: str, layers: dict[str, Path]) -> dict[str, int]:
    """Put each layer's tar.gz in the store (setup, not timed)."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=4)
    sizes = {}
    for name, path in layers.items():
        key = f"{S3_PREFIX}{name}.tar.gz"
        size = path.stat().st_size
        try:
            if int(client.head_object(Bucket=bucket, Key=key)["ContentLength"]) == size:
                sizes[name] = size
                continue
        except Exception:  # noqa: BLE001 - any miss means upload
            pass
        client.upload_file(str(path), bucket, key, Config=cfg)
        sizes[name] = size
    return sizes


def mount_overlay(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """lowers top first, as overlayfs wants them."""
    for d in (upper, work, target):
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={':'.join(str(p) for p in lowers)},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)], check=True, capture_output=True)


class ConventionalNode:
    def __init__(self, node_dir: Path, *, endpoint: str, bucket: str, runc_root: Path) -> None:
        self.node_dir = node_dir
        self.endpoint = endpoint
        self.bucket = bucket
        self.runc_root = runc_root
        self.client = s3_client(endpoint)
        self._lock = threading.Lock()
        self._layers: dict[str, Future[Path]] = {}
        self.layer_times: dict[str, dict[str, float]] = {}
        self.mounts: list[Path] = []
        for d in ("content", "snapshots", "sandboxes"):
            (node_dir / d).mkdir(parents=True, exist_ok=True)

    # -- layers --------------------------------------------------------------------------
    def layer(self, name: str) -> Future[Path]:
        """The snapshot directory of a layer, pulled and extracted once per node."""
        with self._lock:
            fut = self._layers.get(name)
            if fut is None:
                fut = Future()
                self._layers[name] = fut
                threading.Thread(target=self._pull, args=(name, fut), daemon=True, name=f"pull-{name}").start()
            return fut

    def _pull(self, name: str, fut: Future[Path]) -> None:
        try:
            t0 = time.time()
            blob = self.node_dir / "content" / f"{name}.tar.gz"
            tmp = blob.with_suffix(".partial")
            body = self.client.get_object(Bucket=self.bucket, Key=f"{S3_PREFIX}{name}.tar.gz")["Body"]
            with open(tmp, "wb") as f:
                while chunk := body.read(STREAM_BLOCK):
                    f.write(chunk)
            os.replace(tmp, blob)
            t1 = time.time()
            snap = self.node_dir / "snapshots" / name / "fs"
            snap.mkdir(parents=True)
            subprocess.run(["tar", "--numeric-owner", "-xzf", str(blob), "-C", str(snap)], check=True,
                           capture_output=True)
            t2 = time.time()
            self.layer_times[name] = {"download_s": t1 - t0, "extract_s": t2 - t1, "ready": t2}
            fut.set_result(snap)
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            fut.set_exception(e)

    # -- sandboxes -----------------------------------------------------------------------
    def run_sandbox(self, index: int, env: str, command: list[str], result: SandboxResult) -> None:
        sid = f"lsb-c{os.getpid()}-{index}"
        box = self.node_dir / "sandboxes" / sid
        rootfs = box / "bundle" / "rootfs"
        t0 = time.time()
        futures = [self.layer(n) for n in env_layers(env)]
        lowers = [f.result() for f in reversed(futures)]  # top (workspace) first
        t1 = time.time()
        oci.write_bundle(box / "bundle", command, hostname=sid, cgroups_path=f"/{SANDBOX_CGROUP_PARENT}/{sid}")
        mount_overlay(lowers, box / "upper", box / "work", rootfs)
        with self._lock:
            self.mounts.append(rootfs)
        t2 = time.time()
        p = subprocess.run(["runc", "--root", str(self.runc_root), "run", "--bundle", str(box / "bundle"), sid],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
        result.finished = time.time()
        result.rc = p.returncode
        parse_output(p.stdout, result)
        if p.returncode != 0:
            result.error = tail(p.stderr + p.stdout)
        result.phases = {"wait_layers_s": t1 - t0, "compose_s": t2 - t1, "run_s": result.finished - t2}

    def teardown(self) -> None:
        for m in self.mounts:
            for _ in range(20):
                if subprocess.run(["umount", str(m)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        self.mounts.clear()
        # runc deletes a container when `run` returns; a crashed one is removed here.
        out = subprocess.run(["runc", "--root", str(self.runc_root), "list", "-q"], capture_output=True, text=True)
        for cid in out.stdout.split():
            with contextlib.suppress(Exception):
                subprocess.run(["runc", "--root", str(self.runc_root), "delete", "--force", cid], capture_output=True)

    def facts(self) -> dict[str, object]:
        from .lazy import process_write_bytes, tree_bytes

        sandboxes = self.node_dir / "sandboxes"
        uppers = sum(tree_bytes(d / "upper") for d in sandboxes.iterdir()) if sandboxes.exists() else 0
        return {"layers": self.layer_times,
                "disk_breakdown": {"content": tree_bytes(self.node_dir / "content"),
                                   "snapshots": tree_bytes(self.node_dir / "snapshots"),
                                   "uppers": uppers, "runc_state": tree_bytes(self.runc_root),
                                   "agent_write_bytes": process_write_bytes(os.getpid())}}

    @staticmethod
    def sandbox_cgroups(tag: str) -> str:
        return f"{SANDBOX_CGROUP_PARENT}/lsb-c{tag}-*"
