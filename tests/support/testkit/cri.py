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
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import grpc

from snapshotter.stubs import cri_pb2 as pb
from snapshotter.stubs import cri_pb2_grpc as pbg

TIMEOUT = 120.0


class CriClient:
    def __init__(self, address: str, timeout: float = TIMEOUT) -> None:
        self.channel = grpc.insecure_channel(f"unix://{address}")
        self.runtime = pbg.RuntimeServiceStub(self.channel)
        self.images = pbg.ImageServiceStub(self.channel)
        self.timeout = timeout

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
    @staticmethod
    def pod_config(name: str) -> Any:
        host = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=secrets.token_hex(8), namespace="layerstore-test"),
            linux=pb.LinuxPodSandboxConfig(  # (no hostname: the pod has the node's UTS namespace)
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=host)))

    def run_pod(self, name: str) -> str:
        """RunPodSandbox in the node's network namespace; returns the pod sandbox id."""
        self._pods = getattr(self, "_pods", {})
        config = self.pod_config(name)
        res = self.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=self.timeout)
        self._pods[res.pod_sandbox_id] = config
        return str(res.pod_sandbox_id)

    def create(self, pod: str, name: str, image: str, command: list[str], *, env: dict[str, str] | None = None,
               workdir: str = "") -> str:
        """CreateContainer in a pod made by this client; returns the container id."""
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=image), command=command,
            working_dir=workdir, envs=[pb.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
            linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD))))
        res = self.runtime.CreateContainer(pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=config, sandbox_config=self._pods[pod]), timeout=self.timeout)
        return str(res.container_id)

    def start(self, container: str) -> None:
        self.runtime.StartContainer(pb.StartContainerRequest(container_id=container), timeout=self.timeout)

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
        getattr(self, "_pods", {}).pop(pod, None)


def push_pause(work: Path, registry: str, repo: str = "test/pause", tag: str = "1") -> str:
    """A pause (sandbox) image built here and pushed to a local registry, since nothing outside the
    machine can be reached: static busybox whose PID 1 sleeps (containerd kills the sandbox's task
    with SIGKILL when the pod stops). Returns its reference."""
    from .archive_factory import ImageSpec, Layer, write_oci_layout
    from .registry_images import push_layout, rootfs_tar
    from .shim_support import busybox_rootfs

    spec = ImageSpec([Layer(rootfs_tar(busybox_rootfs(work / "pause-rootfs")), "gzip")],
                     config={"Entrypoint": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin"], "WorkingDir": "/"})
    write_oci_layout(work / "pause-layout", spec)
    push_layout(work / "pause-layout", registry, repo, tag)
    return f"{registry}/{repo}:{tag}"
