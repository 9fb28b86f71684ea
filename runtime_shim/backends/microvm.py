"""The microVM backend ("microvm"): a QEMU `microvm` per sandbox (virtio-mmio, no PCI, no
firmware to speak of) whose guest composes the sandbox's root itself from one read-only drive per
layer. KVM where /dev/kvm boots a guest, TCG otherwise (`runtime_shim.vm.qemu`).

The sandbox is made by `Shim.mount(guest="microvm")` (`guest_root` tells the runner so): the
node mounts each layer once, shared and counted like any sandbox's, and the file each layer mount
reads is the drive the VM gets, read-only: the node daemon's lazily fetched blob file while the
blob is partly cached (so the guest's reads are the node's only fetches beyond the metadata the
node's mount reads), the pinned cache file once it is complete. Nothing is copied. The guest gets,
in this order (its init finds them by serial):

    "layer0".."layerN-1"  the layers, bottom first, read-only (EROFS)
    "upper"               a kept sandbox's upper drive: NODE/sandboxes/<id>/upper.img, a sparse ext4
                          image the shim made, read-write (a sandbox that is not kept has its upper
                          on a tmpfs in the guest's memory, half of it at most, and no upper drive)
    "config"              the workload (`runtime_shim.vm.config`), 0600, read-only

and nothing else: no network, no shared directory, no other host file. The guest's init stacks the
layers with overlayfs under the upper, runs the command (env, workdir, user of the environment)
and reports stdout, stderr and the exit status on virtio-console ports.

Confinement in a VM: the VM is the boundary. `memory` sizes the guest (at most MAX_MEMORY_MIB),
`cpus` gives its vCPUs (rounded up, at most the host's), `new_privileges` lifts nosuid from the
guest's root; seccomp, masked paths and the pids limit are the container backend's (the guest
kernel is the workload's own).

Commit (`upper_source`): the upper drive is read after the VM stopped, never by the host kernel: a
fresh helper VM of the same kit (init mode "export") mounts it read-only and writes the upper as a
pax tar on its stdout port; the host parses that with the project's hardened tar reader
(`erofs_builder.sources.source_tar`) and keeps only what a layer may hold (files, directories, symlinks,
hard links, whiteouts, the opaque xattr). The guest, even one whose kernel a crafted image took
over, can only make the commit hold other bytes or fail.

Layers are always virtio-blk drives here: `--layer-device pmem` is refused (QEMU 7.2's microvm
has no device-memory area, so the guest cannot map a virtio-pmem device; the full-VM backend
does pmem: docs/vm-memory.md).

What is not about the drives (the VMM's pid and start time, streams, the wait, signals, teardown,
the commit's export VM) is the full-VM backend's (`backends.vm.VmBackend`), which this one
extends; its VMM records live apart, in NODE/microvm/run/<id>.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence

from layerstore.errors import ConfigError
from layerstore.fileio import write_atomic

from ..errors import ShimError
from ..nodestate.paths import NodePaths
from ..nodestate.state import Sandbox
from ..vm.spec import Drive, VmSpec
from .base import Confinement
from .vm import MAX_MEMORY_MIB, VmBackend, refuse_no_init

DEFAULT_MEMORY_MIB = 512


class MicrovmBackend(VmBackend):
    name = "microvm"
    machine = "microvm"
    guest_root = True  # the runner mounts its sandboxes with Shim.mount(guest=...)

    def __init__(self, paths: NodePaths) -> None:
        super().__init__(paths)
        self.base = paths.root / "microvm"  # NODE/microvm/run/<id>.json: its VMMs, apart from the full VMs'

    def check_layer_device(self, device: str) -> None:
        super().check_layer_device(device)
        if device == "pmem":
            raise ConfigError("--layer-device pmem: QEMU 7.2's microvm machine has no device-memory area, so its "
                              "guest cannot map a virtio-pmem device; use --backend vm (q35) for pmem layers, "
                              "or blk")

    def delete(self, sandbox: str) -> None:
        """Also the config drive: it holds the caller's variables (secrets), no use once the VM is gone."""
        super().delete(sandbox)
        with contextlib.suppress(FileNotFoundError):
            (self.workdir(sandbox) / "config.tar").unlink()

    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        if sb.backend != self.name:
            raise ShimError(f"sandbox {sb.id} was not made for the microVM backend (layerctl run --backend microvm)")
        self.check_layer_device(self.layer_device)
        conf = confinement or Confinement()
        refuse_no_init(conf, self.name)
        memory = DEFAULT_MEMORY_MIB if conf.memory is None else max(128, min(MAX_MEMORY_MIB, conf.memory >> 20))
        vcpus = 1 if conf.cpus is None else max(1, min(math.ceil(conf.cpus), os.cpu_count() or 1))
        upper, config = self.write_guest_config(sb, command, extra_env, conf, memory)
        plan = {"layers": [self.layer_source(b) for b in sb.layers], "upper": upper, "config": str(config),
                "memory_mib": memory, "vcpus": vcpus}
        write_atomic(self.workdir(sb.id) / "vm.json", json.dumps(plan).encode(), mode=0o600)

    def spec(self, sandbox: str) -> VmSpec:
        plan = self.plan(sandbox)
        # A layer read through the node daemon is opened O_DIRECT: no host page cache, so no host
        # readahead on the lazily fetched file (it fetched a whole 16 MiB file the guest never
        # read); a pinned complete cache file is a local file whose page cache the node's VMs share.
        fuse = str(self.paths.fuse) + "/"
        drives = [Drive(path, role="layer", serial=f"layer{i}", direct=path.startswith(fuse))
                  for i, path in enumerate(plan["layers"])]
        if plan["upper"]:
            drives.append(Drive(plan["upper"], read_only=False, role="upper", serial="upper"))
        drives.append(Drive(plan["config"], role="config", serial="config"))
        spec = self.vm_spec(sandbox, "run", drives, int(plan["memory_mib"]))
        return VmSpec(**{**spec.__dict__, "vcpus": int(plan.get("vcpus", 1))})
