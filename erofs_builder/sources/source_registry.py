"""`docker://HOST[:PORT]/NAME[:TAG|@DIGEST]`: an image in an OCI registry as the same `OciImage` the
layout and archive readers give (`source_oci`), so its layers go through the same tar reader,
whiteout conversion and digest/diff_id checks.

Resolution: the manifest by tag or digest (`registry.RegistryClient.get_manifest`, capped and
verified); an index resolves to linux/this machine's architecture (or its only real image), and
the chosen manifest is fetched by its digest and checked against the index's descriptor size;
the config blob is fetched (at most `source_oci.MAX_CONFIG_JSON`) and checked against its
descriptor. Layers are fetched only when the builder reads them: each into an anonymous
temporary file in $TMPDIR (gone when closed, or when the process dies; refused up front when its
descriptor size, at most `MAX_LAYER_BLOB`, is more than the free space), capped at its descriptor
size and verified against its digest before a byte reaches the tar reader.
"""

from __future__ import annotations

import io
import json
import os
import platform
import tempfile
from collections.abc import Callable
from typing import IO, Any

from layerstore.errors import BadInput, ConfigError

from .image_config import runtime_config
from .registry import DOCKER_LIST, OCI_INDEX, Reference, RegistryClient, check_digest
from .source_oci import (
    LAYER_TYPES,
    MANIFEST_TYPES,
    MAX_CONFIG_JSON,
    MAX_INDEX_ENTRIES,
    MAX_LAYERS,
    MAX_MANIFEST_JSON,
    OciImage,
    OciLayer,
)

SCHEME = "docker://"
MAX_LAYER_BLOB = 64 << 30  # one layer as the registry stores it (compressed); it is held on local disk
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}


def host_platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    return "linux", _ARCH.get(machine, machine)


Connect = Callable[[str], RegistryClient]  # registry host -> a client (tests pass their own transport)


def registry_image(spec: str, connect: Connect = RegistryClient) -> OciImage:
    """The layers and runtime config of `docker://REF` (see the module docstring)."""
    if not spec.startswith(SCHEME):
        raise BadInput(f"{spec}: not a {SCHEME} source")
    ref = Reference.parse(spec[len(SCHEME):])
    with connect(ref.registry) as client:
        manifest, digest = resolve_manifest(client, ref, spec)
        config_desc, layer_descs = manifest_parts(manifest, f"{spec}: manifest {digest}")
        cfg_digest, cfg_size = descriptor(config_desc, f"{spec}: image config", MAX_CONFIG_JSON)
        checked = [layer_descriptor(desc, f"{spec}: layer {i}") for i, desc in enumerate(layer_descs)]
        buf = io.BytesIO()
        client.fetch_blob(ref.repository, cfg_digest, buf, MAX_CONFIG_JSON, expected_size=cfg_size)
    what = f"{spec}: image config {cfg_digest}"
    cfg = json_object(buf.getvalue(), what)
    rootfs = cfg.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layer_descs):
        raise BadInput(f"{what}: lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} diff_ids "
                       f"for {len(layer_descs)} layers")
    layers = []
    for i, ((layer_digest, size, media), diff_id) in enumerate(zip(checked, diff_ids, strict=True)):
        layers.append(OciLayer(name=f"{spec}: layer {i} ({layer_digest[:19]})", digest=layer_digest,
                               diff_id=_digest(diff_id, f"{what}: rootfs.diff_ids[{i}]"), size=size,
                               media_type=media, opener=_LayerDownload(connect, ref, layer_digest, size)))
    return OciImage(f"{spec}@{digest}", layers, runtime_config(cfg, what), cfg)


def resolve_manifest(client: RegistryClient, ref: Reference, spec: str) -> tuple[dict[str, Any], str]:
    """The image manifest `ref` names, through at most two levels of index; and its digest."""
    body, media, digest = client.get_manifest(ref.repository, ref.reference, max_size=MAX_MANIFEST_JSON)
    for _ in range(3):
        doc = json_object(body, f"{spec}: manifest {digest}")
        if media not in INDEX_TYPES:
            if media not in MANIFEST_TYPES or doc.get("mediaType", media) != media or "manifests" in doc:
                raise BadInput(f"{spec}: manifest {digest}: not an image manifest (media type {media[:100]!r})")
            return doc, digest
        if doc.get("mediaType", media) != media:
            raise BadInput(f"{spec}: index {digest}: its mediaType says {str(doc.get('mediaType'))[:100]!r}")
        desc = pick_platform(doc, f"{spec}: index {digest}")
        want, size = descriptor(desc, f"{spec}: index {digest}: manifest", MAX_MANIFEST_JSON)
        body, media, digest = client.get_manifest(ref.repository, want, max_size=MAX_MANIFEST_JSON)
        if len(body) != size:
            raise BadInput(f"{spec}: manifest {want} is {len(body)} bytes, the index says {size}")
        if desc.get("mediaType") not in (None, media):
            raise BadInput(f"{spec}: manifest {want} is a {media}, the index says {str(desc.get('mediaType'))[:100]}")
    raise BadInput(f"{spec}: indexes nested too deeply")


