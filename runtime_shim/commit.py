"""Commit: turn a sandbox's upper directory into a new layer and tag a new environment = the
sandbox's layers plus that one (pause here, resume anywhere).

The upper holds exactly what overlayfs (redirect_dir, metacopy and index off; see `overlay`)
writes: whole copied-up or new files, whiteouts (chr 0/0) for deletions and opaque directories
(trusted.overlay.opaque=y). Those are layer semantics already, so the layer is built from the upper
as it is; only overlayfs's private bookkeeping xattrs (origin, impure, ...) are dropped. Writers in
the sandbox should be stopped for a consistent commit: a file changing while it is read fails the
build instead of yielding a torn layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerstore.store import Store

from .errors import ShimError
from .state import Sandbox

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

    def to_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "layer": self.layer, "tag": self.tag}


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


def commit(store: Store, sb: Sandbox, tag: str, *, workdir: Path | None = None) -> CommitResult:
    from erofs_builder.workflow import Source, build_and_push, dir_layer
    from manifest import Layer, Manifest
    from manifest.environment import check_environment_tag, create_environment, load_manifest

    check_environment_tag(tag)
    if not sb.manifest:
        raise ShimError(f"sandbox {sb.id} was not started from a stored environment: nothing to commit onto")
    old = load_manifest(store, sb.manifest)
    # the upper is the sandbox's own tree, not an archive handed in: a failure half-way is the
    # commit's (a file changing under it), so its chunks may be stored while it is built
    upper = dir_layer(Path(sb.upper), transform=layer_entries, refusable=False)
    (res,) = build_and_push(Source([upper], None, False), store=store, workdir=workdir)
    built = res.layer
    layers = committed_layers(old.layers, built.blob, built.size, Layer)
    prefetch = {b: idx for b, idx in old.prefetch.items() if any(layer.blob == b for layer in layers)}
    annotations = dict(old.annotations)
    annotations["org.layerstore.committed-from"] = sb.manifest
    m = Manifest(layers=layers, config=old.config, prefetch=prefetch, annotations=annotations)
    created = create_environment(store, m, tag)
    return CommitResult(sb.id, created.manifest, built.blob, tag, built.size, built.files)
