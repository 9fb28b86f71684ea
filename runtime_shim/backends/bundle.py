"""OCI runtime bundles: config.json for one sandbox, from the environment's runtime config (the
config builder is pure; `write_bundle` does the I/O).

The container sees only its composed root (read-write: writes land in the sandbox's upper), with
a minimal /proc, /dev, /sys and /tmp as runc's default spec has them; it runs as root (unless the
environment names a user) in its own pid, ipc, uts, mount and network namespaces (the network
namespace has only loopback); in a user namespace of its own when the sandbox has an id range
(`idmap`: root in it is an unprivileged uid on the host). PID 1 is a minimal init (`pid1`: tini,
the workload its child), the one node file bound in: read-only, at /dev/init; unless the caller
gives no init (`Confinement.init` off): then the workload is PID 1 and nothing is bound in. No
other node path is: the daemon's socket, the store, the cache and other sandboxes' uppers are
simply not in its mount tree.

Least privilege (`Confinement`, every measure on unless the caller relaxes it): the default
seccomp profile (`seccomp`), Docker's default capability set (nothing else, none inheritable or
ambient), no_new_privileges, runc's and Docker's masked and read-only /proc and /sys paths, and
limits on tasks, memory and CPU in the sandbox's cgroup (`linux.resources`).

The environment (and the secrets in it) reaches the runtime only through config.json, 0600 in a
0700 bundle directory: never a command line.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerstore.errors import BadInput, NotFound
from layerstore.fileio import write_atomic
from layerstore.linux import read_regular_beneath, regular_size_beneath

from ..nodestate.idmap import RANGE_SIZE
from .base import Confinement
from .pid1 import init_args, init_mount
from .seccomp import default_profile

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Docker's default capability set: enough for package managers and build tools run as root.
CAPABILITIES = [
    "CAP_AUDIT_WRITE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_MKNOD",
    "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID",
    "CAP_SYS_CHROOT",
]
# runc's default spec (`runc spec`) masks and makes read-only these; Docker adds the powercap
# energy counters (CVE-2020-8694: a side channel on what the node's CPUs compute) and
# /proc/interrupts (what the node's devices do). Masked = a file bound over by /dev/null, a
# directory by an empty read-only tmpfs.
MASKED = ["/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
          "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
          "/sys/devices/virtual/powercap"]
READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
CPU_PERIOD = 100_000  # microseconds: the CFS period a CPU limit is a quota of
PASSWD_MAX = 4 << 20  # the most of the rootfs's etc/passwd or etc/group that is read
# What the runtime opens in the sandbox's root before the workload runs, whatever the user: runc's
# init looks the process's uid and gid up in both (GetExecUserPath: home directory, supplementary
# groups) and crun reads etc/passwd for HOME; a FIFO there blocks the runtime in open(2) for good.
RUNTIME_READS = ("etc/passwd", "etc/group")


def process_args(config: dict[str, Any], command: Sequence[str] | None) -> list[str]:
    """OCI semantics: entrypoint + (the caller's command, else the image's cmd)."""
    args = [*config.get("entrypoint", []), *(command if command else config.get("cmd", []))]
    if not args:
        raise BadInput("nothing to run: the environment has no entrypoint or cmd and no command was given")
    return args


def process_env(config: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    env = [*config.get("env", []), *extra]
    if not any(e.startswith("PATH=") for e in env):
        env.insert(0, DEFAULT_PATH)
    return env


def resources(confinement: Confinement) -> dict[str, Any]:
    """`linux.resources`: no device but the defaults, and the limits that are set (pure)."""
    res: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if confinement.pids is not None:
        res["pids"] = {"limit": confinement.pids}
    if confinement.memory is not None:
        res["memory"] = {"limit": confinement.memory}
    if confinement.cpus is not None:
        res["cpu"] = {"quota": max(1000, round(confinement.cpus * CPU_PERIOD)), "period": CPU_PERIOD}
    return res


def oci_config(rootfs: str, args: Sequence[str], *, env: Sequence[str], cwd: str = "/", uid: int = 0,
               gid: int = 0, hostname: str = "sandbox", cgroups_path: str = "",
               terminal: bool = False, nofile: int = 1024,
               confinement: Confinement | None = None, userns: int | None = None,
               init: str | None = None) -> dict[str, Any]:
    """A complete config.json (OCI runtime spec 1.0.2) for a sandbox (pure). `userns`: the base
    host id of the sandbox's id range (`idmap`): a user namespace mapping 0..65535 to it. `init`:
    the host path of the init that runs as PID 1 with `args` as its child (`pid1`); None: `args`
    run as PID 1 themselves."""
    conf = confinement or Confinement()
    caps = list(CAPABILITIES)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=1048576k"]},
    ]
    if init is not None:
        mounts.append(init_mount(init))  # (after /dev: its target is made in that tmpfs)
        args = init_args(list(args))
    linux: dict[str, Any] = {
        "resources": resources(conf),
        "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
    }
    if not conf.system_paths:
        linux["maskedPaths"] = list(MASKED)
        linux["readonlyPaths"] = list(READONLY)
    if conf.seccomp:
        linux["seccomp"] = default_profile(ptrace=conf.ptrace)
    if cgroups_path:
        linux["cgroupsPath"] = cgroups_path
    if userns is not None:
        linux["namespaces"].append({"type": "user"})
        linux["uidMappings"] = [{"containerID": 0, "hostID": userns, "size": RANGE_SIZE}]
        linux["gidMappings"] = [{"containerID": 0, "hostID": userns, "size": RANGE_SIZE}]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": terminal,
            "user": {"uid": uid, "gid": gid},
            "args": list(args),
            "env": list(env),
            "cwd": cwd or "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": not conf.new_privileges,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname[:63],
        "mounts": mounts,
        "linux": linux,
    }


def parse_user(user: str, passwd: str = "", group: str = "") -> tuple[int, int]:
    """"" -> root; "uid[:gid]" numeric, or names looked up in the rootfs's /etc/passwd and /etc/group."""
    if not user:
        return 0, 0
    name, _, grp = user.partition(":")

    def lookup(text: str, key: str, what: str) -> tuple[int, int]:
        # passwd: name:x:uid:gid:...  group: name:x:gid:members
        for line in text.splitlines():
            f = line.split(":")
            if len(f) >= 4 and f[0] == key and f[2].isdigit():
                return int(f[2]), int(f[3]) if f[3].isdigit() else 0
        raise BadInput(f"user {user!r}: no {what} {key!r} in the environment")

    if name.isdigit():
        uid, gid = int(name), int(name) if not grp else 0
        if not grp:
            for line in passwd.splitlines():
                f = line.split(":")
                if len(f) >= 4 and f[2] == name:
                    gid = int(f[3])
                    break
    else:
        uid, gid = lookup(passwd, name, "user")
    if grp:
        gid = int(grp) if grp.isdigit() else lookup(group, grp, "group")[0]
    return uid, gid


