"""The full-VM backend ("vm"): a QEMU `q35` VM per sandbox whose root is one flattened device.

The guest gets, as virtio-blk drives in this order (the guest's init finds them by serial):

    vda          "layer0"  the environment's root: the multi-device EROFS metadata image of the
                           layer stack (`runtime_shim.vm.roots`), read-only, shared by every
                           sandbox of that stack on the node
    vdb, vdc...  "dev1".. the layer blobs themselves, read-only: the extra devices the root's
                           device table names (the node daemon's lazily fetched files, or the
                           cache files of pinned blobs: whatever the node's layer mounts read)
    next         "upper"   a kept sandbox's writable disk: NODE/sandboxes/<id>/upper.img, the sparse
                           ext4 image the shim made (`Shim.mount(guest=...)`), never mounted on the
                           host; a sandbox that is not kept has its upper in the guest's memory
    last         "config"  the workload (argv, env, workdir, user; `runtime_shim.vm.config`), 0600

and nothing else: no network, no shared directory, no other host file. The guest kit's init
mounts the root as the one lower of an overlay under the upper and runs the command; stdout,
stderr and the exit status come back on virtio-console ports (`runtime_shim.vm.qemu`). The shim
mounts the layers on the node (their files are the drives) but composes no root there
(`guest_root`).

With `layer_device = "pmem"` (`layerctl run --layer-device pmem`) the layers are virtio-pmem
devices instead (docs/vm-memory.md): each layer's pmem image (`runtime_shim.vm.pmem`: a complete
copy of the blob from the node's layer source, padded to 2 MiB, NODE/vm/pmem/<hex>.img, one per
node, fetched whole before the boot) mapped shared and read-only, layer i at PCI slot 0x10+i; the
guest mounts each with DAX and stacks them with overlayfs as the microVM's guest does, so no root
image is made (its files are chunk-based, and the 6.1 guest's EROFS does DAX for flat files
only). The drives are then only "upper" and "config". Every VM of the node reads the layers'
bytes from the same host page-cache pages, and its own page cache holds none of them; the guest
reports its layer mounts (a "mounts" port) and `wait` checks that each has DAX on.

Commit (`upper_source`): the upper drive is read after the VM stopped, never by the host kernel:
a helper VM of the same kit (init mode "export") mounts it read-only and writes the upper as a
pax tar on its stdout port; the host parses it with the hardened tar reader
(`erofs_builder.sources.source_tar`) and keeps only what a layer may hold.

State, all of it the backend's own:

    NODE/sandboxes/<id>/vm/    config.tar, vm.json (the prepared drives), console and QEMU logs:
                               deleted with the sandbox's directory (like the container
                               backend's bundle/)
    NODE/vm/run/<id>.json      the running VMM: pid and start time (written as soon as QEMU
                               runs; what `has`, `status`, `delete` and recovery look at)
    NODE/vm/roots/             the flattened roots (derived data, rebuilt if missing)
    /run/layerstore/vm/<key>/  the stream sockets (unix socket paths must be short)

Signals: the guest's init runs the workload as its child, so exit codes are the workload's (128+N
for death by signal N), as in a container (whose PID 1 is tini, `pid1`). A signal for the
workload (`stop`, and a stop signal `layerctl run` gets) goes to QEMU's "signal" stream; the
guest's init passes it on to the workload. A stopped run gives the workload `stop_grace()` to
end, then kills QEMU (`wait`). No init (`Confinement.init` off, `--no-init`) is refused: the
guest's init is what runs the workload, always as its child.

If the caller dies, QEMU (its own session) runs to the command's end and powers off; `delete`
(from `layerctl sandbox rm` or recovery) kills it by pid after checking its start time. If QEMU
is killed, the guest's writes that reached the upper disk stay there (ext4's journal covers the
rest) and the run reports no exit status (`ShimError`), or 128+N for a SIGKILL the caller sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import blake3

from erofs_builder.tree import Kind
from layerstore.errors import ConfigError
from layerstore.fileio import write_atomic
from layerstore.linux import find_mount

from ..errors import ShimError
from ..nodestate.paths import NodePaths
from ..nodestate.state import Sandbox, start_time
from ..vm.config import GuestConfig, write_config
from ..vm.kit import find_kit
from ..vm.pmem import pmem_image, sweep
from ..vm.qemu import QemuVm, parse_mounts, qemu_binary, start_vm
from ..vm.roots import root_image
from ..vm.spec import MAX_PMEM, Drive, Pmem, Stream, VmSpec
from . import signals
from .base import Confinement, Execution, Stdio
from .bundle import process_args, process_env

REAP_TIMEOUT = 30.0  # seconds for a killed VMM to be reaped
MEMORY_MIB = 256
MAX_MEMORY_MIB = 1024
EXPORT_MEMORY_MIB = 256
SOCKETS = Path("/run/layerstore/vm")
STREAMS = ("stdout", "stderr", "status", "mounts", "signal")
LAYER_DEVICES = ("blk", "pmem")
KEPT_REPORTS = 64  # guests' layer-mount reports kept in `layer_mounts`


def refuse_no_init(conf: Confinement, backend: str) -> None:
    """`ConfigError` for a workload to run as PID 1 in a VM, which cannot be (pure)."""
    if not conf.init:
        raise ConfigError(f"--no-init is for containers: the {backend} guest's init always runs the workload "
                          f"as its child")


class VmBackend:
    name = "vm"
    machine = "q35"
    guest_root = True  # the runner mounts its sandboxes with Shim.mount(guest=...)

    def __init__(self, paths: NodePaths, layer_device: str = "blk") -> None:
        self.paths = paths
        self.base = paths.root / "vm"
        self.running: dict[str, QemuVm] = {}
        self.signalled: dict[str, int] = {}
        self.layer_device = layer_device
        # what the last guests reported of their layer mounts (source, mount point, type, options)
        self.layer_mounts: dict[str, list[tuple[str, str, str, tuple[str, ...]]]] = {}

    def use_layer_device(self, device: str) -> None:
        """How the next sandboxes get their layers: "blk" (virtio-blk drives, the default) or
        "pmem" (virtio-pmem devices mounted with DAX). `ConfigError` if this backend cannot."""
        self.check_layer_device(device)
        self.layer_device = device

    def check_layer_device(self, device: str) -> None:
        if device not in LAYER_DEVICES:
            raise ConfigError(f"layer device {device!r}: want one of {', '.join(LAYER_DEVICES)}")

    # -- where things are -------------------------------------------------------------------
    def workdir(self, sandbox: str) -> Path:
        return self.paths.sandbox_dir(sandbox) / "vm"

    def record(self, sandbox: str) -> Path:
        return self.base / "run" / f"{sandbox}.json"

    def sockets(self, sandbox: str) -> Path:
        key = blake3.blake3(os.fsencode(self.paths.root)).hexdigest()[:12]
        return SOCKETS / f"{key}-{sandbox}"

    def check(self) -> None:
        self.check_layer_device(self.layer_device)
        qemu_binary()
        find_kit()

    # -- the steps --------------------------------------------------------------------------
    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        if getattr(sb, "backend", "") != self.name:
            raise ShimError(f"sandbox {sb.id} was not made for the {self.name} backend "
                            f"(layerctl run --backend {self.name})")
        self.check_layer_device(self.layer_device)
        conf = confinement or Confinement()
        refuse_no_init(conf, self.name)
        sources = [self.layer_source(blob) for blob in sb.layers]
        memory = MEMORY_MIB if conf.memory is None else max(128, min(MAX_MEMORY_MIB, conf.memory >> 20))
        plan: dict[str, Any]
        if self.layer_device == "pmem":
            plan = {"layer_device": "pmem", "pmem": self.pmem_images(sb, sources)}
        else:
            root, _built = root_image(self.base / "roots", sb.layers, sources)
            plan = {"root": str(root), "devices": [str(s) for s in sources]}
        upper, config = self.write_guest_config(sb, command, extra_env, conf, memory)
        plan |= {"upper": upper, "memory_mib": memory}
        write_atomic(self.workdir(sb.id) / "vm.json", json.dumps(plan).encode(), mode=0o600)

    def pmem_images(self, sb: Sandbox, sources: Sequence[str]) -> list[tuple[str, int]]:
        """Each layer's pmem image (bottom first), made complete and padded first (`vm.pmem`)."""
        if len(sb.layers) > MAX_PMEM:
            raise ShimError(f"sandbox {sb.id}: {len(sb.layers)} layers; a VM takes at most {MAX_PMEM} pmem layers "
                            f"(use --layer-device blk)")
        images = self.base / "pmem"
        sweep(images)  # (temporaries of copies that died)
        return [(str(p), size) for p, size in
                (pmem_image(images, blob, src) for blob, src in zip(sb.layers, sources, strict=True))]

    def write_guest_config(self, sb: Sandbox, command: Sequence[str] | None, extra_env: Sequence[str],
                           conf: Confinement, memory_mib: int) -> tuple[str, Path]:
        """The config drive (the environment's command, env, workdir and user, the caller's extra
        variables) in the sandbox's VM directory; (the upper drive's path or "" for an upper in
        the guest's memory (half of it at most), the config drive's path)."""
        upper = sb.upper if self.kept(sb) else ""
        wd = self.workdir(sb.id)
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        cfg = sb.config
        guest = GuestConfig(argv=tuple(process_args(cfg, command)), env=tuple(process_env(cfg, extra_env)),
                            workdir=cfg.get("workdir") or "/", user=cfg.get("user") or "",
                            upper="drive" if upper else "tmpfs", upper_size=(memory_mib << 20) // 2,
                            nosuid=not conf.new_privileges, nodev=True, hostname=sb.id)
        return upper, write_config(wd / "config.tar", guest)

    @staticmethod
    def kept(sb: Sandbox) -> bool:
        """Has the sandbox an upper drive (it was made to be kept)?"""
        return sb.upper.endswith(".img") and os.path.isfile(sb.upper)

    def layer_source(self, blob: str) -> str:
        """The file the node's EROFS mount of `blob` reads: the VM reads the same one."""
        m = find_mount(self.paths.layer_mount(blob))
        if m is None or m.fstype != "erofs":
            raise ShimError(f"layer {blob} is not mounted on this node")
        return m.source

    def plan(self, sandbox: str) -> dict[str, Any]:
        """What `prepare` wrote for the sandbox's VM (`ShimError` if nothing)."""
        try:
            plan = json.loads((self.workdir(sandbox) / "vm.json").read_text())
        except (OSError, ValueError):
            plan = None
        if not isinstance(plan, dict):
            raise ShimError(f"sandbox {sandbox}: no prepared VM")
        return plan

    def spec(self, sandbox: str) -> VmSpec:
        wd = self.workdir(sandbox)
        plan = self.plan(sandbox)
        pmem = tuple(Pmem(p, int(size)) for p, size in plan.get("pmem", ()))
        drives = []
        if not pmem:
            drives.append(Drive(plan["root"], role="root", serial="layer0"))
            drives += [Drive(d, role="meta", serial=f"dev{i + 1}") for i, d in enumerate(plan["devices"])]
        if plan["upper"]:
            drives.append(Drive(plan["upper"], read_only=False, role="upper", serial="upper"))
        drives.append(Drive(str(wd / "config.tar"), role="config", serial="config"))
        return self.vm_spec(sandbox, "run", drives, plan["memory_mib"], pmem)

    def vm_spec(self, sandbox: str, mode: str, drives: list[Drive], memory_mib: int,
                pmem: tuple[Pmem, ...] = ()) -> VmSpec:
        kit = find_kit()
        socks = self.sockets(sandbox)
        cmdline = f"console=ttyS0 quiet panic=-1 layerstore.mode={mode} layerstore.drives={len(drives)}"
        if pmem:
            # pmem sits in the device-memory area above 4 GiB, so the kernel would set up a 64 MiB
            # swiotlb bounce buffer (zeroed: 64 MiB of touched guest RAM per VM) for DMA that no
            # device here does (virtio without ACCESS_PLATFORM bypasses the DMA API)
            cmdline += f" layerstore.pmem={len(pmem)} swiotlb=noforce"
        return VmSpec(kernel=str(kit.kernel), initrd=str(kit.initrd), cmdline=cmdline, memory_mib=memory_mib,
                      machine=self.machine, drives=tuple(drives), pmem=pmem,
                      streams=tuple(Stream(n, str(socks / f"{n}.sock")) for n in STREAMS),
                      console_log=str(self.workdir(sandbox) / f"console-{mode}.log"))

    def start(self, sandbox: str, *, stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None) -> Execution:
        vm = self.boot(sandbox, self.spec(sandbox), stdout=stdout, stderr=stderr)
        self.running[sandbox] = vm
        return Execution(sandbox, vm.process)

    def boot(self, sandbox: str, spec: VmSpec, *, stdout: Stdio | int, stderr: Stdio | int,
             close_sinks: bool = False) -> QemuVm:
        """Start QEMU for `spec`, its pid and start time recorded as soon as it runs."""
        self.sockets(sandbox).mkdir(mode=0o700, parents=True, exist_ok=True)
        rec = self.record(sandbox)
        rec.parent.mkdir(mode=0o700, parents=True, exist_ok=True)

        def started(pid: int) -> None:
            write_atomic(rec, json.dumps({"pid": pid, "start": start_time(pid)}).encode(), mode=0o600)

        wd = self.workdir(sandbox)
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with open(wd / "qemu.log", "ab") as log:
                return start_vm(spec, stdout=stdout, stderr=stderr, on_started=started, log=log,
                                close_sinks=close_sinks)
        except BaseException:
            rec.unlink(missing_ok=True)
            raise

    # -- commit: the upper drive read by a helper VM ------------------------------------------
    def upper_source(self, sb: Sandbox) -> Any:
        """The sandbox's upper as a layer source (see the module docstring). `ShimError` if its VM
        runs or it has no upper drive."""
        from erofs_builder.workflow import LayerSource

        if getattr(sb, "backend", "") != self.name:
            raise ShimError(f"sandbox {sb.id} is not a {self.name} sandbox")
        if self.live_pid(sb.id) is not None:
            raise ShimError(f"sandbox {sb.id}: its VM is running; commit it once the VM has stopped")
        if not self.kept(sb):
            raise ShimError(f"sandbox {sb.id} has no upper drive to commit (run it with --keep)")
        return LayerSource(f"sandbox {sb.id} upper", lambda _progress: self.exported(sb), None,
                           counts_input=False, refusable=True)

    def exported(self, sb: Sandbox) -> Iterator[tuple[Any, Any]]:
        """The entries of the sandbox's upper, from a helper VM that has the upper drive only,
        read-only, and writes it as a tar: parsed as untrusted input, only layer material kept."""
        from erofs_builder.sources.source_tar import tar_entries

        wd = self.workdir(sb.id)
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        spec = self.vm_spec(sb.id, "export", [Drive(sb.upper, role="upper", serial="upper")], EXPORT_MEMORY_MIB)
        r, w = os.pipe()
        err = os.open(wd / "export.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            vm = self.boot(sb.id, spec, stdout=w, stderr=err, close_sinks=True)
        except BaseException:
            for fd in (r, w, err):
                os.close(fd)
            raise
        try:
            with os.fdopen(r, "rb") as stream:
                for entry, data in tar_entries(stream, name=f"sandbox {sb.id}'s upper (from its guest)"):
                    kind = entry.kind
                    if kind in (Kind.BLK, Kind.FIFO, Kind.SOCK) or (kind is Kind.CHR and tuple(entry.rdev) != (0, 0)):
                        continue  # as the container commit's untrusted walk: no device but a whiteout
                    yield entry, data
            vm.wait()
            code, why = vm.result()
            if code != 0:
                raise ShimError(f"sandbox {sb.id}: the upper could not be read from its drive: {why or code}")
        finally:
            vm.kill()
            with contextlib.suppress(Exception):
                vm.wait(timeout=30)
            self.record(sb.id).unlink(missing_ok=True)
            shutil.rmtree(self.sockets(sb.id), ignore_errors=True)

    def wait(self, execution: Execution) -> int:
        """The workload's exit code, as the guest reports it. A stop signal (`signals`) is passed
        on to the workload through the guest's init, which has `signals.stop_grace()` seconds to
        end before the VMM is killed; then `Stopped` is raised, as the container backend does.
        SIGQUIT is only passed on."""
        vm = self.running.get(execution.sandbox)
        if vm is None:
            raise ShimError(f"sandbox {execution.sandbox}: no VM started by this process")

        def forward(signum: int, _frame: FrameType | None) -> None:
            self.stop(execution, signum)

        with contextlib.ExitStack() as stack:
            stack.enter_context(signals.stopping())
            with contextlib.suppress(ValueError):  # not the main thread: no forwarding
                old = signal.signal(signal.SIGQUIT, forward)
                stack.callback(signal.signal, signal.SIGQUIT, old)
            try:
                vm.wait()
            except signals.Stopped as e:
                with signals.shielded():
                    self._end(execution, vm, e.signum)
                raise signals.Stopped(e.signum, f"the workload of sandbox {execution.sandbox} was ended") from None
        return self._outcome(execution, vm)

    def _end(self, execution: Execution, vm: QemuVm, signum: int) -> None:
        """Pass `signum` on to the workload, give it the stop grace, then kill the VMM; reap it."""
        self.stop(execution, signum)
        if not signals.await_end(lambda: vm.process.poll() is not None, signals.stop_grace()):
            vm.kill(signal.SIGKILL)
        with contextlib.suppress(Exception):
            vm.wait(timeout=REAP_TIMEOUT)
        self.signalled.pop(execution.sandbox, None)

    def _outcome(self, execution: Execution, vm: QemuVm) -> int:
        """After the VMM ended: the guest's exit code (128+N for a signal the caller sent to a VM
        it then killed); `ShimError` if there is none or the guest's layer mounts are not as asked."""
        code, why = vm.result()
        mounts = self.layer_mounts[execution.sandbox] = parse_mounts(bytes(vm.mounts))
        while len(self.layer_mounts) > KEPT_REPORTS:  # (a long-lived process: the latest ones)
            del self.layer_mounts[next(iter(self.layer_mounts))]
        plan = self.plan(execution.sandbox) if code is not None else {}
        if plan.get("layer_device") == "pmem":
            dax = [m for m in mounts if any(o.startswith("dax") for o in m[3])]
            if len(dax) != len(plan["pmem"]) or len(mounts) != len(dax):
                raise ShimError(f"sandbox {execution.sandbox}: {len(plan['pmem'])} pmem layers, but the guest "
                                f"reports {len(dax)} of {len(mounts)} layer mounts with DAX")
        if code is not None:
            return code
        sig = self.signalled.pop(execution.sandbox, None)
        if sig is not None:
            return 128 + sig
        raise ShimError(f"sandbox {execution.sandbox}: {why} (console: {self.workdir(execution.sandbox)}/console.log)")

    def stop(self, execution: Execution, signum: int = signal.SIGTERM) -> None:
        """To the workload, through the guest's init (the "signal" stream). SIGKILL, or a VM that
        cannot take it (no stream, gone), stops the VMM instead: the workload ends with it."""
        vm = self.running.get(execution.sandbox)
        if vm is None:
            return
        if signum != signal.SIGKILL and vm.send_signal(signum):
            return
        self.signalled[execution.sandbox] = signum
        vm.kill(signal.SIGKILL)

    def delete(self, sandbox: str) -> None:
        pid = self.live_pid(sandbox)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        vm = self.running.pop(sandbox, None)
        if vm is not None:
            with contextlib.suppress(Exception):
                vm.wait(timeout=30)
        shutil.rmtree(self.sockets(sandbox), ignore_errors=True)
        self.record(sandbox).unlink(missing_ok=True)

    # -- freezing (commit): SIGSTOP stops every vCPU thread of the VMM --------------------------
    def pause(self, sandbox: str) -> bool:
        pid = self.live_pid(sandbox)
        if pid is None or _state(pid) == "T":
            return False
        os.kill(pid, signal.SIGSTOP)
        for _ in range(1000):
            if _state(pid) in ("T", None):
                return _state(pid) == "T"
            os.sched_yield()
        raise ShimError(f"sandbox {sandbox}: the VM could not be stopped")

    def resume(self, sandbox: str) -> None:
        pid = self.live_pid(sandbox)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    # -- clean-up ---------------------------------------------------------------------------
    def live_pid(self, sandbox: str) -> int | None:
        try:
            rec = json.loads(self.record(sandbox).read_text())
        except (OSError, ValueError):
            return None
        pid, start = rec.get("pid"), rec.get("start")
        if isinstance(pid, int) and start is not None and start_time(pid) == start:
            return pid
        return None

    def status(self, sandbox: str) -> str | None:
        if not self.record(sandbox).exists():
            return None
        pid = self.live_pid(sandbox)
        if pid is None:
            return "stopped"
        return "paused" if _state(pid) == "T" else "running"

    def has(self, sandbox: str) -> bool:
        return self.record(sandbox).exists()

    def leftovers(self) -> list[str]:
        try:
            return sorted(n[:-5] for n in os.listdir(self.base / "run") if n.endswith(".json"))
        except FileNotFoundError:
            return []


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[0].decode()
