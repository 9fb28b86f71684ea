"""Per-sandbox record files: NODE/sandboxes/<id>/sandbox.json, written once when the sandbox is
created. They duplicate the sandbox's state record so that recovery can rebuild the picture when
the state database is lost or not trusted (after a reboot: see `state`); a sandbox being torn
down is first renamed into NODE/sandboxes/.trash, so a record file present means "this sandbox
exists". Trash entries are named <id>.<pid>-<random>: the pid of the process that deletes it, so
that a start-up can tell leftovers of a dead process from a deletion in progress.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from layerstore.fileio import pwrite_all, write_atomic

from .paths import SANDBOX_ID, NodePaths
from .state import Sandbox, encode

RECORD = "sandbox.json"
TRASH = ".trash"


def save(paths: NodePaths, sb: Sandbox, *, fresh: bool = False, encoded: bytes | None = None) -> None:
    """Write the sandbox's record file. `fresh`: the sandbox's directory was created by this
    mount (exclusively) and holds no record yet: the file is created exclusively and written in
    one write(2), without a temporary file and a rename (two metadata operations fewer per mount).
    A crash can then leave an empty or unfinished file, which is not JSON: recovery reads it as no
    record at all, exactly what a crash before the rename left (`scan` skips it, `unrecorded`
    reports the directory); within the boot the database's pending mount rolls the sandbox back.
    Otherwise (a caller's upper: the directory may hold an older record) temporary file + rename.

    Not fsynced, either way: the record matters when the state database is lost while the
    machine stays up (a process crash leaves the page cache, so the file is there), and after a
    power loss, which takes every mount with it and leaves the uppers, which is all a lost record
    could have pointed at (docs/runtime-shim.md, "Durability"). Compact JSON, as the state
    database holds it (`encoded`: `state.encode(sb.to_json())`, when the caller has it)."""
    data = encoded if encoded is not None else encode(sb.to_json())
    path = paths.sandbox_dir(sb.id) / RECORD
    if not fresh:
        write_atomic(path, data, durable=False)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, data, 0)
    finally:
        os.close(fd)


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
            obj = json.loads((paths.sandboxes / name / RECORD).read_bytes())
            sb = Sandbox.from_json(obj)
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
    unsynced record file. Reported, never deleted (an upper may hold data)."""
    try:
        names = os.listdir(paths.sandboxes)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        if name in known or not SANDBOX_ID.fullmatch(name):
            continue
        try:
            json.loads((paths.sandboxes / name / RECORD).read_bytes())
        except (OSError, ValueError):
            out.append(name)
    return out
