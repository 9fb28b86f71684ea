"""The end of a sandbox's life on this node, and the roots mount, as one object that the shim (on
the path of one mount or teardown) and recovery (after a crash) both call: `SandboxLifecycle`.

- the roots mount: NODE/roots is a private bind mount of itself while the node has sandboxes, so
  that default roots are children of that mount and not of the uppers' (see "Why NODE/roots" in
  docs/shim-scale.md): `ensure_roots`, `release_roots`, `under_roots`;
- undoing a mount that did not complete (`undo_mount`), on failure or after a crash;
- a teardown in its steps (`begin_teardown` under the lock, `detach_root` outside it,
  `end_teardown` under it), or all at once under the lock the caller holds (`teardown`);
- `forget`: the one transaction that drops a sandbox, its layer references and its pending entry.

Every step costs O(the sandbox's layers): no mount table is read and no other sandbox is looked
at. Containers (or VMs) are not this object's: their backends are (`backends`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from layerstore import linux
from layerstore.fileio import rmdir_quiet
from layerstore.linux import detach

from ..errors import SandboxExists, SandboxNotFound
from ..nodestate import records, utab
from ..nodestate.lock import NodeLock
from ..nodestate.paths import NodePaths
from ..nodestate.state import MOUNTING, UNMOUNTING, NodeState, Sandbox, owner_alive
from .layers import LayerMounts


class SandboxLifecycle:
    """Constructed with what the steps touch: the node's paths, its state, its lock and its layer
    mounts. Methods say whether their caller holds the node lock; `undo_mount` takes it itself."""

    def __init__(self, paths: NodePaths, state: NodeState, lock: NodeLock, layers: LayerMounts) -> None:
        self.paths = paths
        self.state = state
        self.lock = lock
        self.layers = layers

    # -- the roots mount ----------------------------------------------------------------------
    # mount(2) of an overlay clones the mount its upper directory is on (clone_private_mount), and
    # the kernel walks every child mount of that mount while doing so (has_locked_children ->
    # is_subdir): with the roots mounted beside the uppers, each mount costs O(sandboxes) in the
    # kernel (measured: 0.15 ms at 1,000, 0.77 ms at 10,000). Default roots therefore live under
    # NODE/roots, a bind mount of itself: they are children of that mount, not of the uppers'.
    # It is private, so that a root does not propagate to peers of the node directory's mount
    # (nor back onto NODE/roots underneath). It exists while the node has sandboxes.
    def under_roots(self, target: str) -> bool:
        """Is `target` a default root (NODE/roots/<id>)?"""
        return os.path.dirname(target) == str(self.paths.roots)

    # The state records that the mount is made (`meta/roots`, written after the mount, dropped
    # before its removal, both under the lock), so that a mount need not ask the kernel each time
    # (`Txn.roots_mounted`; two mount-id lookups, ~50 us). A crash between the mount and the record
    # leaves the mount unrecorded: the next `ensure_roots` finds it and records it. The record
    # goes with the database after a reboot (the mount too); the start-up check compares it with
    # the kernel (`roots_consistent`), so a bind mount removed behind the shim's back is made again.
    def ensure_roots(self) -> None:
        """Caller holds the lock. Make the NODE/roots bind mount unless it is there."""
        roots = self.paths.roots
        roots.mkdir(mode=0o700, exist_ok=True)
        if not linux.is_mount_root(roots):
            linux.bind_private(roots)
        with self.state.write() as t:
            t.put_roots_mounted(True)

    def release_roots(self) -> None:
        """Caller holds the lock; the node has no sandbox left."""
        with self.state.write() as t:
            t.put_roots_mounted(False)
        if linux.is_mount_root(self.paths.roots):
            with contextlib.suppress(linux.MountError):
                linux.umount(self.paths.roots, lazy=True)

    def roots_consistent(self) -> bool:
        """Caller holds the lock. Does the state's record of the NODE/roots mount match the kernel?
        (O(1); the start-up check asks.)"""
        with self.state.read() as t:
            recorded = t.roots_mounted()
        return not recorded or linux.is_mount_root(self.paths.roots)

    def clear_layers(self) -> list[str]:
        """Caller holds the lock; the node has no sandbox (`Shim.stop_daemon`). Unmount every
        layer mount under NODE/layers, recorded or not (one stacked on a dead daemon's FUSE
        mount, one a crash left), and forget the records. Returns the mountpoints taken down."""
        with self.state.read() as t:
            recs = t.layers()
        done = []
        for lm in recs:
            if linux.is_mount(lm.mountpoint):
                done.append(lm.mountpoint)
            self.layers.unmount(lm)  # (and its pin or attachment)
        for m in linux.mounts_under(linux.read_mounts(), str(self.paths.layers)):
            if m.mountpoint != str(self.paths.layers) and detach(m.mountpoint):
                rmdir_quiet(m.mountpoint)
                done.append(m.mountpoint)
        with self.state.write() as t:
            for lm in recs:
                t.delete_layer(lm.blob)
        return sorted(set(done))

    # -- a mount that did not complete ----------------------------------------------------------
    def undo_mount(self, sb: Sandbox, *, overlay: bool, created_dir: bool) -> None:
        """Take back a mount that did not complete (on failure, or in recovery after a crash):
        the overlay is detached if `overlay`, the sandbox directory removed if this mount created
        it (`created_dir`), and its layer references released (the last one unmounts the layer);
        the caller's upper is never touched. Takes the lock (reentrant: recovery holds it)."""
        with self.lock:
            if sb.utab:
                with contextlib.suppress(OSError):
                    utab.remove(sb.target)
            if overlay:
                detach(sb.target)
            detach(self.paths.scratch(sb.id))  # (an upper's size-limited tmpfs or image, if it has one)
            if sb.target == str(self.paths.rootfs(sb.id)):
                rmdir_quiet(sb.target)
            sdir = self.paths.sandbox_dir(sb.id)
            if sb.owned and created_dir:
                trashed = records.trash(self.paths, sb.id)
                if trashed is not None:
                    shutil.rmtree(trashed, ignore_errors=True)
            elif not sb.owned:
                records.remove(self.paths, sb.id)
                shutil.rmtree(sb.work, ignore_errors=True)
                if created_dir:
                    rmdir_quiet(sdir / "rootfs")
                    rmdir_quiet(sdir)
            self.forget(sb.id, only=MOUNTING)

    def forget(self, sid: str, only: str | None = None) -> None:
        """Caller holds the lock. One transaction: the sandbox's record (only in status `only`, if
        given) with its layer references (a layer left with none is unmounted), and its pending
        entry; the last sandbox out removes the NODE/roots bind mount."""
        with self.state.write() as t:
            cur = t.sandbox(sid)
            if cur is not None and (only is None or cur.status == only):
                for blob in cur.layers:
                    self.layers.release(t, blob)
                t.delete_sandbox(sid)
            t.clear_pending(sid)
            last = t.count("sandboxes") == 0
        if last:
            self.release_roots()

    # -- teardown --------------------------------------------------------------------------------
    def begin_teardown(self, sb: Sandbox, *, force: bool = False) -> Sandbox:
        """Caller holds the lock. A `pending` unmount (from here on, a crash is finished by
        recovery) and the status `unmounting`. Refused while another live process tears the
        same sandbox down (unless `force`: recovery, settling a dead one's). Returns the sandbox
        as recorded."""
        with self.state.write() as t:
            cur = t.sandbox(sb.id)
            if cur is None:
                if force:
                    return sb
                raise SandboxNotFound(f"no sandbox {sb.id!r} on node {self.paths.root}")
            busy = t.pending().get(sb.id) if t.count("pending") else None
            if busy is not None and not force and owner_alive(busy):
                raise SandboxExists(f"sandbox {sb.id} is being {busy.get('op')}ed by process {busy.get('pid')}")
            cur.status = UNMOUNTING
            t.put_sandbox(cur, old=cur)
            t.put_pending(sb.id, "unmount")
            return cur

    def detach_root(self, sb: Sandbox) -> None:
        """Detach the sandbox's root (lazily if busy). Called without the lock by a teardown:
        unmounting an overlay syncs its upper's filesystem, which concurrent teardowns share.
        Then the upper's size-limited tmpfs or loop-mounted image, if it has one (O(1): EINVAL
        when there is none; the image's loop device is autocleared when its filesystem goes)."""
        detach(sb.target)
        detach(self.paths.scratch(sb.id))

    def end_teardown(self, sb: Sandbox) -> Path | None:
        """Caller holds the lock; the root is detached. Move an owned sandbox's directory to the
        trash (its record goes with it) or delete a caller-upper sandbox's record, then drop
        the record and the layer references in one transaction. Returns the trashed directory,
        for the caller to delete without the lock."""
        detach(sb.target)  # (again: a no-op unless something was mounted there meanwhile)
        if sb.target == str(self.paths.rootfs(sb.id)):
            rmdir_quiet(sb.target)
        if sb.utab:
            with contextlib.suppress(OSError):
                utab.remove(sb.target)
        sdir = self.paths.sandbox_dir(sb.id)
        trashed = None
        if sb.owned:
            trashed = records.trash(self.paths, sb.id)
        else:
            records.remove(self.paths, sb.id)
        self.forget(sb.id)
        if not sb.owned:
            shutil.rmtree(sb.work, ignore_errors=True)
            shutil.rmtree(sdir / "bundle", ignore_errors=True)
            rmdir_quiet(sdir / "rootfs")
            rmdir_quiet(sdir)
        return trashed

    def teardown(self, sb: Sandbox) -> Path | None:
        """All of a teardown, under the lock the caller holds (recovery finishing a dead
        process's). Returns the trashed directory, for the caller to delete."""
        self.begin_teardown(sb, force=True)
        self.detach_root(sb)
        return self.end_teardown(sb)
