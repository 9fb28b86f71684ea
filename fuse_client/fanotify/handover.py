"""The group fd between processes: the holder's socket (`CACHE/fanotify.sock`), SCM_RIGHTS, and
the holder's identity file (`CACHE/fanotify.holder`: pid and start time), what the shim's layer
mounts name as their generation (docs/fanotify.md, "Every process of ours killed").

Protocol (one request per connection, peer must be root): the client sends one byte, `G` (give me
the group: the answer is `{"pid": P}` with the group fd attached), `Q` (quit: the holder
answers `{"pid": P}` and exits, closing its copy of the group) or `C` (claim: the holder answers
`{"pid": P}` and keeps the connection; a daemon keeps it open while it runs, and its end tells
the holder that daemon is gone).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import socket
from pathlib import Path

from layerstore import linux

SOCKET_NAME = "fanotify.sock"
IDENTITY_NAME = "fanotify.holder"
ATTACHED_NAME = "fanotify-attached.json"  # blob -> holders, persisted by the daemon (frontend)
MAX_ANSWER = 4096


def socket_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


def identity_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / IDENTITY_NAME


proc_start_time = linux.proc_start_time


def write_identity(cache_dir: Path, pid: int, group_id: str) -> None:
    start = proc_start_time(pid)
    tmp = identity_path(cache_dir).with_suffix(f".{pid}.tmp")
    tmp.write_text(json.dumps({"pid": pid, "start_time": start, "group": group_id}))
    os.replace(tmp, identity_path(cache_dir))


def read_identity(cache_dir: Path) -> tuple[int, str] | None:
    """(pid, group id) of the live holder of this cache's group, else None."""
    try:
        ident = json.loads(identity_path(cache_dir).read_text())
        pid, start, group = int(ident["pid"]), ident["start_time"], str(ident["group"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if start is None or proc_start_time(pid) != start:
        return None
    return pid, group


def holder_generation(cache_dir: Path) -> str | None:
    """`fanotify:<group id>` while a holder keeps this cache's group, else None: what the layer
    mounts made on the group name as their generation (a new group is a new generation)."""
    ident = read_identity(cache_dir)
    return None if ident is None else f"fanotify:{ident[1]}"


def load_attachments(cache_dir: Path) -> dict[str, list[str]]:
    """blob -> holders, as the last daemon persisted them ({} if none or unreadable: an
    unreadable file is logged as an ERROR, since the layers it named are not taken back and
    their reads of unfilled ranges are denied)."""
    path = Path(cache_dir) / ATTACHED_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        logging.getLogger("layerstore.fanotify").error("cannot read %s: %s", path, e)
        return {}
    try:
        data = json.loads(text)
        return {str(b): [str(h) for h in hs] for b, hs in data.get("blobs", {}).items()}
    except (ValueError, AttributeError, TypeError) as e:
        logging.getLogger("layerstore.fanotify").error("%s is not a list of attachments (%s): nothing taken back",
                                                       path, e)
        return {}


def send_fd(conn: socket.socket, payload: bytes, fd: int) -> None:
    conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_fd(conn: socket.socket) -> tuple[bytes, int | None]:
    fds = array.array("i")
    msg, anc, _flags, _addr = conn.recvmsg(MAX_ANSWER, socket.CMSG_SPACE(fds.itemsize))
    fd = None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            if fds:
                fd = fds[0]
                for extra in fds[1:]:
                    os.close(extra)
    return msg, fd


def request(cache_dir: Path, what: bytes, *, timeout: float = 5.0,
            path: Path | None = None) -> tuple[dict[str, object], int | None]:
    """Ask the holder (or whoever listens on `path` with this protocol: the keeper); (answer, fd
    or None). OSError if nobody answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.fspath(path or socket_path(cache_dir)))
        s.sendall(what)
        msg, fd = recv_fd(s)
    if fd is not None:
        os.set_inheritable(fd, False)
    try:
        return json.loads(msg or b"{}"), fd
    except ValueError:
        if fd is not None:
            os.close(fd)
        raise OSError("the fanotify holder answered garbage") from None


def fetch_group(cache_dir: Path) -> tuple[int, int, str] | None:
    """(group fd, holder pid, group id) from a live holder, None if none answers."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        ans, fd = request(cache_dir, b"G")
        if fd is not None:
            return fd, int(ans.get("pid", 0)), str(ans["group"])  # type: ignore[call-overload]
    return None


def claim(cache_dir: Path) -> tuple[socket.socket, int] | None:
    """A claim on the live holder (the connection, to keep open while this daemon runs; the
    holder's pid), None if none answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(5)
        s.connect(os.fspath(socket_path(cache_dir)))
        s.sendall(b"C")
        ans = json.loads(s.recv(MAX_ANSWER) or b"{}")
        return s, int(ans["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        s.close()
        return None


def quit_holder(cache_dir: Path) -> int | None:
    """Tell the holder to exit; its pid, or None if none answered."""
    with contextlib.suppress(OSError):
        ans, fd = request(cache_dir, b"Q")
        if fd is not None:
            os.close(fd)
        return int(ans.get("pid", 0))  # type: ignore[call-overload]
    return None


def peer_is_root(conn: socket.socket) -> bool:
    try:
        _pid, uid, _gid, _groups = linux.peer_credentials(conn.fileno())
    except OSError:
        return False
    return uid == 0
