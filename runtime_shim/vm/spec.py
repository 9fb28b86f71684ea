"""A virtual machine as pure data: what to boot (kernel, initrd, command line), how big (memory,
vCPUs), which block devices it gets, and which byte streams connect it to the host. No I/O here:
`runtime_shim.vm.qemu` turns a `VmSpec` into a QEMU command line and runs it; the same spec is
what Firecracker and Cloud Hypervisor configurations are emitted from.

Every field says what the guest must see, not how a VMM provides it:

    kernel, initrd   host paths of an uncompressed-or-bzImage kernel and an initramfs (the guest
                     kit: `runtime_shim.vm.kit`)
    cmdline          the kernel command line; it is world-readable on the host (in the VMM's argv)
                     and in the guest (/proc/cmdline): never a secret in it (secrets travel on the
                     config drive, a 0600 file)
    memory_mib       guest RAM in MiB
    vcpus            virtual CPUs
    machine          "microvm" (virtio-mmio devices, no PCI: QEMU microvm, Firecracker, Cloud
                     Hypervisor) or "q35" (a full PC with PCI: QEMU only)
    drives           virtio-blk devices, in order (the guest names them vda, vdb, ... in that
                     order on every VMM here, but finds them by `serial`, which it can read in
                     /sys/block/vd*/serial): see `Drive`
    streams          byte streams from the guest to the host (virtio-console ports on QEMU and
                     Cloud Hypervisor): see `Stream`
    console_log      a host file the guest kernel's console goes to (None: discarded)
    pmem             virtio-pmem devices (read-only images the guest maps with DAX; q35 only on
                     QEMU 7.2, whose microvm has no device-memory area: see docs/vm-memory.md).
                     A guest finds pmem device i by its PCI slot, PMEM_SLOT + i (QEMU: `addr=`),
                     since virtio-pmem has no serial

Drive roles (what the guest does with a drive, read by the guest's init through its serial):

    "layer"   an environment layer: an EROFS image, read-only, mounted in the guest; serial
              "layer<N>", N = 0 for the bottom layer
    "upper"   the sandbox's writable layer (an ext4 image on a sparse host file), serial "upper"
    "config"  the workload's description (argv, env, workdir, user; `runtime_shim.vm.config`),
              read-only, serial "config"
    "root"    one flattened root device (full VMs: EROFS, read-only), serial "root"
    "meta"    anything else a backend needs (e.g. an EROFS multi-device metadata image)

Only "upper" drives are ever writable: `VmSpec.check` refuses a spec whose other drives are not
read-only, so a guest never writes a shared layer blob.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

ROLES = ("layer", "upper", "config", "root", "meta")
PMEM_ALIGN = 2 << 20  # a virtio-pmem image's size must be a multiple of this (the guest maps 2 MiB sections)
PMEM_SLOT = 0x10  # q35: pmem device i sits at PCI slot PMEM_SLOT + i (below ICH9's 0x1f)
MAX_PMEM = 0x1F - PMEM_SLOT
MACHINES = ("microvm", "q35")
# virtio-blk serials are at most 20 bytes; ours are plain names the guest can match in sh.
SERIAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,19}")
STREAM_NAME = re.compile(r"[a-z][a-z0-9._-]{0,63}")


class VmSpecError(ValueError):
    """A VmSpec that no VMM should be given (a programming error, not a user's: ValueError)."""


@dataclass(frozen=True)
class Drive:
    """One virtio-blk device backed by a host file.

    path       the host file (an EROFS layer blob: the node daemon's lazily fetched file or the
               node cache's complete file; a sandbox's sparse upper image; a config image)
    read_only  the VMM opens it read-only and the guest sees a read-only disk
    role       see the module docstring
    serial     the name the guest finds it by (at most 20 characters, [A-Za-z0-9._-])
    direct     open the host file with O_DIRECT (cache=none): reads bypass the host page cache.
               For a file on the node daemon's FUSE mount this keeps every read a real request
               to the daemon; False (the default) lets the host cache it.
    """

    path: str
    read_only: bool = True
    role: str = "layer"
    serial: str = ""
    direct: bool = False


@dataclass(frozen=True)
class Stream:
    """A byte stream from the guest to the host.

    name     the port's name in the guest (/sys/class/virtio-ports/*/name, and /dev/virtio-ports/NAME
             when udev or mdev makes the link); the guest init writes the workload's stdout to
             "stdout", its stderr to "stderr", and one status line to "status"
    socket   a host unix socket path: the host listens on it before the VMM starts and the VMM
             connects to it as a client (QEMU `-chardev socket,server=off`)
    """

    name: str
    socket: str


@dataclass(frozen=True)
class Pmem:
    """A virtio-pmem device: a host file mapped into guest memory, shared and (here always)
    read-only, so every VM mapping the same file reads the same host page-cache pages.

    path       the host file, at least `size` bytes (QEMU maps its first `size` bytes)
    size       a multiple of PMEM_ALIGN (2 MiB); the guest sees exactly this many bytes
    """

    path: str
    size: int
    read_only: bool = True


@dataclass(frozen=True)
class VmSpec:
    kernel: str
    initrd: str | None
    cmdline: str
    memory_mib: int = 256
    vcpus: int = 1
    machine: str = "microvm"
    drives: tuple[Drive, ...] = ()
    streams: tuple[Stream, ...] = ()
    console_log: str | None = None
    pmem: tuple[Pmem, ...] = field(default_factory=tuple)

    def check(self) -> VmSpec:
        """Raise `VmSpecError` unless every VMM can be given this spec as it is; returns self."""
        if self.machine not in MACHINES:
            raise VmSpecError(f"machine {self.machine!r}: want one of {', '.join(MACHINES)}")
        if self.memory_mib < 32 or self.vcpus < 1:
            raise VmSpecError(f"{self.memory_mib} MiB and {self.vcpus} vCPUs: want at least 32 MiB and 1 vCPU")
        for what, path in (("kernel", self.kernel), ("initrd", self.initrd), ("console log", self.console_log)):
            if path is not None:
                check_path(path, what)
        if "\n" in self.cmdline or len(self.cmdline) > 2000:
            raise VmSpecError("kernel command line: one line of at most 2000 bytes")
        serials = set()
        for d in self.drives:
            check_path(d.path, f"drive {d.serial or d.path}")
            if d.role not in ROLES:
                raise VmSpecError(f"drive {d.path}: role {d.role!r}, want one of {', '.join(ROLES)}")
            if not SERIAL.fullmatch(d.serial):
                raise VmSpecError(f"drive {d.path}: serial {d.serial!r} (want 1-20 of [A-Za-z0-9._-])")
            if d.serial in serials:
                raise VmSpecError(f"two drives with serial {d.serial!r}")
            serials.add(d.serial)
            if not d.read_only and d.role != "upper":
                raise VmSpecError(f"drive {d.serial}: only the upper may be writable, not a {d.role}")
        names = set()
        for s in self.streams:
            check_path(s.socket, f"stream {s.name}")
            if not STREAM_NAME.fullmatch(s.name) or s.name in names:
                raise VmSpecError(f"stream name {s.name!r}: want a unique [a-z][a-z0-9._-]* of at most 64")
            names.add(s.name)
        if len(self.pmem) > MAX_PMEM:
            raise VmSpecError(f"{len(self.pmem)} pmem devices: at most {MAX_PMEM}")
        for p in self.pmem:
            check_path(p.path, "pmem image")
            if p.size <= 0 or p.size % PMEM_ALIGN:
                raise VmSpecError(f"pmem {p.path}: size {p.size} is not a positive multiple of 2 MiB")
        return self

    def drive(self, serial: str) -> Drive | None:
        return next((d for d in self.drives if d.serial == serial), None)


def check_path(path: str, what: str) -> None:
    """Absolute, and free of what VMM option syntaxes split on (QEMU: ','; all: newlines, NUL)."""
    if not os.path.isabs(path) or any(c in path for c in ",\n\0"):
        raise VmSpecError(f"{what} path {path!r}: want an absolute path without ',' or newlines")
