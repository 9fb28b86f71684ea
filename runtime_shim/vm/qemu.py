"""QEMU for a `VmSpec`: the command line (`qemu_argv`, pure) and a running VM (`QemuVm`): its
streams pumped to the host, its exit status read, its process tracked by pid + start time and
torn down on every path.

Streams: for each `Stream` of the spec the host listens on the stream's unix socket *before* QEMU
starts, and QEMU connects to it as a client at start-up (`-chardev socket,server=off`), so no
byte the guest writes can be lost to a race. Each is read by a thread of its own: "stdout" and
"stderr" are copied to the caller's descriptors as they come (never held: a guest that writes
forever costs the host no memory), "status" is kept, bounded (`STATUS_MAX` bytes; the rest is
read and dropped). The guest is an adversary: `parse_status` takes one line of a fixed grammar
and nothing else. "signal" goes the other way: the host writes a signal number and a newline
(`QemuVm.send_signal`), the guest's init passes that signal on to the workload; nothing the guest
writes there is read.

Acceleration: KVM when /dev/kvm works (`LAYERSTORE_VM_ACCEL=kvm|tcg|auto` overrides; auto checks
that a VM can be created and boots), TCG otherwise. QEMU runs as "nobody" once it has opened its
files and sockets (`-runas`), with `-sandbox on` (its seccomp filter: no spawning, no obsolete
syscalls), `-nodefaults`, no network and no monitor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import RuntimeNotAvailable, ShimError
from .spec import PMEM_SLOT, VmSpec, VmSpecError

QEMU = "qemu-system-x86_64"
STATUS_MAX = 4096  # bytes of the status stream kept
CONSOLE_MAX = 1 << 20  # bytes of the guest's console kept in its log
RUNAS = "nobody"  # who QEMU runs as once it has opened what it needs (see qemu_argv)
CONNECT_TIMEOUT = 30.0  # seconds QEMU gets to connect its streams
ACCEL_ENV = "LAYERSTORE_VM_ACCEL"
CONSOLE = " console"  # (the console's stream name: a space keeps it apart from every Stream name)
SIGNAL = "signal"  # the stream the host sends signals for the workload on
_STATUS = re.compile(rb"exit ([0-9]{1,3})\n")
_ERROR = re.compile(rb"error ([ -~]{0,300})\n")
PROBE_CACHE = Path("/run/layerstore")
PROBE_TIMEOUT = 20.0  # seconds a KVM probe boot may take (a working KVM needs well under one)
KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise RuntimeNotAvailable(f"{QEMU} is not installed (qemu-system-x86)")
    return path


def kvm_usable() -> bool:
    """Can this process create a KVM VM? (/dev/kvm opens, speaks API 12, and KVM_CREATE_VM works.)"""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if fcntl.ioctl(fd, KVM_GET_API_VERSION, 0) != 12:
            return False
        vm = fcntl.ioctl(fd, KVM_CREATE_VM, 0)
        os.close(vm)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def choose_accel(kernel: str, initrd: str | None) -> str:
    """"kvm" or "tcg": $LAYERSTORE_VM_ACCEL when it names one; else KVM if /dev/kvm creates VMs
    *and* boots this kernel (a probe boot in the init's "probe" mode, which powers off at once:
    some /dev/kvm variants create VMs but boot no stock kernel), TCG otherwise. The probe's
    outcome is remembered for the boot of the host (PROBE_CACHE/<boot id>)."""
    want = os.environ.get(ACCEL_ENV, "auto")
    if want in ("kvm", "tcg"):
        return want
    if not kvm_usable():
        return "tcg"
    from ..nodestate.state import boot_id

    cache = PROBE_CACHE / f"accel-{boot_id() or 'unknown'}"
    with contextlib.suppress(OSError):
        known = cache.read_text().strip()
        if known in ("kvm", "tcg"):
            return known
    argv = [qemu_binary(), "-machine", "microvm,acpi=on", "-accel", "kvm", "-cpu", "host", "-m", "128M",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-display", "none", "-monitor", "none",
            "-net", "none", "-serial", "null", "-kernel", kernel,
            "-append", "console=ttyS0 quiet panic=-1 layerstore.mode=probe"]
    if initrd:
        argv += ["-initrd", initrd]
    try:
        ok = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    accel = "kvm" if ok else "tcg"
    with contextlib.suppress(OSError):
        cache.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        cache.write_text(accel + "\n")
    return accel


def _opt(value: str) -> str:
    return value.replace(",", ",,")  # (spec paths carry no ',' anyway: VmSpec.check)


def unprivileged_user() -> str | None:
    """The user QEMU runs as once set up: RUNAS when this process is root and the node has it."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(RUNAS)
    except KeyError:
        return None
    return RUNAS


