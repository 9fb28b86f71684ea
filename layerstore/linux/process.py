"""Processes and credentials: a process's start time (/proc/PID/stat), a Unix socket peer's
credentials (SO_PEERCRED, SO_PEERGROUPS), a new user namespace (unshare(CLONE_NEWUSER)).
"""

from __future__ import annotations

import ctypes
import errno
import os

from layerstore.errors import PermissionDenied

from .libc import libc

CLONE_NEWUSER = 0x10000000
libc.unshare.argtypes = [ctypes.c_int]


def proc_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot, /proc/PID/stat field 22) of a live, non-zombie
    process, else None: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields resume after the last ')'
    rest = stat_line[stat_line.rindex(b")") + 2 :].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


SO_PEERGROUPS = 59  # Linux 4.13+; not in Python's socket module


def peer_credentials(fd: int) -> tuple[int, int, int, tuple[int, ...]]:
    """(pid, uid, gid, supplementary gids) of the process at the other end of a connected Unix
    socket, as the kernel recorded them at connect time (SO_PEERCRED, SO_PEERGROUPS)."""
    import socket
    import struct

    s = socket.socket(fileno=os.dup(fd))
    try:
        pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        raw = s.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # Python's largest buffer: 256 groups
    except OSError as e:
        if e.errno != errno.ERANGE:
            raise
        raw = b""  # more groups than that: ask /proc (the peer's groups now, not at connect time)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    raw = struct.pack(f"{len(line.split()) - 1}I", *map(int, line.split()[1:]))
    finally:
        s.close()
    return pid, uid, gid, struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def user_namespace(uid_base: int, gid_base: int, count: int) -> int:
    """An fd of a new user namespace in which ids 0..count-1 are the host's uid_base.. and
    gid_base..: a short-lived child unshares CLONE_NEWUSER, this process writes its uid_map and
    gid_map, opens /proc/PID/ns/user and lets it exit (the fd keeps the namespace)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only raw syscalls, then _exit
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            ok = libc.unshare(CLONE_NEWUSER) == 0
            os.write(ready_w, b"y" if ok else b"n")
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    try:
        answer = os.read(ready_r, 1)
        if answer != b"y":
            raise PermissionDenied("unshare(CLONE_NEWUSER) failed in the helper process")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"0 {uid_base} {count}\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"0 {gid_base} {count}\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(go_w)  # the child reads EOF and exits
        os.waitpid(pid, 0)
