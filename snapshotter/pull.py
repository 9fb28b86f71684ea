"""`layerctl ctr pull REF`: an image from a registry into containerd, unpacked into a snapshotter.

Layers annotated with a layerstore blob are not downloaded: the snapshotter is asked to Prepare the
layer's chain id with the labels of containerd's remote-snapshot protocol (docs/snapshotter.md),
and mounts the blob lazily. Other layers are fetched (verified by the registry client), written to
containerd's content store, unpacked by containerd's differ into a prepared snapshot and committed.
Everything is written under one containerd lease (it expires on its own if the pull dies), and the
content records carry the garbage-collection labels that keep the manifest, config and snapshot
chain alive once the image names them.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import tempfile
from dataclasses import dataclass, field

from erofs_builder.sources.registry import Reference, RegistryClient
from layerstore.errors import BadInput, LayerstoreError

from .client import ContainerdClient, Descriptor
from .errors import SnapshotExists
from .image import ANNOTATION_ENV, MAX_CONFIG, OCI_MANIFEST, Layer, image_layers
from .manifests import read_manifest
from .snapshots import LABEL_BLOB, LABEL_ENV, LABEL_REF

GC_SNAPSHOT = "containerd.io/gc.ref.snapshot."
GC_CONFIG = "containerd.io/gc.ref.content.config"
GC_LAYER = "containerd.io/gc.ref.content.l."
MAX_LAYER = 64 << 30


@dataclass
class PullReport:
    image: str
    manifest: str
    remote_layers: list[str] = field(default_factory=list)  # chain ids mounted from layerstore blobs
    unpacked_layers: list[str] = field(default_factory=list)  # chain ids unpacked by containerd
    present_layers: list[str] = field(default_factory=list)  # chain ids that were there already
    bytes_fetched: int = 0  # from the registry

    def to_json(self) -> dict[str, object]:
        return {"image": self.image, "manifest": self.manifest, "remote_layers": self.remote_layers,
                "unpacked_layers": self.unpacked_layers, "present_layers": self.present_layers,
                "bytes_fetched": self.bytes_fetched}


def _blob(reg: RegistryClient, repo: str, digest: str, limit: int) -> bytes:
    buf = io.BytesIO()
    reg.fetch_blob(repo, digest, buf, max_size=limit, expected_size=limit)
    return buf.getvalue()


def pull(ref: str, ctd: ContainerdClient, snapshotter: str = "layerstore", *, name: str | None = None,
         registry: RegistryClient | None = None) -> PullReport:
    r = Reference.parse(ref)
    with contextlib.ExitStack() as stack:
        reg = registry or stack.enter_context(RegistryClient(r.registry))
        body, media, digest = read_manifest(reg, r)
        manifest = json.loads(body)
        environment = str((manifest.get("annotations") or {}).get(ANNOTATION_ENV, ""))
        cfg_desc = manifest.get("config") or {}
        if not isinstance(cfg_desc.get("digest"), str) or not isinstance(cfg_desc.get("size"), int):
            raise BadInput(f"{ref}: the manifest has no config descriptor")
        if cfg_desc["size"] > MAX_CONFIG:
            raise BadInput(f"{ref}: image config of {cfg_desc['size']} bytes is over {MAX_CONFIG}")
        config = _blob(reg, r.repository, cfg_desc["digest"], cfg_desc["size"])
        cfg_desc, layers = image_layers(body, config)
        report = PullReport(name or ref, digest, bytes_fetched=len(body) + len(config))
        with ctd.leased():
            stored: list[Layer] = []
            parent = ""
            for layer in layers:
                if ctd.stat(snapshotter, layer.chain_id):
                    report.present_layers.append(layer.chain_id)
                elif layer.blob:
                    _remote(ctd, snapshotter, layer, parent, environment)
                    report.remote_layers.append(layer.chain_id)
                else:
                    report.bytes_fetched += _unpack(ctd, reg, r.repository, snapshotter, layer, parent)
                    report.unpacked_layers.append(layer.chain_id)
                if not layer.blob:
                    stored.append(layer)
                parent = layer.chain_id
            top = layers[-1].chain_id if layers else ""
            ctd.write_content(cfg_desc["digest"], cfg_desc["size"], config,
                              {GC_SNAPSHOT + snapshotter: top} if top else {})
            mlabels = {GC_CONFIG: cfg_desc["digest"]}
            for i, layer in enumerate(layers):
                if not layer.blob:  # (remote layers' pointers are not in the content store)
                    mlabels[f"{GC_LAYER}{i}"] = str(layer.descriptor["digest"])
            ctd.write_content(digest, len(body), body, mlabels)
            ctd.put_image(name or ref, Descriptor(media or OCI_MANIFEST, digest, len(body)))
    return report


def _remote(ctd: ContainerdClient, snapshotter: str, layer: Layer, parent: str, environment: str) -> None:
    key = f"extract-{secrets.token_hex(6)} {layer.chain_id}"
    labels = {LABEL_REF: layer.chain_id, LABEL_BLOB: layer.blob}
    if environment:
        labels[LABEL_ENV] = environment
    try:
        ctd.prepare(snapshotter, key, parent, labels)
    except SnapshotExists:
        return  # the snapshotter mounted the blob and committed the chain id: nothing to download
    with contextlib.suppress(LayerstoreError):
        ctd.remove(snapshotter, key)
    raise BadInput(f"snapshotter {snapshotter!r} did not take layerstore blob {layer.blob} as a remote layer "
                   f"(is it layerstore's snapshotter, serving a node with a store?)")


def _unpack(ctd: ContainerdClient, reg: RegistryClient, repo: str, snapshotter: str, layer: Layer,
            parent: str) -> int:
    d = layer.descriptor
    desc = Descriptor(str(d.get("mediaType", "")), str(d["digest"]), int(d["size"]))
    fetched = 0
    if ctd.content_info(desc.digest) is None:
        with tempfile.TemporaryFile() as f:
            fetched = reg.fetch_blob(repo, desc.digest, f, max_size=MAX_LAYER, expected_size=desc.size)
            ctd.write_content(desc.digest, desc.size, f, {})
    key = f"extract-{secrets.token_hex(6)} {layer.chain_id}"
    try:
        mounts = ctd.prepare(snapshotter, key, parent, {LABEL_REF: layer.chain_id})
    except SnapshotExists:
        return fetched  # unpacked meanwhile by another pull
    try:
        applied = ctd.apply(desc, mounts)
        if applied != layer.diff_id:
            raise BadInput(f"layer {desc.digest} unpacked to {applied}, but the config says {layer.diff_id}")
        ctd.commit(snapshotter, layer.chain_id, key, {LABEL_REF: layer.chain_id})
    except BaseException:
        with contextlib.suppress(LayerstoreError):
            ctd.remove(snapshotter, key)
        raise
    return fetched
