"""The composed view of stacked layers, as overlayfs shows it (pure).

Layers are given bottom (base) first. For every path the topmost layer that has it wins; a
whiteout (a character device 0:0) hides the path in every layer below; a directory merges with
the same directory of the layers below until one of them is opaque (xattr
`trusted.overlay.opaque` = "y"), or a layer below has a whiteout or a non-directory there (which
ends the merge, as overlayfs's lookup stops there). A directory's own metadata comes from its
topmost layer. `trusted.overlay.*` xattrs are the overlay's own and are not part of the view
(overlayfs hides them too): a flattened image is itself used as an overlay lower, where they
would mean something again.

Hard links stay hard links when their layer's inode wins at every visible name: a composed
entry's `identity` is (layer, nid), and the names that share one are the links; the count of
visible names is the link count of the flattened inode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .erofs.read import LayerImage, Node
from .tree import Kind

OPAQUE = b"trusted.overlay.opaque"
OVERLAY_PREFIX = b"trusted.overlay."


@dataclass(frozen=True, slots=True)
class Composed:
    path: bytes
    layer: int  # index into the layers, bottom first
    node: Node

    @property
    def identity(self) -> tuple[int, int]:
        return self.layer, self.node.nid

    @property
    def xattrs(self) -> dict[bytes, bytes]:
        return {k: v for k, v in self.node.xattrs if not k.startswith(OVERLAY_PREFIX)}


@dataclass(slots=True)
class _Dir:
    layers: list[int] = field(default_factory=list)  # top first
    closed: bool = False


def is_whiteout(node: Node) -> bool:
    return node.kind is Kind.CHR and node.rdev == (0, 0)


def is_opaque(node: Node) -> bool:
    return node.kind is Kind.DIR and dict(node.xattrs).get(OPAQUE) == b"y"


def compose(layers: Sequence[LayerImage]) -> list[Composed]:
    """Every visible path, parents before children, names sorted bytewise; the root first."""
    if not layers:
        return []
    root = _Dir()
    for li in reversed(range(len(layers))):
        root.layers.append(li)
        if is_opaque(layers[li].nodes[b""]):
            break
    out = [Composed(b"", root.layers[0], layers[root.layers[0]].nodes[b""])]
    stack: list[tuple[bytes, _Dir]] = [(b"", root)]
    while stack:
        path, d = stack.pop()
        entries: dict[bytes, _Dir | Composed | None] = {}
        prefix = path + b"/" if path else b""
        for li in d.layers:
            layer = layers[li]
            for name in layer.children.get(path, ()):
                cpath = prefix + name
                node = layer.nodes[cpath]
                cur = entries.get(name, _MISSING)
                if cur is _MISSING:
                    if is_whiteout(node):
                        entries[name] = None
                    elif node.kind is Kind.DIR:
                        entries[name] = _Dir([li], is_opaque(node))
                    else:
                        entries[name] = Composed(cpath, li, node)
                elif isinstance(cur, _Dir) and not cur.closed:
                    if node.kind is Kind.DIR:
                        cur.layers.append(li)
                        cur.closed = is_opaque(node)
                    else:  # a whiteout or a file below a directory: nothing further down shows
                        cur.closed = True
        subdirs = []
        for name in sorted(entries):
            e = entries[name]
            if e is None:
                continue
            if isinstance(e, _Dir):
                cpath = prefix + name
                top = e.layers[0]
                out.append(Composed(cpath, top, layers[top].nodes[cpath]))
                subdirs.append((cpath, e))
            else:
                assert isinstance(e, Composed)
                out.append(e)
        stack.extend(reversed(subdirs))
    return out


_MISSING = _Dir()  # a sentinel no entry ever is


def link_counts(view: Sequence[Composed]) -> dict[tuple[int, int], int]:
    """Visible names per non-directory inode identity."""
    counts: dict[tuple[int, int], int] = {}
    for e in view:
        if e.node.kind is not Kind.DIR:
            counts[e.identity] = counts.get(e.identity, 0) + 1
    return counts
