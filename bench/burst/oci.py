"""A minimal OCI runtime bundle for the conventional contender's runc runs.

What containerd's default spec gives a container, minus the parts a short batch task never uses: the
usual namespaces (a network namespace of its own, with nothing in it), /proc, /dev, /dev/pts, /dev/shm,
/sys read-only, no terminal. The cgroup path is absolute, like the layerstore shim's (/layerstore/<id>), so
both contenders' sandboxes are accounted the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"]


def runtime_config(args: list[str], *, hostname: str, cwd: str = "/", rootfs: str = "rootfs",
                   cgroups_path: str = "") -> dict[str, object]:
    caps = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
            "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT",
            "CAP_KILL", "CAP_AUDIT_WRITE"]
    linux: dict[str, object] = {
        "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
        "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                        "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
        "readonlyPaths": ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    }
    if cgroups_path:
        linux["cgroupsPath"] = cgroups_path
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": DEFAULT_ENV,
            "cwd": cwd,
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": linux,
    }


def write_bundle(bundle: Path, args: list[str], *, hostname: str, cwd: str = "/", cgroups_path: str = "") -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "rootfs").mkdir(exist_ok=True)
    config = runtime_config(args, hostname=hostname, cwd=cwd, cgroups_path=cgroups_path)
    (bundle / "config.json").write_text(json.dumps(config))
