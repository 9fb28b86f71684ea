"""A small client of Kubernetes' CRI (runtime.v1) for tests and benchmarks, over containerd's
socket (the CRI plugin serves it there), with the stubs generated from snapshotter/protos/
(`cri.proto`). Pods use the node's network namespace, so no CNI plugin is needed.

    with CriClient(ctd.cri_address) as cri:
        ref = cri.pull("127.0.0.1:5000/envs/py:1")
        pod = cri.run_pod("p1")
        cid = cri.create(pod, "c1", ref, ["sleep", "600"])
        cri.start(cid)
        code, out, err = cri.exec(cid, ["cat", "/etc/os-release"])
        cri.remove_pod(pod)                                  # stops it first

A benchmark's pods: `run_pod(name, cgroup_parent=..., log_directory=...)`, a container with
`create(..., log_path="task.log")` (its output in CRI's log format: `cri_log_text`), and
`wait_exited(cid)` for its exit code and end time. One client may serve many threads.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from snapshotter.stubs import cri_pb2 as pb
from snapshotter.stubs import cri_pb2_grpc as pbg

TIMEOUT = 120.0
POD_NAMESPACE = "layerstore-test"


class CriClient:
    def __init__(self, address: str, timeout: float = TIMEOUT, pod_namespace: str = POD_NAMESPACE) -> None:
        self.channel = grpc.insecure_channel(f"unix://{address}")
        self.runtime = pbg.RuntimeServiceStub(self.channel)
        self.images = pbg.ImageServiceStub(self.channel)
        self.timeout = timeout
        self.pod_namespace = pod_namespace
        self._pods: dict[str, Any] = {}  # pod id -> its config (CreateContainer sends it again)
        self._mu = threading.Lock()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def version(self) -> Any:
        return self.runtime.Version(pb.VersionRequest(version="v1"), timeout=self.timeout)

    # -- images ----------------------------------------------------------------------------------
    def pull(self, image: str) -> str:
        """PullImage; returns the image's id (its config digest) as the CRI names it."""
        res = self.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=image)), timeout=self.timeout)
        return str(res.image_ref)

    def image_status(self, image: str) -> Any:
        """The image's record, or None if the CRI does not know it."""
        res = self.images.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=image)), timeout=self.timeout)
        return res.image if res.HasField("image") else None

    def remove_image(self, image: str) -> None:
        self.images.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=image)), timeout=self.timeout)

    # -- pods and containers ---------------------------------------------------------------------
    def pod_config(self, name: str, *, cgroup_parent: str = "", log_directory: str = "") -> Any:
        host = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=secrets.token_hex(8), namespace=self.pod_namespace),
            log_directory=log_directory,
            linux=pb.LinuxPodSandboxConfig(  # (no hostname: the pod has the node's UTS namespace)
                cgroup_parent=cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=host)))

    def run_pod(self, name: str, *, cgroup_parent: str = "", log_directory: str = "") -> str:
        """RunPodSandbox in the node's network namespace; returns the pod sandbox id. Its
        containers' cgroups go under `cgroup_parent`, their logs under `log_directory`."""
        config = self.pod_config(name, cgroup_parent=cgroup_parent, log_directory=log_directory)
        res = self.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=self.timeout)
        with self._mu:
            self._pods[res.pod_sandbox_id] = config
        return str(res.pod_sandbox_id)

    def pods(self) -> list[str]:
        """The pods this client made and has not removed."""
        with self._mu:
            return list(self._pods)

    def create(self, pod: str, name: str, image: str, command: list[str], *, env: dict[str, str] | None = None,
               workdir: str = "", log_path: str = "") -> str:
        """CreateContainer in a pod made by this client; returns the container id. `log_path`
        (relative to the pod's log directory) receives its output."""
        with self._mu:
            sandbox_config = self._pods[pod]
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=image), command=command,
            working_dir=workdir, envs=[pb.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
            log_path=log_path,
            linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD))))
        res = self.runtime.CreateContainer(pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=config, sandbox_config=sandbox_config), timeout=self.timeout)
        return str(res.container_id)

    def start(self, container: str) -> None:
        self.runtime.StartContainer(pb.StartContainerRequest(container_id=container), timeout=self.timeout)

    def status(self, container: str) -> Any:
        """ContainerStatus: state, exit_code, finished_at (ns), reason, message."""
        res = self.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=container), timeout=self.timeout)
        return res.status

    def wait_exited(self, container: str, timeout: float = 600.0, poll: float = 0.25) -> Any:
        """Poll ContainerStatus until the container has exited; its status (exit code, end time).
        The poll interval does not bias the end time: `finished_at` is the runtime's."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(container)
            if st.state == pb.CONTAINER_EXITED:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"container {container} still {pb.ContainerState.Name(st.state)} after {timeout}s")
            time.sleep(poll)

    def exec(self, container: str, cmd: list[str], timeout: int = 60) -> tuple[int, bytes, bytes]:
        """ExecSync: (exit code, stdout, stderr)."""
        res = self.runtime.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=cmd, timeout=timeout),
                                    timeout=timeout + 30)
        return int(res.exit_code), bytes(res.stdout), bytes(res.stderr)

    def stop_container(self, container: str, timeout: int = 0) -> None:
        self.runtime.StopContainer(pb.StopContainerRequest(container_id=container, timeout=timeout),
                                   timeout=self.timeout)

    def remove_container(self, container: str) -> None:
        self.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=container), timeout=self.timeout)

    def stop_pod(self, pod: str) -> None:
        self.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=self.timeout)

    def remove_pod(self, pod: str) -> None:
        """StopPodSandbox then RemovePodSandbox (its containers go with it)."""
        self.stop_pod(pod)
        self.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=self.timeout)
        with self._mu:
            self._pods.pop(pod, None)


def cri_log_text(text: str) -> str:
    """A container's output from its CRI log file: each line is `TIME STREAM TAG CONTENT`, TAG `P`
    for a partial line continued on the next one, `F` for a full one (stdout and stderr interleaved)."""
    out: list[str] = []
    part: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(" ", 3)
        if len(fields) < 3:
            continue
        stream, tag = fields[1], fields[2].split(":")[0]
        content = part.pop(stream, "") + (fields[3] if len(fields) == 4 else "")
        if tag == "P":
            part[stream] = content
        else:
            out.append(content)
    out += part.values()
    return "\n".join(out) + ("\n" if out else "")


def push_pause(work: Path, registry: str, repo: str = "test/pause", tag: str = "1", **client: object) -> str:
    """A pause (sandbox) image built here and pushed to a local registry, since nothing outside the
    machine can be reached: static busybox whose PID 1 sleeps (containerd kills the sandbox's task
    with SIGKILL when the pod stops). Returns its reference. `client`: RegistryClient keywords
    (`insecure=True` for a plain-HTTP registry off the loopback)."""
    from .archive_factory import ImageSpec, Layer, write_oci_layout
    from .registry_images import push_layout, rootfs_tar
    from .shim_support import busybox_rootfs

    spec = ImageSpec([Layer(rootfs_tar(busybox_rootfs(work / "pause-rootfs")), "gzip")],
                     config={"Entrypoint": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin"], "WorkingDir": "/"})
    write_oci_layout(work / "pause-layout", spec)
    push_layout(work / "pause-layout", registry, repo, tag, **client)
    return f"{registry}/{repo}:{tag}"
