"""The same VM for Firecracker and Cloud Hypervisor: their JSON configurations from a `VmSpec`
(pure; nothing here starts either VMM: only QEMU is booted on this node kind).

Firecracker      the `--config-file` document, whose shape is the API's `FullVmConfiguration`
                 (src/firecracker/swagger/firecracker.yaml): boot-source, drives,
                 machine-config, pmem, vsock.
Cloud Hypervisor the `PUT /api/v1/vm.create` body, `VmConfig`
                 (vmm/src/api/openapi/cloud-hypervisor.yaml): payload, cpus, memory, disks,
                 pmem, serial, console, vsock.

What maps one to one: kernel, initrd and command line; memory and vCPUs; each drive (its path,
read-only flag, and the name the guest finds it by: QEMU and Cloud Hypervisor give the guest the
drive's `serial`; Firecracker answers the virtio-blk GET_ID request with the `drive_id`, so the
serial is the drive id there, and a serial Firecracker would refuse as an id is refused here);
`direct` (O_DIRECT on the host) for Cloud Hypervisor (Firecracker has no such switch: its
"Sync" engine goes through the host page cache); pmem devices (Cloud Hypervisor has no read-only
pmem: `discard_writes` maps it privately, so the guest's writes never reach the file).

What does not: neither VMM has virtio-console ports, which the QEMU runner uses for the guest's
stdout, stderr and status streams. Both have a hybrid vsock whose guest-initiated connections
to port P arrive at the host's unix socket `<uds>_<P>`: stream number i becomes port
`STREAM_PORT_BASE + i` (`VmmConfig.stream_ports`), and the host listens on
`<uds>_<port>` where QEMU's runner listens on the stream's own socket. The guest init then needs
a vsock client instead of /dev/vport* (see docs/vm-flattened.md). The console log: Cloud
Hypervisor writes its serial port to a file; Firecracker writes it to its own stdout (redirect
that), as its config file has no serial section. The `machine` type is QEMU's: both VMMs have
their own virtio-mmio (Firecracker) or PCI (Cloud Hypervisor) machine.

Kernels: both boot an uncompressed ELF `vmlinux` on x86_64 (Firecracker only that; Cloud
Hypervisor a PVH ELF or firmware), not the bzImage QEMU is given: `kernel=` overrides the path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .spec import VmSpec, VmSpecError

STREAM_PORT_BASE = 1024
GUEST_CID = 3  # the first CID a guest may have (0-2 are reserved)
_FC_ID = re.compile(r"[A-Za-z0-9_]{1,64}")  # Firecracker's device id rule


@dataclass(frozen=True)
class VmmConfig:
    vmm: str  # "firecracker" | "cloud-hypervisor"
    config: dict[str, Any]  # the JSON document
    stream_ports: dict[str, int] = field(default_factory=dict)  # stream name -> guest vsock port
    vsock_uds: str | None = None  # the host socket the VMM's vsock proxies through


def _vsock_uds(spec: VmSpec, uds: str | None) -> str | None:
    if not spec.streams:
        return None
    if uds is None:
        uds = os.path.join(os.path.dirname(spec.streams[0].socket), "vsock.sock")
    if not os.path.isabs(uds) or any(c in uds for c in ",\n\0"):
        raise VmSpecError(f"vsock socket path {uds!r}: want an absolute path without ',' or newlines")
    return uds


def _ports(spec: VmSpec) -> dict[str, int]:
    return {s.name: STREAM_PORT_BASE + i for i, s in enumerate(spec.streams)}


def firecracker_config(spec: VmSpec, *, kernel: str | None = None, vsock_uds: str | None = None) -> VmmConfig:
    """Firecracker's `--config-file` JSON for `spec` (checked first)."""
    spec.check()
    boot: dict[str, Any] = {"kernel_image_path": kernel or spec.kernel, "boot_args": spec.cmdline}
    if spec.initrd:
        boot["initrd_path"] = spec.initrd
    drives = []
    for d in spec.drives:
        if not _FC_ID.fullmatch(d.serial):
            raise VmSpecError(f"drive serial {d.serial!r} cannot be a Firecracker drive id ([A-Za-z0-9_])")
        drives.append({"drive_id": d.serial, "path_on_host": d.path, "is_root_device": False,
                       "is_read_only": d.read_only, "cache_type": "Unsafe", "io_engine": "Sync"})
    config: dict[str, Any] = {
        "boot-source": boot,
        "drives": drives,
        "machine-config": {"vcpu_count": spec.vcpus, "mem_size_mib": spec.memory_mib, "smt": False},
    }
    if spec.pmem:
        config["pmem"] = [{"id": f"pmem{i}", "path_on_host": p.path, "root_device": False, "read_only": p.read_only}
                          for i, p in enumerate(spec.pmem)]
    uds = _vsock_uds(spec, vsock_uds)
    if uds is not None:
        config["vsock"] = {"guest_cid": GUEST_CID, "uds_path": uds}
    return VmmConfig("firecracker", config, _ports(spec), uds)


def cloud_hypervisor_config(spec: VmSpec, *, kernel: str | None = None,
                            vsock_uds: str | None = None) -> VmmConfig:
    """Cloud Hypervisor's `vm.create` body for `spec` (checked first)."""
    spec.check()
    payload: dict[str, Any] = {"kernel": kernel or spec.kernel, "cmdline": spec.cmdline}
    if spec.initrd:
        payload["initramfs"] = spec.initrd
    config: dict[str, Any] = {
        "payload": payload,
        "cpus": {"boot_vcpus": spec.vcpus, "max_vcpus": spec.vcpus},
        "memory": {"size": spec.memory_mib << 20},
        "disks": [{"path": d.path, "readonly": d.read_only, "direct": d.direct, "serial": d.serial,
                   "id": f"disk{i}", "image_type": "Raw"} for i, d in enumerate(spec.drives)],
        "serial": {"mode": "File", "file": spec.console_log} if spec.console_log else {"mode": "Null"},
        "console": {"mode": "Off"},
    }
    if spec.pmem:
        config["pmem"] = [{"file": p.path, "size": p.size, "discard_writes": p.read_only, "id": f"pmem{i}"}
                          for i, p in enumerate(spec.pmem)]
    uds = _vsock_uds(spec, vsock_uds)
    if uds is not None:
        config["vsock"] = {"cid": GUEST_CID, "socket": uds}
    return VmmConfig("cloud-hypervisor", config, _ports(spec), uds)


def emit_all(spec: VmSpec, *, kernel: str | None = None) -> dict[str, VmmConfig]:
    return {"firecracker": firecracker_config(spec, kernel=kernel),
            "cloud-hypervisor": cloud_hypervisor_config(spec, kernel=kernel)}
