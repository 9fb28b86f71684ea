"""systemd's file-descriptor store for the fanotify group (docs/fanotify.md, "Every process of ours
killed"): under a service manager that speaks the sd_notify protocol (systemd sets
`$NOTIFY_SOCKET` for a unit with `NotifyAccess=` and `FileDescriptorStoreMax=`, see
fuse_client/contrib/layerstore-daemon.service), the daemon hands a copy of the group to the
manager (`FDSTORE=1`, `FDNAME=fanotify-<group id>`, the fd attached with SCM_RIGHTS). The manager
is PID 1: it cannot be killed, so the group, its marks and the readers waiting on it survive every
process of ours. On the next start it hands the fd back (`$LISTEN_FDS` from fd 3,
`$LISTEN_FDNAMES`, `$LISTEN_PID` = ours), which `take_over` uses when no holder answers.

The keeper (`keeper`, a process of ours for nodes without such a manager) takes the same
messages on its own notify socket: `store` and `forget` are the one implementation of the
sender's side, `parse_message` of the receiver's.

Pure parsing (`listened`, `parse_message`) apart from the calls that touch the socket or the
environment.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket

log = logging.getLogger("layerstore.fanotify")

NAME_PREFIX = "fanotify-"
LISTEN_FDS_START = 3


def notify_address(value: str) -> str | bytes | None:
    """The socket address of a `$NOTIFY_SOCKET` value (`@name`: the abstract namespace), None
    if unset or not a Unix socket path."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def store(fd: int, group_id: str, *, env: dict[str, str] | None = None) -> bool:
    """Hand a copy of the group `fd` to the service manager's fd store; False when there is no
    manager to hand it to (no `$NOTIFY_SOCKET`) or it refused (logged)."""
    addr = notify_address((env if env is not None else os.environ).get("NOTIFY_SOCKET", ""))
    if addr is None:
        return False
    msg = f"FDSTORE=1\nFDNAME={NAME_PREFIX}{group_id}\n".encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, addr)
    except OSError as e:
        log.error("cannot hand the fanotify group to the service manager's fd store (%s): %s", addr, e)
        return False
    log.info("fanotify group %s handed to the service manager's fd store", group_id)
    return True


def forget(group_id: str, *, env: dict[str, str] | None = None) -> None:
    """Ask the manager to drop its copy (nothing is mounted on the group any more)."""
    addr = notify_address((env if env is not None else os.environ).get("NOTIFY_SOCKET", ""))
    if addr is None:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(f"FDSTOREREMOVE=1\nFDNAME={NAME_PREFIX}{group_id}\n".encode(), addr)
    except OSError as e:
        log.warning("cannot remove the fanotify group from the fd store: %s", e)


def parse_message(msg: bytes) -> dict[str, str]:
    """The `KEY=value` lines of an sd_notify datagram (pure)."""
    return dict(line.split("=", 1) for line in msg.decode(errors="replace").splitlines() if "=" in line)


def stored_name(fields: dict[str, str]) -> tuple[str, str] | None:
    """("store" | "remove", group id) of a message about a fanotify group, else None (pure)."""
    name = fields.get("FDNAME", "")
    if not name.startswith(NAME_PREFIX) or len(name) == len(NAME_PREFIX):
        return None
    if fields.get("FDSTORE") == "1":
        return "store", name[len(NAME_PREFIX):]
    if fields.get("FDSTOREREMOVE") == "1":
        return "remove", name[len(NAME_PREFIX):]
    return None


def listened(env: dict[str, str], pid: int) -> list[tuple[int, str]]:
    """(fd, group id) of every fanotify group the manager passed to process `pid` (pure)."""
    if env.get("LISTEN_PID", "") != str(pid):
        return []
    try:
        n = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    names = env.get("LISTEN_FDNAMES", "").split(":")
    out = []
    for k in range(max(0, min(n, 1024))):
        name = names[k] if k < len(names) else ""
        if name.startswith(NAME_PREFIX) and len(name) > len(NAME_PREFIX):
            out.append((LISTEN_FDS_START + k, name[len(NAME_PREFIX):]))
    return out


def take_listened() -> tuple[int, str] | None:
    """The group the manager passed to this process, once: (fd, group id), close-on-exec from
    now on, or None. Any other fanotify fds it passed are closed (one group per cache)."""
    got = listened(dict(os.environ), os.getpid())
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)  # (not for the processes this one starts)
    if not got:
        return None
    for fd, _gid in got[1:]:
        with contextlib.suppress(OSError):
            os.close(fd)
    fd, gid = got[0]
    try:
        os.set_inheritable(fd, False)
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            if b"fanotify flags:" not in f.read():
                raise OSError(f"fd {fd} is not a fanotify group")
    except OSError as e:
        log.error("the service manager passed %s, not a usable fanotify group: %s", fd, e)
        return None
    log.info("fanotify group %s handed back by the service manager's fd store", gid)
    return fd, gid
