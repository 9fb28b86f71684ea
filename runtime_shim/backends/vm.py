"""The full-VM backend ("vm"): a QEMU `q35` VM per sandbox whose root is one flattened device.

The guest gets, as virtio-blk drives in this order (the guest's init finds them by serial):

    vda          "layer0"  the environment's root: the multi-device EROFS metadata image of the
                           layer stack (`runtime_shim.vm.roots`), read-only, shared by every
                           sandbox of that stack on the node
    vdb, vdc...  "dev1".. the layer blobs themselves, read-only: the extra devices the root's
                           device table names (the node daemon's lazily fetched files, or the
                           cache files of pinned blobs: whatever the node's layer mounts read)
    next         "upper"   the sandbox's writable disk: a sparse ext4 image of its own
    last         "config"  the workload (argv, env, workdir, user; `runtime_shim.vm.config`), 0600

and nothing else: no network, no shared directory, no other host file. The guest kit's init
mounts the root as the one lower of an overlay under the upper disk and runs the command;
stdout, stderr and the exit status come back on virtio-console ports (`runtime_shim.vm.qemu`).

State, all of it the backend's own:

    NODE/sandboxes/<id>/vm/    config.tar, upper.img (the writable disk), console.log, qemu.log:
                               deleted with the sandbox's directory, so a kept sandbox's disk
                               outlives the run (like the container backend's bundle/)
    NODE/vm/run/<id>.json      the running VMM: pid and start time (written as soon as QEMU
                               runs; what `has`, `status`, `delete` and recovery look at)
    NODE/vm/roots/             the flattened roots (derived data, rebuilt if missing)
    /run/layerstore/vm/<key>/  the stream sockets (unix socket paths must be short)

If the caller dies, QEMU (its own session) runs to the command's end and powers off; `delete`
(from `layerctl sandbox rm` or recovery) kills it by pid after checking its start time. If QEMU
is killed, the guest's writes that reached the upper disk stay there (ext4's journal covers the
rest) and the run reports no exit status (`ShimError`), or 128+N for a signal the caller sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import blake3

from fuse_client.linux import find_mount
from layerstore.fileio import write_atomic

from ..errors import ShimError
from ..overlay import make_upper_image
from ..paths import NodePaths
from ..state import Sandbox, start_time
from ..vm.config import GuestConfig, write_config
from ..vm.kit import find_kit
from ..vm.qemu import QemuVm, qemu_binary, start_vm
from ..vm.roots import root_image
from ..vm.spec import Drive, Stream, VmSpec
from .base import Confinement, Execution, Stdio
from .bundle import process_args, process_env

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
UPPER_SIZE = 4 << 30  # the writable disk: sparse, allocated as the guest writes
MEMORY_MIB = 256
SOCKETS = Path("/run/layerstore/vm")
STREAMS = ("stdout", "stderr", "status")


class VmBackend:
    name = "vm"
    machine = "q35"

    def __init__(self, paths: NodePaths) -> None:
        self.paths = paths
        self.base = paths.root / "vm"
        self.running: dict[str, QemuVm] = {}
        self.signalled: dict[str, int] = {}

    # -- where things are -------------------------------------------------------------------
    def workdir(self, sandbox: str) -> Path:
        return self.paths.sandbox_dir(sandbox) / "vm"

    def record(self, sandbox: str) -> Path:
        return self.base / "run" / f"{sandbox}.json"

    def sockets(self, sandbox: str) -> Path:
        key = blake3.blake3(os.fsencode(self.paths.root)).hexdigest()[:12]
        return SOCKETS / f"{key}-{sandbox}"

    def check(self) -> None:
        qemu_binary()
        find_kit()

    # -- the steps --------------------------------------------------------------------------
    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        conf = confinement or Confinement()
        sources = [self.layer_source(blob) for blob in sb.layers]
        root, _built = root_image(self.base / "roots", sb.layers, sources)
        wd = self.workdir(sb.id)
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        cfg = sb.config
        guest = GuestConfig(argv=tuple(process_args(cfg, command)), env=tuple(process_env(cfg, extra_env)),
                            workdir=cfg.get("workdir") or "/", user=cfg.get("user") or "", upper="drive",
                            nosuid=not conf.new_privileges, nodev=True, hostname=sb.id)
        write_config(wd / "config.tar", guest)
        upper = wd / "upper.img"
        if not upper.exists():
            make_upper_image(upper, UPPER_SIZE)
        memory = MEMORY_MIB if conf.memory is None else max(64, min(MEMORY_MIB, conf.memory >> 20))
        plan = {"root": str(root), "devices": [str(s) for s in sources], "memory_mib": memory}
        write_atomic(wd / "vm.json", json.dumps(plan).encode(), mode=0o600)

    def layer_source(self, blob: str) -> str:
        """The file the node's EROFS mount of `blob` reads: the VM reads the same one."""
        m = find_mount(self.paths.layer_mount(blob))
        if m is None or m.fstype != "erofs":
            raise ShimError(f"layer {blob} is not mounted on this node")
        return m.source

    def spec(self, sandbox: str) -> VmSpec:
        wd = self.workdir(sandbox)
        try:
            plan = json.loads((wd / "vm.json").read_text())
        except (OSError, ValueError):
            raise ShimError(f"sandbox {sandbox}: no prepared VM") from None
        kit = find_kit()
        drives = [Drive(plan["root"], role="root", serial="layer0")]
        drives += [Drive(d, role="meta", serial=f"dev{i + 1}") for i, d in enumerate(plan["devices"])]
        drives += [Drive(str(wd / "upper.img"), read_only=False, role="upper", serial="upper"),
                   Drive(str(wd / "config.tar"), role="config", serial="config")]
        socks = self.sockets(sandbox)
        cmdline = f"console=ttyS0 quiet panic=-1 layerstore.mode=run layerstore.drives={len(drives)}"
        return VmSpec(kernel=str(kit.kernel), initrd=str(kit.initrd), cmdline=cmdline, memory_mib=plan["memory_mib"],
                      machine=self.machine, drives=tuple(drives),
                      streams=tuple(Stream(n, str(socks / f"{n}.sock")) for n in STREAMS),
                      console_log=str(wd / "console.log"))

    def start(self, sandbox: str, *, stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None) -> Execution:
        spec = self.spec(sandbox)
        socks = self.sockets(sandbox)
        socks.mkdir(mode=0o700, parents=True, exist_ok=True)
        rec = self.record(sandbox)
        rec.parent.mkdir(mode=0o700, parents=True, exist_ok=True)

        def started(pid: int) -> None:
            write_atomic(rec, json.dumps({"pid": pid, "start": start_time(pid)}).encode(), mode=0o600)

        with open(self.workdir(sandbox) / "qemu.log", "ab") as log:
            vm = start_vm(spec, stdout=stdout, stderr=stderr, on_started=started, log=log)
        self.running[sandbox] = vm
        return Execution(sandbox, vm.process)

    def wait(self, execution: Execution) -> int:
        vm = self.running.get(execution.sandbox)
        if vm is None:
            raise ShimError(f"sandbox {execution.sandbox}: no VM started by this process")
        old = {}

        def forward(signum: int, _frame: FrameType | None) -> None:
            self.stop(execution, signum)

        for s in FORWARDED:
            with contextlib.suppress(ValueError):  # not the main thread: no forwarding
                old[s] = signal.signal(s, forward)
        try:
            vm.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        code, why = vm.result()
        if code is not None:
            return code
        sig = self.signalled.pop(execution.sandbox, None)
        if sig is not None:
            return 128 + sig
        raise ShimError(f"sandbox {execution.sandbox}: {why} (console: {self.workdir(execution.sandbox)}/console.log)")

    def stop(self, execution: Execution, signum: int = signal.SIGTERM) -> None:
        """A VM has no process to pass a signal on to: the VMM is stopped (the workload with it)."""
        self.signalled[execution.sandbox] = signum
        vm = self.running.get(execution.sandbox)
        if vm is not None:
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