def host_tsc_khz() -> int | None:
    """The host CPU's clock in kHz (/proc/cpuinfo), which is the rate a TCG guest's TSC runs at."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def qemu_argv(spec: VmSpec, *, accel: str = "tcg", binary: str = QEMU, tsc_khz: int | None = None,
              runas: str | None = None) -> list[str]:
    """The QEMU command line for `spec` (pure). microvm: virtio-mmio devices enumerated through
    ACPI (Debian's kernel ignores virtio_mmio= on its command line); q35: virtio-pci devices.

    `tsc_khz` (TCG on microvm): told to the guest kernel (tsc_early_khz=). microvm has no HPET or
    ACPI PM timer, so the kernel calibrates its TSC against the PIT alone, and under TCG on a
    busy host that calibration fails ("Unable to calibrate against PIT") and the boot hangs for
    good; a TCG guest's TSC runs at the host's rate, which the host knows.

    `runas`: QEMU drops to this user once it has opened its drives, kernel and sockets (`-runas`),
    so that a guest that escapes into QEMU is an unprivileged user on the node. QEMU's seccomp
    filter then allows the set*id calls (the drop needs them; as that user they give nothing) and
    still forbids spawning anything; without `runas` it forbids them too."""
    spec.check()
    mmio = spec.machine == "microvm"
    if mmio and spec.pmem:
        raise VmSpecError("virtio-pmem on QEMU 7.2's microvm: it has no device-memory area, the guest cannot "
                          "map the region (use q35)")
    cmdline = spec.cmdline
    if tsc_khz and mmio and accel == "tcg":
        cmdline += f" tsc_early_khz={tsc_khz}"
    machine = "microvm,acpi=on" if mmio else "q35"
    argv = [binary, "-machine", machine, "-accel", accel, "-cpu", "host" if accel == "kvm" else "max",
            "-smp", str(spec.vcpus), "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-display", "none", "-monitor", "none", "-net", "none",
            "-sandbox", f"on,obsolete=deny,elevateprivileges={'allow' if runas else 'deny'},spawn=deny,"
                        "resourcecontrol=deny",
            "-kernel", spec.kernel, "-append", cmdline]
    if runas:
        argv += ["-runas", runas]
    if spec.pmem:
        total = sum(p.size for p in spec.pmem)
        argv += ["-m", f"{spec.memory_mib}M,slots={len(spec.pmem)},maxmem={spec.memory_mib + (total >> 20)}M"]
    else:
        argv += ["-m", f"{spec.memory_mib}M"]
    if spec.initrd:
        argv += ["-initrd", spec.initrd]
    console = console_socket(spec)
    if console is not None:  # (bounded by the host: see start_vm)
        argv += ["-chardev", f"socket,id=console,path={_opt(console)},server=off", "-serial", "chardev:console"]
    else:
        argv += ["-serial", "null"]
    blk = "virtio-blk-device" if mmio else "virtio-blk-pci"
    for i, d in enumerate(spec.drives):
        opts = [f"id=d{i}", f"file={_opt(d.path)}", "format=raw", "if=none", "file.locking=off",
                f"readonly={'on' if d.read_only else 'off'}", f"cache.direct={'on' if d.direct else 'off'}"]
        argv += ["-drive", ",".join(opts), "-device", f"{blk},drive=d{i},serial={d.serial}"]
    if spec.streams:
        serial = "virtio-serial-device" if mmio else "virtio-serial-pci"
        argv += ["-device", f"{serial},max_ports={len(spec.streams) + 1}"]
        for i, s in enumerate(spec.streams):
            argv += ["-chardev", f"socket,id=s{i},path={_opt(s.socket)},server=off",
                     "-device", f"virtserialport,chardev=s{i},name={s.name}"]
    for i, p in enumerate(spec.pmem):
        argv += ["-object", f"memory-backend-file,id=pm{i},share=on,readonly={'on' if p.read_only else 'off'},"
                            f"mem-path={_opt(p.path)},size={p.size}",
                 "-device", f"virtio-pmem-pci,memdev=pm{i},id=pmem{i},bus=pcie.0,addr={PMEM_SLOT + i:#x}"]
    return argv


def console_socket(spec: VmSpec) -> str | None:
    """Where the guest's serial console reaches the host when the spec asks for a console log: a
    socket beside the streams' (the host keeps the first CONSOLE_MAX bytes in the log: a guest
    that writes to its serial port forever cannot fill the node's disk). None: no console kept."""
    if not spec.console_log or not spec.streams:
        return None
    return os.path.join(os.path.dirname(spec.streams[0].socket), "console.sock")


def parse_status(raw: bytes) -> tuple[int | None, str]:
    """The guest's status stream: (exit code, "") for "exit N\\n" (N <= 255), (None, message) for
    "error MESSAGE\\n" (printable ASCII, at most 300 bytes); anything else is (None, a note that
    the guest said nothing valid). Only the first line counts."""
    m = _STATUS.match(raw)
    if m is not None and int(m.group(1)) <= 255:
        return int(m.group(1)), ""
    m = _ERROR.match(raw)
    if m is not None:
        return None, m.group(1).decode("ascii")
    return None, "the guest reported no exit status"


def parse_mounts(raw: bytes) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """The guest's "mounts" stream: its layer mounts as /proc/mounts lines (source, mount point,
    type, options), what the guest init reports after mounting the layers so the host can see
    how they were mounted (e.g. with DAX). Lines that are not four or more printable-ASCII fields
    are skipped: the guest is an adversary, and this is information, never a decision's input
    beyond a check of the guest's own claim."""
    out = []
    for line in raw.split(b"\n"):
        fields = line.split(b" ")
        if len(fields) < 4 or any(not f or not all(0x21 <= c < 0x7F for c in f) for f in fields[:4]):
            continue
        src, target, fstype, opts = (f.decode("ascii") for f in fields[:4])
        out.append((src, target, fstype, tuple(opts.split(","))))
    return out


Sink = IO[bytes] | int | None


def _sink_fd(sink: Sink, default: int) -> int:
    if sink is None:
        return default
    if isinstance(sink, int):
        return sink
    sink.flush()
    return sink.fileno()


@dataclass
class QemuVm:
    """A started VM. `wait()` returns QEMU's exit status once every stream is drained."""

    process: subprocess.Popen[bytes]
    status: bytearray = field(default_factory=bytearray)
    pumps: list[threading.Thread] = field(default_factory=list)
    conns: list[socket.socket] = field(default_factory=list)
    signalled: int | None = None  # the signal the host sent it, if any
    mounts: bytearray = field(default_factory=bytearray)  # the "mounts" stream (see parse_mounts)
    control: socket.socket | None = None  # the "signal" stream, non-blocking (see send_signal)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float | None = None) -> int:
        rc = self.process.wait(timeout)
        for th in self.pumps:
            th.join()
        for c in [*self.conns, *([self.control] if self.control is not None else [])]:
            with contextlib.suppress(OSError):
                c.close()
        return rc

    def kill(self, signum: int = signal.SIGKILL) -> None:
        self.signalled = signum
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def send_signal(self, signum: int) -> bool:
        """Ask the guest's init to pass `signum` on to the workload. False if the VM has no
        "signal" stream or it is gone (or full: a guest that never reads it)."""
        if self.control is None:
            return False
        try:
            return self.control.send(f"{signum}\n".encode()) > 0
        except OSError:
            return False

    def result(self) -> tuple[int | None, str]:
        """After `wait`: the guest's exit code, or None and why there is none."""
        return parse_status(bytes(self.status))


def _pump_to_fd(conn: socket.socket, fd: int, close: bool = False) -> None:
    try:
        with contextlib.suppress(OSError):
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                view = memoryview(data)
                while view:
                    try:
                        n = os.write(fd, view)
                    except BrokenPipeError:
                        return _drain(conn)
                    view = view[n:]
    finally:
        if close:
            os.close(fd)


def _drain(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass


def _pump_to_log(conn: socket.socket, path: str | None, limit: int) -> None:
    """The first `limit` bytes into the file at `path` (created 0600, truncated), the rest dropped."""
    if path is None:
        return _drain(conn)
    kept = 0
    with contextlib.suppress(OSError), open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600),
                                            "wb", buffering=0) as f:
        while True:
            data = conn.recv(65536)
            if not data:
                return None
            if kept < limit:
                f.write(data[: limit - kept])
                kept += min(len(data), limit - kept)
    return _drain(conn)


