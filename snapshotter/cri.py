"""The CRI pull path: which layers containerd's CRI plugin Prepares are layerstore pointers.

The kubelet pulls through containerd's CRI plugin, which labels each layer's Prepare with the image
reference it resolved (`cri.image-ref`), the layer's descriptor digest (`cri.layer-digest`) and the
digests of the layers from it up (`cri.image-layers`), but not the descriptor's own annotations.
So the snapshotter reads the image's manifest itself, from the registry the reference names, with
the node's registry credentials and the same code as `layerctl ctr pull` (`manifests.read_manifest`),
and turns a pointer layer into the labels of our remote-layer protocol (`layerstore.blob`,
`layerstore.environment`); the trust policy and the prefetch hints then apply exactly as for
`layerctl ctr pull` (`Snapshotter._prepare_remote`). docs/snapshotter.md, "The CRI pull path".

A descriptor digest names a pointer's bytes, which name the blob: the digest -> blob map never goes
stale, and is kept (bounded) so one image costs one manifest read per snapshotter process. The
manifest is read inside containerd's Prepare, which containerd 1.6 serialises with every other
metadata write of the node: one registry client per host is kept (a few minutes: credentials may
change) and the client code is loaded at start (`prewarm`), so a read costs a round trip, not a
client's set-up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from erofs_builder.sources.registry import Reference, RegistryClient
from layerstore.errors import BadInput, LayerstoreError

from .image import pointer_layers
from .manifests import read_manifest

LABEL_CRI_REF = "containerd.io/snapshot/cri.image-ref"
LABEL_CRI_DIGEST = "containerd.io/snapshot/cri.layer-digest"
LABEL_CRI_LAYERS = "containerd.io/snapshot/cri.image-layers"
MAX_KNOWN = 4096
CLIENT_TTL = 300.0  # seconds a registry client is reused (it read the node's credentials when made)
log = logging.getLogger("layerstore.snapshotter")


@dataclass(frozen=True)
class Pointer:
    blob: str  # "" for an ordinary layer
    environment: str  # the manifest's environment annotation ("" if none)


class CriPointers:
    """Layer descriptor digest -> Pointer, learnt from the manifests the CRI labels name.
    `open_registry`: a RegistryClient for a registry host (the node's credentials by default)."""

    def __init__(self, open_registry: Callable[[str], RegistryClient] = RegistryClient) -> None:
        self.open_registry = open_registry
        self._mu = threading.Lock()
        self._known: OrderedDict[str, Pointer] = OrderedDict()
        self._clients: dict[str, tuple[RegistryClient, float, threading.Lock]] = {}  # host -> client, made, its lock
        self.manifests_read = 0

    def prewarm(self) -> None:
        """Load the registry client's code and TLS context now (at start, in the background), not
        in the first Prepare: a client made for nothing, no request sent."""
        with contextlib.suppress(LayerstoreError, OSError):
            RegistryClient("localhost").close()

    def close(self) -> None:
        with self._mu:
            clients, self._clients = list(self._clients.values()), {}
        for client, _made, _lock in clients:
            client.close()

    @contextlib.contextmanager
    def _client(self, host: str) -> Iterator[RegistryClient]:
        """The kept client of a registry host (one request at a time on it), made anew once old
        (the old one is left to the garbage collector: a reader may still hold it)."""
        now = time.monotonic()
        with self._mu:
            kept = self._clients.get(host)
            if kept is None or now - kept[1] > CLIENT_TTL:
                kept = self._clients[host] = (self.open_registry(host), now, threading.Lock())
        client, _made, lock = kept
        with lock:
            yield client

    def lookup(self, labels: dict[str, str]) -> Pointer | None:
        """The pointer behind a Prepare's CRI labels; None without CRI labels, or when the manifest
        cannot be read (the layer then takes containerd's ordinary path: an ordinary layer is
        fetched and unpacked, a pointer layer fails loudly in containerd's differ)."""
        ref, digest = labels.get(LABEL_CRI_REF, ""), labels.get(LABEL_CRI_DIGEST, "")
        if not ref or not digest:
            return None
        with self._mu:
            hit = self._known.get(digest)
        if hit is not None:
            return hit
        try:
            found = self._learn(ref, labels.get(LABEL_CRI_LAYERS, ""))
        except LayerstoreError as e:
            log.warning("CRI layer %s of %s: cannot read the image's manifest (%s); ordinary layer path",
                        digest, ref, e)
            return None
        if digest not in found:
            raise BadInput(f"layer {digest} is not in the manifest {ref} names now (was its tag moved?)")
        return found[digest]

    def _learn(self, ref: str, layers_label: str) -> dict[str, Pointer]:
        r = Reference.parse(ref)
        with self._client(r.registry) as reg:
            body, _media, _digest = read_manifest(reg, r)
        self.manifests_read += 1
        environment, layers = pointer_layers(body)
        if not _runs_in(list(layers), [d for d in layers_label.split(",") if d]):
            raise BadInput(f"the manifest {ref} names now does not have the layers containerd is pulling "
                           f"(was its tag moved?)")
        found = {d: Pointer(blob, environment if blob else "") for d, blob in layers.items()}
        with self._mu:
            for d, p in found.items():
                self._known[d] = p
                self._known.move_to_end(d)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)
        return found


def _runs_in(order: list[str], wanted: list[str]) -> bool:
    """Is `wanted` (the CRI's layer list from one layer up, perhaps cut short) a run of `order`?"""
    if not wanted:
        return True
    if wanted[0] not in order:
        return False
    i = order.index(wanted[0])
    return order[i:i + len(wanted)] == wanted