def pick_platform(index: dict[str, Any], what: str) -> dict[str, Any]:
    listed = index.get("manifests")
    if not isinstance(listed, list) or not listed or len(listed) > MAX_INDEX_ENTRIES:
        raise BadInput(f"{what}: want a list of 1 to {MAX_INDEX_ENTRIES} manifests")
    descs = [d for d in listed if isinstance(d, dict)]
    os_name, arch = host_platform()

    def plat(d: dict[str, Any]) -> dict[str, Any]:
        p = d.get("platform")
        return p if isinstance(p, dict) else {}

    real = [d for d in descs if plat(d).get("os") != "unknown"]  # attestation manifests say unknown/unknown
    for d in real:
        if plat(d).get("os") == os_name and plat(d).get("architecture") == arch:
            return d
    if len(real) == 1 and not plat(real[0]):
        return real[0]
    have = ", ".join(sorted({f"{plat(d).get('os')}/{plat(d).get('architecture')}" for d in real}))[:200]
    raise BadInput(f"{what}: no image for {os_name}/{arch} (has {have or 'none'})")


def manifest_parts(doc: dict[str, Any], what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cfg, layers = doc.get("config"), doc.get("layers")
    if doc.get("schemaVersion") != 2 or not isinstance(cfg, dict) or not isinstance(layers, list):
        raise BadInput(f"{what}: want schemaVersion 2 with a config and a list of layers")
    if len(layers) > MAX_LAYERS:
        raise BadInput(f"{what}: lists {len(layers)} layers (at most {MAX_LAYERS})")
    if not layers or not all(isinstance(d, dict) for d in layers):
        raise BadInput(f"{what}: layers must be a non-empty list of descriptors")
    return cfg, layers


def layer_descriptor(desc: dict[str, Any], what: str) -> tuple[str, int, str]:
    """A layer descriptor's digest, size (at most MAX_LAYER_BLOB) and media type (a known one)."""
    digest, size = descriptor(desc, what, MAX_LAYER_BLOB)
    media = desc.get("mediaType")
    if media not in LAYER_TYPES:
        raise BadInput(f"{what} ({digest}): unsupported media type {str(media)[:100]!r}")
    return digest, size, str(media)


def descriptor(desc: dict[str, Any], what: str, limit: int | None) -> tuple[str, int]:
    """A descriptor's digest and size, the size within `limit` when given."""
    digest = _digest(desc.get("digest"), what)
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadInput(f"{what} {digest}: bad size {str(size)[:40]!r}")
    if limit is not None and size > limit:
        raise BadInput(f"{what} {digest}: descriptor size {size} is over the limit of {limit} bytes")
    return digest, size


def _digest(value: Any, what: str) -> str:
    try:
        return check_digest(value)
    except BadInput:
        raise BadInput(f"{what}: bad digest {str(value)[:100]!r}") from None


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise BadInput(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise BadInput(f"{what}: not JSON") from None
    if not isinstance(doc, dict):
        raise BadInput(f"{what}: not a JSON object")
    return doc


class _LayerDownload:
    """Opens a layer: fetched into an anonymous temp file, verified, rewound (a fresh client each
    time, so nothing stays open between layers)."""

    def __init__(self, connect: Connect, ref: Reference, digest: str, size: int) -> None:
        self.connect, self.ref, self.digest, self.size = connect, ref, digest, size

    def __call__(self) -> IO[bytes]:
        where = tempfile.gettempdir()
        st = os.statvfs(where)
        if st.f_bavail * st.f_frsize < self.size:
            raise ConfigError(f"{self.ref}: layer {self.digest} is {self.size} bytes, more than is free in "
                              f"{where} (set TMPDIR to a larger disk)")
        f = tempfile.TemporaryFile()  # noqa: SIM115 - the caller closes it
        try:
            with self.connect(self.ref.registry) as client:
                client.fetch_blob(self.ref.repository, self.digest, f, self.size, expected_size=self.size)
        except BaseException:
            f.close()
            raise
        return f


__all__ = ["MAX_LAYER_BLOB", "SCHEME", "descriptor", "host_platform", "json_object", "layer_descriptor",
           "manifest_parts", "pick_platform",
           "registry_image", "resolve_manifest"]
