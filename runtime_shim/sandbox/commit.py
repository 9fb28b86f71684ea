"""Commit: turn a sandbox's upper directory into a new layer and tag a new environment = the
sandbox's layers plus that one (pause here, resume anywhere).

The upper holds exactly what overlayfs (redirect_dir, metacopy and index off; see `overlay`)
writes: whole copied-up or new files, whiteouts (chr 0/0) for deletions and opaque directories
(trusted.overlay.opaque=y). Those are layer semantics already, so the layer is built from the upper
as it is; only overlayfs's private bookkeeping xattrs (origin, impure, ...) are dropped, and the
owners of a sandbox with a user namespace are mapped back to its own ids (`idmap`).

The sandbox may still run, and may be hostile: everything in its upper is its to change at any
moment, to a symlink to a host directory, a FIFO or a device node in particular. So a commit
(1) freezes it first: every backend that keeps a workload for the sandbox is asked to `pause` it
(the container backend: the cgroup freezer) for the whole read, and resumes it afterwards; a
workload that runs and cannot be frozen refuses the commit; and (2) reads the upper as an
untrusted tree whatever (`erofs_builder.sources.source_dir.untrusted_entries` with `layerstore.linux`'s
openat2): no symlink is ever followed, nothing but a regular file checked to be the inode the walk
saw is ever opened, no device node but a whiteout is taken, so a writer the freezer does not
reach (a process outside the sandbox's cgroup writing to a caller's upper) gets the commit
refused (`BadInput`, "changed while the tree was read") instead of host files into the layer or
a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerstore.errors import LayerstoreError, NotFound
from layerstore.store import Store

from ..backends.base import SandboxBackend
from ..errors import ShimError
from ..nodestate.idmap import to_layer_ids
from ..nodestate.state import Sandbox

if TYPE_CHECKING:
    from erofs_builder.workflow import LayerSource

OVERLAY_XATTR = b"trusted.overlay."
OPAQUE = b"trusted.overlay.opaque"


@dataclass
class CommitResult:
    sandbox: str
    manifest: str
    layer: str
    tag: str
    size: int
    files: int
    frozen: tuple[str, ...] = ()  # the backends whose workload of the sandbox was frozen meanwhile

    def to_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "layer": self.layer, "tag": self.tag, "frozen": list(self.frozen)}


def layer_entries(entries: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
    """Keep the layer-meaningful overlay xattr (opaque = y) and drop overlayfs's bookkeeping."""
    for entry, data in entries:
        xattrs = entry.xattrs
        if any(k.startswith(OVERLAY_XATTR) for k in xattrs):
            keep = {k: v for k, v in xattrs.items() if not k.startswith(OVERLAY_XATTR)}
            if xattrs.get(OPAQUE) == b"y":
                keep[OPAQUE] = b"y"
            entry.xattrs = keep
        yield entry, data


def unmapped_entries(entries: Iterable[tuple[Any, Any]], base: int) -> Iterator[tuple[Any, Any]]:
    """The upper of a sandbox with a user namespace holds host ids base..base+65535: the layer
    records them as the sandbox saw them (minus base), so that the layer is the one the same tree
    gives without a user namespace. An id outside the range is refused (`BadInput`), except on
    whiteouts (chr 0/0): overlayfs makes them with its mounter's ids (host root) in either case."""
    for entry, data in entries:
        if getattr(entry, "hardlink", None):  # (a hard link carries no owner of its own)
            pass
        elif entry.kind.name == "CHR":  # (the untrusted walk takes no other device node)
            entry.uid = entry.gid = 0
        else:
            entry.uid, entry.gid = to_layer_ids(base, entry.uid, entry.gid, entry.path)
        yield entry, data


def committed_layers(old: Iterable[Any], new_blob: str, new_size: int, layer_cls: Any) -> tuple[Any, ...]:
    """The new environment's layers: the old ones, then the committed layer as the workspace.

    The manifest schema allows at most one workspace, on top. An existing workspace therefore
    becomes an ordinary lower layer (role "toolkit") under the new workspace; the stacking order,
    which is all the kernel sees, is unchanged."""
    old = list(old)
    if any(layer.blob == new_blob for layer in old):
        return tuple(old)  # the upper rebuilt a layer the environment already has: nothing new
    out = []
    for layer in old:
        role = "toolkit" if layer.role == "workspace" else layer.role
        out.append(layer_cls(layer.blob, layer.size, role))
    out.append(layer_cls(new_blob, new_size, "workspace"))
    return tuple(out)


