"""The container backend of the runtime shim: mount, check and unmount a sandbox's root
filesystem on this node, with the picture persisted (`state`) and rebuilt by `recover()`.

A sandbox = a private upper + work directory + an overlay of the environment's layers, each of
which is a shared, reference-counted EROFS mount (`layers`). Every state change happens under
the node lock; see docs/runtime-shim.md for the order of steps and what a crash at each leaves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import mountinfo, records
from .blobs import BlobSource, DaemonBlobs
from .daemon import DaemonCommand, default_command
from .environment import EnvSpec
from .errors import SandboxExists, SandboxNotFound
from .layers import LayerMounts
from .lock import NodeLock
from .overlay import detach, mount_overlay, rmdir_quiet
from .paths import NodePaths, check_overlay_safe, check_sandbox_id, new_sandbox_id
from .state import BROKEN, MOUNTED, MOUNTING, UNMOUNTING, NodeState, Sandbox  # noqa: F401

Resolver = Callable[[str], EnvSpec]


@dataclass
class SandboxHealth:
    sandbox: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Shim:
    """One node's shim. Construct with `Shim.for_node(...)` (daemon-served blobs) or directly
    with any `BlobSource`. Recovery runs when it starts unless `auto_recover=False`."""

    def __init__(self, paths: NodePaths, blobs: BlobSource, *, resolver: Resolver | None = None,
                 store_url: str = "", state: NodeState | None = None, auto_recover: bool = True) -> None:
        self.paths = paths
        paths.create()
        self.state = state or NodeState(paths.state)
        self.lock = NodeLock(paths.lock)
        self.blobs = blobs
        self.layers = LayerMounts(paths, blobs)
        self.resolver = resolver
        self.store_url = store_url
        if auto_recover:
            self.recover()

    @classmethod
    def for_node(cls, node_dir: str | os.PathLike[str] | None = None, store_url: str | None = None, *,
                 daemon_command: DaemonCommand = default_command, auto_recover: bool = True,
                 policy: str | os.PathLike[str] | None = None) -> Shim:
        """The production shim: blobs from the node daemon, environments from the store. Without
        an explicit store the running daemon's store is used, else the default store. The trust
        policy is `policy`, else $LAYERSTORE_TRUST_POLICY, else NODE/policy.json when the node has one, else none."""
        from layerstore.config import resolve_store_url
        from layerstore.store import Store

        from .environment import load_policy, read_policy, resolve

        paths = NodePaths.resolve(node_dir)
        paths.create()
        node_policy = paths.root / "policy.json"
        trust = load_policy(policy) or (read_policy(node_policy) if node_policy.exists() else None)
        state = NodeState(paths.state)
        if store_url is None:
            with state.read() as t:
                rec = t.daemon()
            store_url = rec.store if rec is not None else resolve_store_url(None)
        store = Store.open(store_url)
        url = store.url
        store.close()

        def resolver(ref: str) -> EnvSpec:
            with Store.open(url) as s:
                s.check()
                return resolve(s, ref, trust)

        blobs = DaemonBlobs(paths, state, url, daemon_command)
        return cls(paths, blobs, resolver=resolver, store_url=url, state=state, auto_recover=auto_recover)

    def close(self) -> None:
        self.state.close()

    def __enter__(self) -> Shim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries -------------------------------------------------------------------------
    def sandboxes(self) -> list[Sandbox]:
        with self.state.read() as t:
            return t.sandboxes()

    def find(self, sandbox_or_target: str) -> Sandbox:
        with self.state.read() as t:
            sb = None
            with contextlib.suppress(Exception):
                sb = t.sandbox(check_sandbox_id(sandbox_or_target))
            if sb is None:
                sb = t.sandbox_at(os.path.abspath(sandbox_or_target))
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_or_target!r} on node {self.paths.root}")
        return sb

    def layer_refs(self) -> dict[str, int]:
        with self.state.read() as t:
            return {lm.blob: lm.refs for lm in t.layers()}

    def check(self, sandbox_or_target: str) -> SandboxHealth:
        """Is the sandbox's root mounted, over live layer mounts of the current generation?"""
        sb = self.find(sandbox_or_target)
        health = SandboxHealth(sb.id)
        mounts = mountinfo.read()
        if sb.status != MOUNTED:
            health.problems.append(f"status {sb.status}{': ' + sb.error if sb.error else ''}")
        m = mounts.get(sb.target)
        if m is None or m.fstype != "overlay":
            health.problems.append(f"root {sb.target} is not mounted")
        gen = self.blobs.generation()
        if gen is None:
            health.problems.append("the blob source (node daemon) is not healthy")
        with self.state.read() as t:
            for blob in sb.layers:
                lm = t.layer(blob)
                if lm is None or (mounts.get(lm.mountpoint) is None):
                    health.problems.append(f"layer {blob} is not mounted")
                elif gen is not None and lm.generation != gen:
                    health.problems.append(f"layer {blob} reads from a previous daemon")
        return health

    # -- mount -----------------------------------------------------------------------------
    def resolve(self, env: str | EnvSpec) -> EnvSpec:
        if isinstance(env, EnvSpec):
            return env
        if self.resolver is None:
            raise SandboxNotFound("this shim has no store to resolve environments from")
        return self.resolver(env)

    def mount(self, env: str | EnvSpec, target: str | os.PathLike[str] | None = None, *,
              sandbox: str | None = None, upper: str | os.PathLike[str] | None = None,
              eager: bool = False) -> Sandbox:
        """Compose a sandbox's root at `target` (default NODE/sandboxes/<id>/rootfs).

        A new sandbox gets a fresh upper under the node directory; an id whose directory already
        exists is refused unless `upper` is passed explicitly (resume). An explicit upper is the
        caller's: it is never deleted, and it is refused while another sandbox uses it."""
        spec = self.resolve(env)  # trust policy and store reads happen before anything is mounted
        sid = check_sandbox_id(sandbox) if sandbox else new_sandbox_id()
        if eager:
            with self.lock:
                self.blobs.ensure()
            for blob in spec.blobs:  # outside the lock: other sandboxes keep mounting meanwhile
                self.blobs.fetch_all(blob)
        with self.lock:
            gen = self.blobs.ensure()
            with self.state.read() as t:
                stale = any(lm.generation != gen for lm in t.layers())
            if stale:
                self._recover_locked()
            return self._mount_locked(spec, target, sid, upper, gen)

    def _mount_locked(self, spec: EnvSpec, target: str | os.PathLike[str] | None, sid: str,
                      upper: str | os.PathLike[str] | None, gen: str) -> Sandbox:
        sdir = self.paths.sandbox_dir(sid)
        with self.state.read() as t:
            if t.sandbox(sid) is not None:
                raise SandboxExists(f"sandbox {sid} already exists on node {self.paths.root}")
            tgt = os.path.abspath(target) if target is not None else str(self.paths.rootfs(sid))
            other = t.sandbox_at(tgt)
            if other is not None:
                raise SandboxExists(f"{tgt} is already the root of sandbox {other.id}")
            if upper is not None:
                up = os.path.abspath(upper)
                for sb in t.sandboxes():
                    if sb.upper == up:
                        raise SandboxExists(f"upper {up} is in use by sandbox {sb.id}")
        created: list[Path] = []
        if upper is None:
            try:
                sdir.mkdir(mode=0o700)
            except FileExistsError:
                raise SandboxExists(f"sandbox {sid} has data on this node ({sdir}); pass its upper "
                                    f"({sdir / 'upper'}) explicitly to resume it, or remove it") from None
            created.append(sdir)
            up, work, owned = str(sdir / "upper"), str(sdir / "work"), True
            os.mkdir(up, 0o755)
            os.mkdir(work, 0o700)
        else:
            check_overlay_safe(up, "upper directory")
            if not sdir.exists():
                sdir.mkdir(mode=0o700)
                created.append(sdir)
            Path(up).mkdir(mode=0o755, parents=True, exist_ok=True)
            work = str(self._work_for(Path(up), sdir))
            Path(work).mkdir(mode=0o700, exist_ok=True)
            owned = False
        Path(tgt).mkdir(mode=0o755, parents=True, exist_ok=True)
        # The status records what should be: recovery compares it with what is mounted, so the
        # sandbox and its layer references are committed once, before the overlay is mounted.
        sb = Sandbox(id=sid, env=spec.ref, manifest=spec.manifest, layers=spec.blobs, config=dict(spec.config),
                     target=tgt, upper=up, work=work, owned=owned, store=self.store_url, status=MOUNTED,
                     created=time.time())
        try:
            records.save(self.paths, sb)
            with self.state.write() as t:
                t.put_sandbox(sb)
                lms = self.layers.acquire_all(t, sb.layers, gen)
            mount_overlay(tgt, [lm.mountpoint for lm in reversed(lms)], up, work)
        except BaseException:
            with contextlib.suppress(Exception):
                self._teardown(sb, mounted=False)
            for d in created:
                shutil.rmtree(d, ignore_errors=True)
            raise
        return sb

    def _work_for(self, upper: Path, sdir: Path) -> Path:
        # overlayfs wants work on the upper's filesystem: beside the sandbox when that is the same
        # filesystem, else next to the caller's upper.
        if os.stat(upper).st_dev == os.stat(sdir).st_dev:
            return sdir / "work"
        return upper.parent / f".{upper.name}.work"

    # -- unmount ---------------------------------------------------------------------------
    def unmount(self, sandbox_or_target: str) -> Sandbox:
        """Tear a sandbox down: unmount its root, release its layers (the last user unmounts a
        layer), delete the upper and work the shim created. An explicit upper is kept."""
        with self.lock:
            sb = self.find(sandbox_or_target)
            self._teardown(sb)
            return sb

    def _teardown(self, sb: Sandbox, *, mounted: bool = True) -> None:
        """Order matters for recovery: detach the root, then mark the sandbox gone on disk (an
        owned sandbox's directory is renamed into the trash, which recovery reads as "finish this
        teardown"; a caller's upper cannot move, so that sandbox is marked `unmounting` in the
        state first), then drop the record and the layer references in one transaction."""
        if not sb.owned:
            with self.state.write() as t:
                if t.sandbox(sb.id) is not None:
                    sb.status = UNMOUNTING
                    t.put_sandbox(sb)
        if mounted:
            detach(sb.target)
        sdir = self.paths.sandbox_dir(sb.id)
        trashed = None
        if sb.owned:
            trashed = records.trash(self.paths, sb.id)
        else:
            with contextlib.suppress(FileNotFoundError):
                (sdir / records.RECORD).unlink()
        with self.state.write() as t:
            if t.sandbox(sb.id) is not None:
                for blob in sb.layers:
                    self.layers.release(t, blob)
                t.delete_sandbox(sb.id)
        if sb.owned:
            if trashed is not None:
                shutil.rmtree(trashed, ignore_errors=True)
        else:
            shutil.rmtree(sb.work, ignore_errors=True)
            shutil.rmtree(sdir / "bundle", ignore_errors=True)
            rmdir_quiet(sdir / "rootfs")
            rmdir_quiet(sdir)

    # -- recovery --------------------------------------------------------------------------
    def stop_daemon(self) -> bool:
        """Stop the node daemon (before an upgrade, or to free the node). Refused while sandboxes
        are mounted: their layers read through it. Returns False if this node has no daemon."""
        with self.lock:
            if self.sandboxes():
                raise SandboxExists(f"{len(self.sandboxes())} sandbox(es) still mounted on node {self.paths.root}; "
                                    f"remove them first (layerctl sandbox ls)")
            stop = getattr(self.blobs, "stop", None)
            if stop is None or self.blobs.generation() is None:
                return False
            stop()
            return True

    def recover(self) -> RecoverReport:
        with self.lock:
            return self._recover_locked()

    def _recover_locked(self) -> RecoverReport:
        from .recover import recover

        return recover(self)


from .recover import RecoverReport  # noqa: E402  (recover imports Shim's pieces lazily)

__all__ = ["Shim", "SandboxHealth", "RecoverReport", "MOUNTED", "MOUNTING", "UNMOUNTING", "BROKEN"]
