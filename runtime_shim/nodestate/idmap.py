"""User namespaces for sandboxes: each sandbox gets its own range of host ids, so that root in a
sandbox is an unprivileged uid on the host, and its layers are shown to it through idmapped clones
of the node's layer mounts.

The scheme (see the user namespace row of docs/sandbox-confinement.md):

- ranges: RANGE_SIZE (65536) ids each; slot n (0 <= n < SLOTS) is host ids
  FIRST_BASE + n * RANGE_SIZE .. + RANGE_SIZE - 1, uids and gids alike. FIRST_BASE = 2**30 keeps
  them above every login account and /etc/subuid's usual 100000.. ranges. A sandbox's base is
  allocated under the node lock, in the transaction that records the sandbox (`Txn.allocate_idrange`),
  kept in its record (`Sandbox.userns`) and freed by the transaction that forgets it: a crash
  leaves no range allocated without a sandbox record, and recovery (which rebuilds the index
  from the records) rebuilds the allocations with them.
- mapping: in the sandbox's user namespace ids 0..65535 are host ids base..base+65535. The layers
  are stacked as idmapped clones (open_tree(OPEN_TREE_CLONE) + mount_setattr(MOUNT_ATTR_IDMAP) with
  a user namespace of that mapping): a layer file recorded as owned by k shows as base+k on the
  host, k in the sandbox. The clones are detached: the overlay names them as /proc/self/fd/N and
  holds them (it clones its lowers privately); the fds are closed right after the mount, so the
  clones go with the overlay and there is nothing more to unmount, clean up or recover.
- the upper and work directories are chowned to base (root in the sandbox owns its root); what
  the sandbox writes is owned by base+k on the host; a commit maps it back (`to_layer_ids`).

`supported()` tries it once per process (a user namespace, an idmapped clone of the node
directory's mount and, if one is mounted, of a layer mount) and caches the answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from layerstore import linux
from layerstore.errors import BadInput, LayerstoreError

from ..errors import ShimError

RANGE_SIZE = 65536
FIRST_BASE = 1 << 30
SLOTS = 16384  # host ids 2**30 .. 2**31 - 1

log = logging.getLogger(__name__)
_supported: dict[str, bool] = {}


def base_of(slot: int) -> int:
    if not 0 <= slot < SLOTS:
        raise ShimError(f"id range slot {slot}: want 0..{SLOTS - 1}")
    return FIRST_BASE + slot * RANGE_SIZE


def slot_of(base: int) -> int:
    slot, rest = divmod(base - FIRST_BASE, RANGE_SIZE)
    if rest or not 0 <= slot < SLOTS:
        raise ShimError(f"{base} is not the base of a sandbox id range")
    return slot


def user_namespace(base: int) -> int:
    """An fd of a fresh user namespace mapping 0..RANGE_SIZE-1 to base.. (uids and gids)."""
    return linux.user_namespace(base, base, RANGE_SIZE)


@contextlib.contextmanager
def idmapped_lowers(mountpoints: Sequence[str], base: int) -> Iterator[list[str]]:
    """Idmapped detached clones of the layer mounts (in the order given), as paths the overlay's
    lowerdir takes (/proc/self/fd/N), valid inside the block: mount the overlay in it."""
    fds: list[int] = []
    try:
        userns = user_namespace(base)
        try:
            paths: dict[str, str] = {}
            for mp in mountpoints:
                if mp not in paths:  # (a layer listed twice: one clone)
                    fd = linux.open_tree_clone(mp)
                    fds.append(fd)
                    linux.idmap_mount(fd, userns)
                    paths[mp] = f"/proc/self/fd/{fd}"
        finally:
            os.close(userns)
        yield [paths[mp] for mp in mountpoints]
    except LayerstoreError as e:
        raise ShimError(f"idmapped layer mounts: {e} (run without a user namespace: --userns off)") from None
    finally:
        for fd in fds:
            os.close(fd)


def supported(probe: str | os.PathLike[str] = "/", layers: str | os.PathLike[str] | None = None) -> bool:
    """Can this kernel give a sandbox a user namespace with idmapped layers? Tried once per
    process (cached): a user namespace, and idmapped clones of `probe`'s mount and of one layer
    mount under `layers`, if any is mounted."""
    key = str(probe)
    if key in _supported:
        return _supported[key]
    ok = True
    why = ""
    try:
        targets = [str(probe)]
        if layers is not None:
            with contextlib.suppress(OSError), os.scandir(layers) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False) and linux.is_mount_root(entry.path):
                        targets.append(entry.path)
                        break
        with idmapped_lowers(targets, FIRST_BASE):
            pass
    except (LayerstoreError, OSError) as e:
        ok, why = False, str(e)
    if not ok:
        log.warning("user namespaces for sandboxes are not available on this node (%s): sandboxes run "
                    "without one (their root is the host's root)", why)
    _supported[key] = ok
    return ok


def to_layer_ids(base: int, uid: int, gid: int, what: bytes | str = b"") -> tuple[int, int]:
    """Host ids of a file in a userns sandbox's upper -> the ids a layer records (minus base);
    an id outside the sandbox's range is refused (`BadInput`): nothing in the sandbox can make
    one, so something else wrote the upper."""
    out = []
    for kind, host in (("uid", uid), ("gid", gid)):
        rel = host - base
        if not 0 <= rel < RANGE_SIZE:
            name = os.fsdecode(what) if isinstance(what, bytes) else what
            raise BadInput(f"{name or '/'}: {kind} {host} is outside the sandbox's id range "
                           f"{base}..{base + RANGE_SIZE - 1}")
        out.append(rel)
    return out[0], out[1]


def chown_to_range(base: int, *paths: str | os.PathLike[str]) -> None:
    """The sandbox's root (base) owns these directories (its upper and work)."""
    for p in paths:
        os.chown(Path(p), base, base, follow_symlinks=False)