@contextlib.contextmanager
def frozen(sandbox: str, backends: Iterable[SandboxBackend]) -> Iterator[list[str]]:
    """Every workload of the sandbox frozen for the duration (the backends that froze one are
    yielded, and resume it on the way out, also on failure). A workload that runs and cannot be
    frozen refuses: `ShimError`."""
    with contextlib.ExitStack() as thaw:
        froze = []
        for backend in backends:
            if not backend.has(sandbox):
                continue
            try:
                paused = backend.pause(sandbox)
            except (LayerstoreError, OSError) as e:  # the runtime failed or is gone: it may run on
                raise ShimError(f"sandbox {sandbox}: not committed while it may be writing: {e}") from None
            if paused:
                thaw.callback(backend.resume, sandbox)
                froze.append(backend.name)
        yield froze


def upper_source(upper: Path, userns: int | None = None) -> LayerSource:
    """A sandbox's upper as a layer source: walked as an untrusted tree (see the module's notes),
    overlayfs's bookkeeping xattrs dropped, owners mapped back to the sandbox's ids if it has a
    user namespace (`userns`: its range's base). Not refusable: a failure half-way is the
    commit's, so its chunks may be stored while it is built."""
    from erofs_builder.sources.source_dir import untrusted_entries
    from erofs_builder.workflow import LayerSource

    def entries(_progress: Any) -> Iterator[tuple[Any, Any]]:
        walked = layer_entries(untrusted_entries(upper))
        return walked if userns is None else unmapped_entries(walked, userns)

    return LayerSource(str(upper), entries, None, counts_input=False, refusable=False)


def guest_upper_source(sb: Sandbox, backends: Iterable[SandboxBackend]) -> LayerSource:
    """The upper of a sandbox whose guest composed its root, from the backend that owns it (its
    `upper_source`: the host never mounts or walks what a guest wrote; see backends.microvm)."""
    owner = next((b for b in backends if b.name == sb.backend), None)
    export = getattr(owner, "upper_source", None)
    if export is None:
        raise ShimError(f"sandbox {sb.id}: its backend {sb.backend!r} cannot hand its upper to a commit on this node")
    return export(sb)  # type: ignore[no-any-return]


def commit(store: Store, sb: Sandbox, tag: str, *, workdir: Path | None = None,
           backends: Iterable[SandboxBackend] = ()) -> CommitResult:
    """Build a layer from the sandbox's upper (its workloads in `backends` frozen meanwhile; for a
    sandbox composed in a guest, the upper its backend reads from its drive), push it, and tag the
    new environment `tag`."""
    from erofs_builder.workflow import Source, build_and_push
    from manifest import Layer, Manifest
    from manifest.environment import check_environment_tag, create_environment, load_manifest

    check_environment_tag(tag)
    if not sb.manifest:
        raise ShimError(f"sandbox {sb.id} was not started from a stored environment: nothing to commit onto")
    try:
        old = load_manifest(store, sb.manifest)
    except NotFound:
        raise NotFound(f"sandbox {sb.id}: its environment's manifest {sb.manifest} is no longer in the store (its "
                       "tag was removed and the garbage collector took it); commit needs it: keep a tag or a "
                       "lease (`layerctl lease create`) on environments whose sandboxes may be committed") from None
    with contextlib.ExitStack() as stack:
        if sb.backend:  # composed in a guest: its backend reads the upper (after the VM stopped)
            froze: list[str] = []
            layer = guest_upper_source(sb, backends)
        else:
            froze = stack.enter_context(frozen(sb.id, backends))
            layer = upper_source(Path(sb.upper), sb.userns)
        (res,) = build_and_push(Source([layer], None, False), store=store, workdir=workdir)
    built = res.layer
    layers = committed_layers(old.layers, built.blob, built.size, Layer)
    prefetch = {b: idx for b, idx in old.prefetch.items() if any(layer.blob == b for layer in layers)}
    annotations = dict(old.annotations)
    annotations["org.layerstore.committed-from"] = sb.manifest
    m = Manifest(layers=layers, config=old.config, prefetch=prefetch, annotations=annotations)
    created = create_environment(store, m, tag)
    return CommitResult(sb.id, created.manifest, built.blob, tag, built.size, built.files, tuple(froze))