def _pump_bounded(conn: socket.socket, into: bytearray, limit: int) -> None:
    with contextlib.suppress(OSError):
        while True:
            data = conn.recv(65536)
            if not data:
                return
            room = limit - len(into)
            if room > 0:
                into += data[:room]


def start_vm(spec: VmSpec, *, stdout: Sink = None, stderr: Sink = None, accel: str | None = None,
             on_started: Callable[[int], None] | None = None, log: IO[bytes] | int | None = None,
             close_sinks: bool = False) -> QemuVm:
    """Start QEMU for `spec` (whose streams must include "stdout", "stderr" and "status"): listen
    on the streams' sockets, start QEMU, accept its connections, start the pumps. `on_started`
    gets QEMU's pid as soon as it runs (to record it before anything can fail). QEMU's own
    messages go to `log` (default: discarded). `close_sinks`: the stdout and stderr descriptors
    are the VM's (closed when their stream ends, e.g. a pipe's write end whose reader wants EOF).
    On any failure QEMU is killed and reaped."""
    spec.check()
    accel = accel or choose_accel(spec.kernel, spec.initrd)
    argv = qemu_argv(spec, accel=accel, binary=qemu_binary(), tsc_khz=host_tsc_khz(), runas=unprivileged_user())
    listeners: dict[str, socket.socket] = {}
    sockets: dict[str, str] = {}
    proc: subprocess.Popen[bytes] | None = None
    try:
        console = console_socket(spec)
        sockets = {s.name: s.socket for s in spec.streams} | ({CONSOLE: console} if console else {})
        for name, path in sockets.items():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            ls.bind(path)
            os.chmod(path, 0o600)
            ls.listen(1)
            listeners[name] = ls
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log if log is not None else subprocess.DEVNULL,
                                stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
                                start_new_session=True)
        if on_started is not None:
            on_started(proc.pid)
        vm = QemuVm(proc)
        conns = accept_streams(listeners, proc)
        vm.conns = list(conns.values())
        targets = {"stdout": _sink_fd(stdout, 1), "stderr": _sink_fd(stderr, 2)}
        for name, conn in conns.items():
            if name == SIGNAL:
                conn.setblocking(False)  # (sent to from a signal handler: never blocks it)
                vm.control = conn
                continue
            if name in ("status", "mounts"):
                into = vm.status if name == "status" else vm.mounts
                th = threading.Thread(target=_pump_bounded, args=(conn, into, STATUS_MAX), daemon=True)
            elif name == CONSOLE:
                th = threading.Thread(target=_pump_to_log, args=(conn, spec.console_log, CONSOLE_MAX), daemon=True)
            elif name in targets:
                th = threading.Thread(target=_pump_to_fd, args=(conn, targets.pop(name), close_sinks), daemon=True)
            else:
                th = threading.Thread(target=_drain, args=(conn,), daemon=True)
            th.start()
            vm.pumps.append(th)
        if close_sinks:  # (a stream QEMU never connected: nothing will write to its sink)
            for fd in targets.values():
                os.close(fd)
        return vm
    except BaseException:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        raise
    finally:
        for ls in listeners.values():
            ls.close()
        for path in sockets.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def accept_streams(listeners: dict[str, socket.socket], proc: subprocess.Popen[bytes]) -> dict[str, socket.socket]:
    """One accepted connection per listener (name -> connection), as the VMM connects its streams;
    ShimError if the VMM exits first or CONNECT_TIMEOUT passes."""
    conns: dict[str, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT
    # poll, not select: the caller (a long-lived shim host: the snapshotter, a service) may hold
    # descriptors numbered 1024 and up, which select() refuses.
    poller = select.poll()
    waiting: dict[int, tuple[str, socket.socket]] = {}
    for name, ls in listeners.items():
        poller.register(ls, select.POLLIN)
        waiting[ls.fileno()] = (name, ls)
    try:
        while waiting:
            if proc.poll() is not None:
                raise ShimError(f"{QEMU} exited with status {proc.returncode} before the VM started")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShimError(f"{QEMU} did not connect its streams within {CONNECT_TIMEOUT:.0f} s")
            for fd, _events in poller.poll(min(left, 0.1) * 1000):
                name, ls = waiting.pop(fd)
                poller.unregister(fd)
                conn, _ = ls.accept()
                conns[name] = conn
    except BaseException:
        for c in conns.values():
            c.close()
        raise
    return conns
