"""/run/mount/utab entries that make util-linux's `umount TARGET` call `umount.layerstore TARGET`.

A sandbox root shows in the kernel's table as a plain `overlay` mount; `umount TARGET` would only
detach it and leave the sandbox's layer references (and its record) behind. libmount keeps the
options the kernel does not know in its own table, /run/mount/utab, matched to mountinfo by mount
id; an entry with `helper=layerstore` makes umount(8) hand the request to /sbin/umount.layerstore,
for root as well. (`uhelper=` is only consulted for non-root users: tested, util-linux 2.38.) When
that helper is not installed, umount(8) unmounts by itself and drops the entry.

The file is shared with libmount: every change happens under its lock (flock on utab.lock) and
is whole or absent (write a temporary file, rename). Adding appends one line; removing rewrites
the file, O(entries), so only sandboxes mounted for mount(8) users (`mount.layerstore`,
`layerctl mount`) get an entry, not those of the API or of `layerctl run`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from layerstore.fileio import write_atomic
from layerstore.linux import escape, unescape

UTAB_DIR = Path("/run/mount")
HELPER = "layerstore"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[Path]:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(directory / "utab.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory / "utab"
    finally:
        os.close(fd)


def entry(mount_id: int, target: str, source: str = "overlay") -> str:
    return f"ID={mount_id} SRC={escape(source)} TARGET={escape(target)} ROOT=/ OPTS=helper={HELPER}\n"


def add(mount_id: int, target: str, *, directory: Path = UTAB_DIR) -> None:
    """Record `target` (mount `mount_id`) as a layerstore mount."""
    with _locked(directory) as utab:
        fd = os.open(utab, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, entry(mount_id, target).encode())
        finally:
            os.close(fd)


def _target_of(line: str) -> str | None:
    for field in line.split():
        if field.startswith("TARGET="):
            return unescape(field[len("TARGET="):])
    return None


def remove(target: str, *, directory: Path = UTAB_DIR) -> bool:
    """Drop the layerstore entries for `target`; True if there was one."""
    with _locked(directory) as utab:
        try:
            lines = utab.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return False
        keep = [ln for ln in lines if not (_target_of(ln) == target and f"helper={HELPER}" in ln)]
        if len(keep) == len(lines):
            return False
        write_atomic(utab, "".join(keep).encode(), durable=False, mode=0o644)
        return True


def targets(*, directory: Path = UTAB_DIR) -> set[str]:
    """Every target with a layerstore entry."""
    try:
        text = (directory / "utab").read_text()
    except FileNotFoundError:
        return set()
    return {t for ln in text.splitlines() if f"helper={HELPER}" in ln and (t := _target_of(ln)) is not None}