def read_rootfs_file(rootfs: str, rel: str) -> str:
    """A small regular file of the sandbox's root, which its layers (a hostile store) and its
    writer made: resolved beneath the root (no symlink, no mount crossed), never a FIFO (it
    would hang the read) or a device (/dev/zero would never end), at most PASSWD_MAX bytes.
    "" if it is absent; `BadInput` naming the file if it is refused."""
    try:
        return read_regular_beneath(rootfs, rel, PASSWD_MAX).decode(errors="replace")
    except NotFound:
        return ""
    except BadInput as e:
        raise BadInput(f"the environment's {e}") from None


def check_rootfs(rootfs: str) -> None:
    """Refuse (`BadInput` naming the file) a root in which a file the runtime or the shim reads
    (`RUNTIME_READS`) is anything but absent or a regular file of at most PASSWD_MAX bytes reached
    without a symlink: a FIFO, device, socket or directory, a link (which the runtime would follow
    inside the container, onto its /dev or /proc), a larger file. For every user, root included;
    before the runtime starts (nothing runs in the sandbox yet to swap a file after the check)."""
    for rel in RUNTIME_READS:
        try:
            regular_size_beneath(rootfs, rel, PASSWD_MAX)
        except BadInput as e:
            raise BadInput(f"the environment's {e}") from None


def write_bundle(bundle: Path, rootfs: str, config: dict[str, Any], command: Sequence[str] | None, *,
                 sandbox: str, extra_env: Sequence[str] = (), cgroups_path: str = "",
                 confinement: Confinement | None = None, userns: int | None = None,
                 root_path: str | None = None, init: str | None = None) -> Path:
    """Write BUNDLE/config.json for running `command` (or the environment's default) in `rootfs`
    (named `root_path` in the config when given: where the runtime will find it), under `init`
    as PID 1 when given (`pid1.find_init()`)."""
    check_rootfs(rootfs)
    user = config.get("user", "")
    # (the rootfs's account files are read only when a user is to be looked up in them)
    passwd = read_rootfs_file(rootfs, "etc/passwd") if user else ""
    group = read_rootfs_file(rootfs, "etc/group") if ":" in user else ""
    uid, gid = parse_user(user, passwd, group)
    spec = oci_config(root_path or rootfs, process_args(config, command), env=process_env(config, extra_env),
                      cwd=config.get("workdir") or "/", uid=uid, gid=gid, hostname=sandbox,
                      cgroups_path=cgroups_path, confinement=confinement, userns=userns, init=init,
                      # never above the runtime's own hard limit: raising it needs CAP_SYS_RESOURCE
                      nofile=min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    bundle.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(bundle, 0o700)  # (also when it was there already)
    path = bundle / "config.json"
    write_atomic(path, json.dumps(spec, indent=1).encode(), mode=0o600)  # created 0600, never wider
    return path
