"""Per-sandbox records: the sandbox's state record, duplicated on its directory NODE/sandboxes/<id>
as the extended attribute `trusted.layerstore.sandbox` (or, where the filesystem refuses that
attribute, in the file NODE/sandboxes/<id>/sandbox.json), written once when the sandbox is
created, so that recovery can rebuild the picture when the state database is lost or not trusted
(after a reboot: see `state`). An attribute on the directory the mount creates anyway costs no
inode, no dentry and no data block: a file cost a warm mount about 0.1 ms of the node disk's time
(docs/benchmarks-compose.md). A sandbox being torn down is first renamed into NODE/sandboxes/.trash
(its record goes with it), so a record present means "this sandbox exists". Trash entries are named
<id>.<pid>-<random>: the pid of the process that deletes it, so that a start-up can tell leftovers
of a dead process from a deletion in progress. Readers take the attribute first, then the file
(records of earlier shims, and of filesystems without `trusted` attributes).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from layerstore.fileio import pwrite_all, write_atomic

from .paths import SANDBOX_ID, NodePaths
from .state import Sandbox, encode

RECORD = "sandbox.json"  # where the attribute cannot be set
XATTR = "trusted.layerstore.sandbox"
TRASH = ".trash"
# The attribute is refused: no `trusted` namespace here (a user namespace, a filesystem without
# extended attributes) or no room for a record this large (ext4: one block per inode).
_NO_XATTR = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.E2BIG, errno.ENOSPC, errno.ERANGE})


def save(paths: NodePaths, sb: Sandbox, *, fresh: bool = False, encoded: bytes | None = None) -> None:
    """Record the sandbox on its directory. `fresh`: the directory was created by this mount
    (exclusively) and holds no record yet: the attribute is created (XATTR_CREATE). Otherwise (a
    caller's upper: the directory may hold an older record) it is replaced; setting an attribute
    is atomic either way, so a crash leaves the old record or the new one, never part of one. A
    crash before it leaves a directory without a record: recovery reports it (`unrecorded`), and
    within the boot the database's pending mount rolls the sandbox back.

    Where the attribute is refused, the file: created exclusively and written in one write(2)
    when `fresh` (a crash can leave it empty or unfinished, which is not JSON: read as no record
    at all), else a temporary file and a rename.

    Not fsynced, either way: the record matters when the state database is lost while the
    machine stays up (a process crash leaves the page cache), and after a power loss, which takes
    every mount with it and leaves the uppers, which is all a lost record could have pointed at
    (docs/runtime-shim.md, "Durability"). Compact JSON, as the state database holds it (`encoded`:
    `state.encode(sb.to_json())`, when the caller has it)."""
    data = encoded if encoded is not None else encode(sb.to_json())
    sdir = paths.sandbox_dir(sb.id)
    try:
        os.setxattr(sdir, XATTR, data, os.XATTR_CREATE if fresh else 0)
    except OSError as e:
        if e.errno not in _NO_XATTR:
            raise
    else:
        if not fresh:  # (an earlier shim's file would be read after this attribute was removed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sdir / RECORD)
        return
    path = sdir / RECORD
    if not fresh:
        write_atomic(path, data, durable=False)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, data, 0)
    finally:
        os.close(fd)


def load(sdir: str | os.PathLike[str]) -> bytes | None:
    """The record on a sandbox's directory as stored (the attribute, else the file), or None."""
    try:
        return os.getxattr(sdir, XATTR)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ENODATA and e.errno not in _NO_XATTR:
            raise
    try:
        with open(os.path.join(sdir, RECORD), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def remove(paths: NodePaths, sandbox: str) -> None:
    """Forget a sandbox's record (its directory stays: a caller's upper lives there)."""
    sdir = paths.sandbox_dir(sandbox)
    with contextlib.suppress(OSError):
        os.removexattr(sdir, XATTR)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sdir / RECORD)


def scan(paths: NodePaths) -> Iterator[Sandbox]:
    """Every readable sandbox record on the node (unreadable ones are skipped: never guessed at)."""
    try:
        names = os.listdir(paths.sandboxes)
    except FileNotFoundError:
        return
    for name in sorted(names):
        if not SANDBOX_ID.fullmatch(name):
            continue
        try:
            sb = Sandbox.from_json(json.loads(load(paths.sandboxes / name) or b""))
        except (OSError, ValueError, TypeError):
            continue
        if sb.id == name:
            yield sb


def trash(paths: NodePaths, sandbox: str) -> Path | None:
    """Move a sandbox's directory out of the way (atomically: its record goes with it)."""
    src = paths.sandbox_dir(sandbox)
    dst_dir = paths.sandboxes / TRASH
    dst_dir.mkdir(mode=0o700, exist_ok=True)
    dst = dst_dir / f"{sandbox}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    return dst


def trashed_ids(paths: NodePaths) -> set[str]:
    """Sandboxes whose directory a teardown already moved to the trash."""
    try:
        return {name.rsplit(".", 1)[0] for name in os.listdir(paths.sandboxes / TRASH)}
    except FileNotFoundError:
        return set()


def _owner_alive(name: str) -> bool:
    pid = name.rsplit(".", 1)[-1].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def empty_trash(paths: NodePaths, *, only_dead: bool = False) -> int:
    """Delete what is in the trash (with `only_dead`, not what a live process is deleting)."""
    d = paths.sandboxes / TRASH
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return 0
    done = 0
    for name in names:
        if only_dead and _owner_alive(name):
            continue
        shutil.rmtree(d / name, ignore_errors=True)
        done += 1
    return done


def unrecorded(paths: NodePaths, known: set[str]) -> list[str]:
    """Sandbox directories with no readable record that no sandbox in `known` owns: left by a
    crash between creating the directory and recording it, or by a power loss that took the
    unsynced record. Reported, never deleted (an upper may hold data)."""
    try:
        names = os.listdir(paths.sandboxes)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        if name in known or not SANDBOX_ID.fullmatch(name):
            continue
        try:
            json.loads(load(paths.sandboxes / name) or b"")
        except (OSError, ValueError):
            out.append(name)
    return out
