"""The CRI contenders: the containerd node of the containerd pair (ctrnode.ContainerdNode: containerd
1.6 on the fresh node disk, and for layerstore the snapshotter and the node daemon) with Kubernetes' CRI
plugin on, configured as the shipped snapshotter/contrib/containerd-cri.toml says (testkit.containerd.Cri),
and driven over the CRI API as the kubelet drives it (testkit.cri.CriClient):

- cri-overlayfs: the CRI plugin with containerd's overlayfs snapshotter pulls the ordinary OCI image of
  the environment (the conventional path's tar.gz layers) and unpacks it;
- cri-layerstore: the CRI plugin with snapshotter "layerstore" pulls the image of layer pointers; the
  snapshotter reads the image's manifest from the registry itself (the CRI labels), mounts each blob
  lazily through the node daemon and answers AlreadyExists: no layer enters containerd's content store.

Per environment one PullImage (single flight, as for the containerd pair), then per sandbox
RunPodSandbox + CreateContainer + StartContainer, all launched at once. The pod sandboxes (host network,
the busybox pause image pulled before the burst) cost both sides the same runtime work. A sandbox has
started at its own start mark (read from its CRI log file), finished at the runtime's `finished_at`;
pods are removed at teardown, after the counters were read.

`time_pulls`: PullImage alone, per environment and round, on a node whose services already run; after
each pull the image is removed (RemoveImage, then containerd's collection of its snapshots is awaited)
and for layerstore the node cache emptied, so every pull starts cold.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from testkit.containerd import Cri
from testkit.cri import CriClient, cri_log_text

from .ctrnode import SANDBOX_CGROUP_PARENT, ContainerdNode
from .sandbox import SandboxResult, parse_output, tail

CRI_NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
POD_NAMESPACE = "lsburst"
TASK_LOG = "task.log"
CRI_TIMEOUT = 1800.0  # a PullImage of a big image through a slow link may take minutes
COLLECT_TIMEOUT = 60.0


class CriNode(ContainerdNode):
    namespace = CRI_NAMESPACE
    prefix = "c"

    def __init__(self, node_dir: Path, *, pause: str, **kw: Any) -> None:
        self.pause = pause
        self.cri: CriClient | None = None
        self.logs = node_dir / "pods"  # the pods' log directories, on the node disk
        self.baseline_snapshots = 0
        super().__init__(node_dir, **kw)

    # -- node services -------------------------------------------------------------------------
    def top_lines(self) -> list[str]:
        return []  # the CRI plugin stays on

    def plugin_lines(self) -> list[str]:
        (self.run / "cni").mkdir(exist_ok=True)  # (host-network pods: no CNI plugin is called)
        section = Cri(self.pause, (self.registry,), snapshotter=self.snapshotter).section(self.run)
        # runc's state of this node's tasks in its own directory: other CRI containerds on the machine
        # use the k8s.io namespace too
        return [*section, '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]',
                f'  Root = "{self.runc_state()}"']

    def runc_state(self) -> Path:
        return self.run / "runc"

    def ready(self) -> None:
        self.cri = CriClient(self.address, timeout=CRI_TIMEOUT, pod_namespace=POD_NAMESPACE)
        self.cri.pull(self.pause)  # before the burst: the pod sandbox image costs neither side
        self.baseline_snapshots = len(self.snapshots())

    def snapshots(self) -> list[str]:
        p = subprocess.run(self._ctr("snapshots", "--snapshotter", self.snapshotter, "ls"), capture_output=True,
                           text=True)
        return [ln.split()[0] for ln in p.stdout.splitlines()[1:] if ln.strip()]

    # -- the burst -----------------------------------------------------------------------------
    def pull_image(self, ref: str) -> None:
        assert self.cri is not None
        self.cri.pull(ref)

    def run_sandbox(self, index: int, env: str, command: list[str], result: SandboxResult) -> None:
        assert self.cri is not None
        sid = self.sandbox_id(index)
        logs = self.logs / sid
        logs.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        self.pull(env).result()
        t1 = time.time()
        pod = self.cri.run_pod(sid, cgroup_parent=f"/{SANDBOX_CGROUP_PARENT}/{sid}", log_directory=str(logs))
        t2 = time.time()
        cid = self.cri.create(pod, "task", self.refs[env], command, log_path=TASK_LOG)
        t3 = time.time()
        self.cri.start(cid)
        t4 = time.time()
        st = self.cri.wait_exited(cid, timeout=CRI_TIMEOUT)
        result.finished = st.finished_at / 1e9 if st.finished_at else time.time()
        result.rc = int(st.exit_code)
        log = logs / TASK_LOG
        text = cri_log_text(log.read_text(errors="replace")) if log.exists() else ""
        parse_output(text, result)
        if result.rc != 0:
            result.error = tail(f"{st.reason} {st.message}\n{text}")
        result.phases = {"wait_pull_s": t1 - t0, "run_pod_s": t2 - t1, "create_s": t3 - t2, "start_s": t4 - t3,
                         "run_s": result.finished - t4}

    # -- PullImage alone -------------------------------------------------------------------------
    def time_pulls(self, rounds: int) -> list[dict[str, Any]]:
        """Each environment's PullImage, `rounds` times, each from a cold node (see the module's note)."""
        assert self.cri is not None
        out = []
        for r in range(rounds):
            for env, ref in self.refs.items():
                sample: dict[str, Any] = {"env": env, "round": r + 1}
                try:
                    t = time.monotonic()
                    self.cri.pull(ref)
                    sample["pull_s"] = round(time.monotonic() - t, 4)
                    sample.update(self.forget(ref))
                except Exception as e:  # noqa: BLE001 - one failed pull is a sample, not the end
                    sample["error"] = tail(str(e), 600)
                out.append(sample)
        return out

    def forget(self, ref: str) -> dict[str, Any]:
        """RemoveImage, wait for containerd's collection of its snapshots (the pause image's stay),
        and for layerstore drop the node cache: the next pull starts cold."""
        assert self.cri is not None
        self.cri.remove_image(ref)
        deadline = time.monotonic() + COLLECT_TIMEOUT
        while (left := len(self.snapshots()) - self.baseline_snapshots) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        facts: dict[str, Any] = {"snapshots_left": left}
        if self.snapshotter == "layerstore":
            p = subprocess.run([self.layerctl, "cache", "evict", "--all", "--cache", str(self.ls_node / "cache"),
                                "--json"], capture_output=True, text=True)
            with contextlib.suppress(ValueError):
                facts["evicted_bytes"] = json.loads(p.stdout).get("evicted_bytes")
        return facts

    # -- the end -------------------------------------------------------------------------------
    def stop_sandboxes(self) -> None:
        if self.cri is not None:
            for pod in self.cri.pods():
                with contextlib.suppress(Exception):
                    self.cri.remove_pod(pod)
        super().stop_sandboxes()  # what is left, by ctr

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.cri is not None:
                self.cri.close()
