"""The config drive: how the host tells the guest's init what to run, without a command line.

The kernel command line is world-readable (the VMM's argv on the host, /proc/cmdline in the
guest), and a workload's environment may hold secrets, so the workload's description travels on a
small read-only drive instead: a ustar archive (busybox tar reads it straight off the block device)
written 0600 under the sandbox's 0700 directory, with one member per field:

    argv        the command, NUL-separated (entrypoint + command, OCI semantics)
    env         KEY=VALUE entries, NUL-separated (the environment's, then the caller's)
    workdir     the working directory inside the root
    user        "" (root), uid[:gid] or names (resolved in the guest against the root's etc/passwd)
    upper       "drive" (the upper drive, ext4) or "tmpfs"
    upper_size  bytes of the tmpfs upper
    flags       space-separated: nosuid, nodev (the root's mount flags)
    hostname    the sandbox id

`config_tar` is pure; `write_config` does the I/O.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from layerstore.fileio import write_atomic

MAX_CONFIG = 8 << 20  # a command and environment larger than this is refused by the host


@dataclass(frozen=True)
class GuestConfig:
    argv: tuple[str, ...]
    env: tuple[str, ...]
    workdir: str = "/"
    user: str = ""
    upper: str = "tmpfs"  # or "drive"
    upper_size: int = 1 << 30
    nosuid: bool = True
    nodev: bool = True
    hostname: str = "sandbox"


def config_tar(cfg: GuestConfig) -> bytes:
    """The drive's bytes: a ustar archive padded to whole 512-byte sectors (pure)."""
    if not cfg.argv:
        raise ValueError("nothing to run")
    for s in (*cfg.argv, *cfg.env):
        if "\0" in s:
            raise ValueError("a NUL byte in the command or the environment")
    flags = " ".join(f for f, on in (("nosuid", cfg.nosuid), ("nodev", cfg.nodev)) if on)
    members = {
        "argv": "\0".join(cfg.argv).encode(),
        "env": "\0".join(cfg.env).encode(),
        "workdir": (cfg.workdir or "/").encode(),
        "user": cfg.user.encode(),
        "upper": cfg.upper.encode(),
        "upper_size": str(int(cfg.upper_size)).encode(),
        "flags": flags.encode(),
        "hostname": cfg.hostname[:63].encode(),
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            tar.addfile(info, io.BytesIO(data))
    raw = out.getvalue()
    if len(raw) > MAX_CONFIG:
        raise ValueError(f"the command and environment take {len(raw)} bytes; at most {MAX_CONFIG}")
    return raw + bytes(-len(raw) % 512)


def write_config(path: Path, cfg: GuestConfig) -> Path:
    write_atomic(path, config_tar(cfg), mode=0o600)
    return path
