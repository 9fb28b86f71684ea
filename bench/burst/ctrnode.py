"""The containerd contenders: a real containerd (Debian's 1.6) on the node pulling the environments'
images from a registry behind the same shaped link as the store.

- containerd-overlayfs: containerd's own path: `ctr images pull` of an OCI image whose layers are the
  very tar.gz files the conventional contender uses (pushed to the registry at set-up), unpacked by
  containerd into its default overlayfs snapshotter, then `ctr run`.
- containerd-layerstore: the layerstore snapshotter as a proxy plugin; each environment was pushed as an
  image of layer pointers (`layerctl ctr push`) and is pulled with `layerctl ctr pull`: nothing of the
  layers is downloaded by containerd, the snapshotter mounts the blobs lazily through the node daemon
  (which reads the S3 store through the link); then the same `ctr run`.

Per environment one pull (single flight: sandboxes that need an image being pulled wait for it), then
one `ctr run --rm` per sandbox, all launched at once. containerd, the snapshotter and the node daemon are
started before the burst (node services), on an empty node.

Set-up (not timed): the registry (Debian's docker-registry) runs in the link's namespace; `push_images`
writes the OCI images and `push_environments` the layerstore ones.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from erofs_builder.sources.registry_auth import INSECURE_ENV

from .inputs import Layer, env_layers
from .lazy import sweep_mounts, tree_bytes
from .netlink import Link
from .sandbox import SandboxResult, parse_output, tail

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
REGISTRY = "/usr/bin/docker-registry"
REGISTRY_PORT = 5000
SANDBOX_CGROUP_PARENT = "lsburst-sandboxes"
NAMESPACE = "lsburst"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def missing() -> list[str]:
    return [p for p in (CONTAINERD, CTR, REGISTRY) if not os.path.exists(p)]


class RegistryProcess:
    """docker-registry inside the link's namespace, listening on the store end of the veth pair."""

    def __init__(self, link: Link, workdir: Path) -> None:
        self.link = link
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"{self.link.store_addr}:{REGISTRY_PORT}"

    def start(self, timeout: float = 30.0) -> None:
        import urllib.request

        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "config.yml"
        cfg.write_text("\n".join([
            "version: 0.1", "log:", "  level: warn", "  accesslog:", "    disabled: true", "storage:",
            "  filesystem:", f"    rootdirectory: {self.workdir / 'storage'}", "  maintenance:",
            "    uploadpurging:", "      enabled: false", "http:", f"  addr: {self.host}",
            "health:", "  storagedriver:", "    enabled: false", ""]))
        with open(self.workdir / "registry.log", "ab") as out:
            self.proc = subprocess.Popen(self.link.ns_argv([REGISTRY, "serve", str(cfg)]), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {(self.workdir / 'registry.log').read_text()[-800:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError("docker-registry did not answer")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _diff_id(tar_gz: Path, cache: dict[str, str]) -> str:
    key = f"{tar_gz}:{tar_gz.stat().st_size}:{tar_gz.stat().st_mtime_ns}"
    if key not in cache:
        h = hashlib.sha256()
        with gzip.open(tar_gz, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        cache[key] = "sha256:" + h.hexdigest()
    return cache[key]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def push_images(registry: str, layers: dict[str, Layer], environments: tuple[str, ...]) -> dict[str, str]:
    """Each environment as an ordinary OCI image of its tar.gz layers; returns env -> reference."""
    from erofs_builder.sources.registry import OCI_MANIFEST, RegistryClient

    refs: dict[str, str] = {}
    diff_ids: dict[str, str] = {}
    digests: dict[str, str] = {}
    with RegistryClient(registry, insecure=True, auth=None) as reg:
        for env in environments:
            names = env_layers(env)
            repo = f"burst/{env}"
            descs = []
            for n in names:
                path = layers[n].tar_gz
                digest = digests.setdefault(n, _file_sha256(path))
                reg.push_blob(repo, path, digest)
                descs.append({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": path.stat().st_size})
            config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/sh"]},
                                 "rootfs": {"type": "layers",
                                            "diff_ids": [_diff_id(layers[n].tar_gz, diff_ids) for n in names]}},
                                sort_keys=True).encode()
            cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
            reg.push_blob(repo, config, cdigest)
            manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                   "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                              "digest": cdigest, "size": len(config)},
                                   "layers": descs}, sort_keys=True).encode()
            reg.put_manifest(repo, "oci", manifest, OCI_MANIFEST)
            refs[env] = f"{registry}/{repo}:oci"
    return refs


def push_environments(registry: str, layerctl: str, store_url: str, env_refs: dict[str, str]) -> dict[str, str]:
    """Each layerstore environment as an image of layer pointers (`layerctl ctr push`)."""
    refs = {}
    env = {**os.environ, INSECURE_ENV: registry}
    for name, ref in env_refs.items():
        target = f"{registry}/burst/{name}:layerstore"
        p = subprocess.run([layerctl, "ctr", "push", "--store", store_url, ref, target], capture_output=True,
                           text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"layerctl ctr push {ref}: {tail(p.stderr, 600)}")
        refs[name] = target
    return refs


class ContainerdNode:
    """containerd (and for `snapshotter="layerstore"` the layerstore snapshotter and the node daemon)
    on `node_dir`; its sockets under a short directory in /run. A subclass (crinode.CriNode) changes
    the config (`top_lines`, `plugin_lines`), the pull (`pull_image`), the sandbox and `stop_sandboxes`."""

    namespace = NAMESPACE
    prefix = "k"  # of the sandboxes' ids and cgroups: lsb-<prefix><tag>-<index>

    def __init__(self, node_dir: Path, *, image_refs: dict[str, str], snapshotter: str, registry: str,
                 layerctl: str, store_url: str = "") -> None:
        self.node_dir = node_dir
        self.refs = image_refs
        self.snapshotter = snapshotter
        self.registry = registry
        self.layerctl = layerctl
        self.store_url = store_url
        self.tag = f"{os.getpid()}"
        self.run = Path(f"/run/lsb-ctd-{self.tag}")
        self.address = str(self.run / "containerd.sock")
        self.procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._pulls: dict[str, Future[float]] = {}
        self.pull_times: dict[str, float] = {}
        self.start_s: float | None = None
        self.run.mkdir(mode=0o711, parents=True, exist_ok=True)
        t = time.monotonic()
        try:
            if snapshotter == "layerstore":
                self._start_layerstore()
            self._start_containerd()
            self.ready()
        except BaseException:
            self.teardown()
            raise
        self.start_s = round(time.monotonic() - t, 3)

    # -- node services -------------------------------------------------------------------------
    @property
    def ls_node(self) -> Path:
        """The layerstore node directory: beside the contender's directory on the same fresh node disk
        (a short path: the daemon's control socket lives in it, and unix socket paths are short)."""
        return self.node_dir.parent / "k"

    def _start_layerstore(self) -> None:
        from runtime_shim.node.shim import Shim

        with Shim.for_node(self.ls_node, self.store_url) as shim, shim.lock:
            shim.blobs.ensure()  # the node daemon on an empty cache, before the burst (as for `lazy`)
        sock = self.run / "snapshotter.sock"
        # (the snapshotter reads pointer images itself when the CRI plugin pulls: the plain-HTTP registry)
        with open(self.node_dir / "snapshotter.log", "ab") as out:
            self.procs.append(subprocess.Popen([self.layerctl, "snapshotter", "--address", str(sock), "--node-dir",
                                                str(self.ls_node), "--store", self.store_url], stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env={**os.environ, INSECURE_ENV: self.registry}))
        _wait_for(sock, self.procs[-1], "the layerstore snapshotter")

    def top_lines(self) -> list[str]:
        """Top-level keys of containerd's config beyond root and state (before any table)."""
        return ['disabled_plugins = ["io.containerd.grpc.v1.cri"]']

    def plugin_lines(self) -> list[str]:
        """Tables appended to containerd's config."""
        return []

    def ready(self) -> None:
        """After containerd answers, before the burst (not timed)."""

    def _start_containerd(self) -> None:
        root = self.node_dir / "containerd"
        lines = ["version = 2", f'root = "{root}"', f'state = "{self.run / "state"}"', *self.top_lines(),
                 "[grpc]", f'  address = "{self.address}"', "[ttrpc]", f'  address = "{self.address}.ttrpc"',
                 '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{root / "opt"}"']
        if self.snapshotter == "layerstore":
            lines += ["[proxy_plugins.layerstore]", '  type = "snapshot"',
                      f'  address = "{self.run / "snapshotter.sock"}"']
        lines += self.plugin_lines()
        (self.run / "config.toml").write_text("\n".join(lines) + "\n")
        with open(self.node_dir / "containerd.log", "ab") as out:
            self.procs.append(subprocess.Popen([CONTAINERD, "--config", str(self.run / "config.toml")], stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        _wait_for(Path(self.address), self.procs[-1], "containerd")
        deadline = time.monotonic() + 20
        while subprocess.run(self._ctr("version"), capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("containerd does not answer")
            time.sleep(0.05)

    def _ctr(self, *args: str) -> list[str]:
        return [CTR, "--address", self.address, "--namespace", self.namespace, *args]

    # -- the burst -----------------------------------------------------------------------------
    def pull(self, env: str) -> Future[float]:
        with self._lock:
            fut = self._pulls.get(env)
            if fut is None:
                fut = self._pulls[env] = Future()
                threading.Thread(target=self._pull, args=(env, fut), daemon=True, name=f"pull-{env}").start()
            return fut

    def _pull(self, env: str, fut: Future[float]) -> None:
        try:
            t0 = time.time()
            self.pull_image(self.refs[env])
            self.pull_times[env] = time.time() - t0
            fut.set_result(time.time())
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            fut.set_exception(e)

    def pull_image(self, ref: str) -> None:
        if self.snapshotter == "layerstore":
            argv = [self.layerctl, "ctr", "pull", "--address", self.address, "-n", self.namespace, ref]
        else:
            argv = self._ctr("images", "pull", "--plain-http", ref)
        p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           env={**os.environ, INSECURE_ENV: self.registry})
        if p.returncode != 0:
            raise RuntimeError(f"pull {ref}: {tail(p.stderr + p.stdout, 800)}")

    def run_sandbox(self, index: int, env: str, command: list[str], result: SandboxResult) -> None:
        sid = self.sandbox_id(index)
        t0 = time.time()
        self.pull(env).result()
        t1 = time.time()
        argv = self._ctr("run", "--rm", "--snapshotter", self.snapshotter,
                         "--cgroup", f"/{SANDBOX_CGROUP_PARENT}/{sid}", self.refs[env], sid, *command)
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
        result.finished = time.time()
        result.rc = p.returncode
        parse_output(p.stdout, result)
        if p.returncode != 0:
            result.error = tail(p.stderr + p.stdout)
        result.phases = {"wait_pull_s": t1 - t0, "run_s": result.finished - t1}

    # -- the end -------------------------------------------------------------------------------
    def sandbox_id(self, index: int) -> str:
        return f"lsb-{self.prefix}{self.tag}-{index}"

    def stop_sandboxes(self) -> None:
        """Kill and delete what still runs (containerd answers)."""
        tasks = subprocess.run(self._ctr("tasks", "ls", "-q"), capture_output=True, text=True).stdout.split()
        for task in tasks:
            subprocess.run(self._ctr("tasks", "kill", "-s", "SIGKILL", task), capture_output=True)
            subprocess.run(self._ctr("tasks", "delete", "-f", task), capture_output=True)

    def runc_state(self) -> Path:
        """runc's state directory for this node's tasks (the runtime's default root per namespace)."""
        return Path("/run/containerd/runc") / self.namespace

    def teardown(self) -> None:
        if self.procs and self.procs[-1].poll() is None and os.path.exists(self.address):
            with contextlib.suppress(Exception):
                self.stop_sandboxes()
        for proc in reversed(self.procs):  # containerd first, then the snapshotter
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.procs.clear()
        for pid in _shims(self.address):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.snapshotter == "layerstore" and self.ls_node.exists():
            from runtime_shim.node.shim import Shim

            with contextlib.suppress(Exception), Shim.for_node(self.ls_node, self.store_url,
                                                               auto_recover=False) as shim, shim.lock:
                shim.blobs.stop()
        sweep_mounts(self.run)
        sweep_mounts(self.node_dir)
        sweep_mounts(self.ls_node)
        with contextlib.suppress(OSError):
            subprocess.run(["rm", "-rf", str(self.run), str(self.runc_state())], capture_output=True)

    def facts(self) -> dict[str, Any]:
        root = self.node_dir / "containerd"
        out: dict[str, Any] = {"start_s": self.start_s, "pull_s": self.pull_times, "snapshotter": self.snapshotter}
        breakdown = {"content": tree_bytes(root / "io.containerd.content.v1.content"),
                     "containerd_metadata": tree_bytes(root / "io.containerd.metadata.v1.bolt"),
                     "overlayfs_snapshots": tree_bytes(root / "io.containerd.snapshotter.v1.overlayfs")}
        if self.snapshotter == "layerstore":
            snap = self.ls_node / "snapshotter"  # (not layers/: those are the EROFS mounts' contents)
            breakdown["layerstore_snapshots"] = tree_bytes(snap / "snapshots") + tree_bytes(snap / "metadata")
            breakdown["cache"] = tree_bytes(self.ls_node / "cache")
            with contextlib.suppress(Exception):
                p = subprocess.run([self.layerctl, "stats", "--cache", str(self.ls_node / "cache"), "--json"],
                                   capture_output=True, text=True)
                out["daemon_stats"] = json.loads(p.stdout)
        out["disk_breakdown"] = breakdown
        return out

    @classmethod
    def sandbox_cgroups(cls, tag: str) -> str:
        return f"{SANDBOX_CGROUP_PARENT}/lsb-{cls.prefix}{tag}-*"


def _wait_for(path: Path, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.02)


def _shims(address: str) -> list[int]:
    """containerd shims started by the containerd at `address` (their command line names it)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
                if b"containerd-shim" in cmd and address.encode() in cmd:
                    out.append(int(entry))
    return out


