"""An environment as an OCI image, and what a pull needs to read back from one (pure: no I/O).

Each environment layer becomes a layer descriptor whose blob is a small JSON pointer to the
layerstore blob (`POINTER_MEDIA_TYPE`), annotated with the blob digest (`ANNOTATION_BLOB`); the
image config carries the environment's runtime config and `rootfs.diff_ids` = the pointers'
sha256. containerd identifies unpacked layers by chain id (`chain_ids`), the snapshot names.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from typing import Any

from layerstore import digest as digestmod
from layerstore.errors import BadInput

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
# Under the OCI layer prefix: containerd (its unpacker, the CRI plugin's snapshot labels) treats only
# "application/vnd.oci.image.layer.*" (and Docker's) descriptors as layers; a differ still refuses it
# (no stream processor), so a pull that does not mount it remotely fails loudly.
POINTER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.layerstore.erofs+json"
LEGACY_POINTER_MEDIA_TYPE = "application/vnd.layerstore.erofs.layer.v1+json"  # (images pushed before)
ANNOTATION_BLOB = "dev.layerstore.blob"
ANNOTATION_ROLE = "dev.layerstore.role"
ANNOTATION_ENV = "dev.layerstore.environment"
MAX_CONFIG = 4 << 20
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def host_platform() -> tuple[str, str]:
    return "linux", _ARCH.get(platform.machine(), platform.machine())


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes
    annotations: dict[str, str]

    @property
    def digest(self) -> str:
        return sha256(self.data)

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d


@dataclass(frozen=True)
class EnvImage:
    layers: list[Blob]
    config: Blob
    manifest: Blob


def image_of_environment(manifest_digest: str, layers: list[tuple[str, int, str]],
                         runtime: dict[str, Any]) -> EnvImage:
    """`layers`: (blob digest, size, role) bottom first; `runtime`: the environment's runtime
    config (entrypoint, cmd, env, workdir, user)."""
    blobs = []
    for blob, size, role in layers:
        blob = digestmod.parse(blob)
        pointer = canonical({"blob": blob, "size": size, "role": role})
        blobs.append(Blob(POINTER_MEDIA_TYPE, pointer, {ANNOTATION_BLOB: blob, ANNOTATION_ROLE: role}))
    os_name, arch = host_platform()
    cfg: dict[str, Any] = {}
    for ours, theirs in (("entrypoint", "Entrypoint"), ("cmd", "Cmd"), ("env", "Env"), ("workdir", "WorkingDir"),
                         ("user", "User")):
        if runtime.get(ours):
            cfg[theirs] = runtime[ours]
    config = Blob(OCI_CONFIG, canonical({"architecture": arch, "os": os_name, "config": cfg,
                                         "rootfs": {"type": "layers", "diff_ids": [b.digest for b in blobs]}}), {})
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config.descriptor(),
                "layers": [b.descriptor() for b in blobs]}
    if manifest_digest:
        manifest["annotations"] = {ANNOTATION_ENV: manifest_digest}
    return EnvImage(blobs, config, Blob(OCI_MANIFEST, canonical(manifest), {}))


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI chain ids (containerd's names for unpacked layers): ChainID(L0) = DiffID(L0);
    ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln))."""
    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else sha256(f"{out[-1]} {d}".encode()))
    return out


@dataclass(frozen=True)
class Layer:
    descriptor: dict[str, Any]
    diff_id: str
    chain_id: str

    @property
    def blob(self) -> str:
        """The layerstore blob behind this layer ("" for an ordinary OCI layer)."""
        return str((self.descriptor.get("annotations") or {}).get(ANNOTATION_BLOB, ""))


def _obj(body: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError:
        raise BadInput(f"{what} is not JSON") from None
    if not isinstance(obj, dict):
        raise BadInput(f"{what} is not a JSON object")
    return obj


def pick_manifest(index_body: bytes) -> dict[str, Any]:
    """The host platform's manifest descriptor in an image index."""
    index = _obj(index_body, "image index")
    os_name, arch = host_platform()
    for m in index.get("manifests") or []:
        p = m.get("platform") or {}
        if p.get("os") == os_name and p.get("architecture") == arch:
            return dict(m)
    raise BadInput(f"the image index has no manifest for {os_name}/{arch}")


def image_layers(manifest_body: bytes, config_body: bytes) -> tuple[dict[str, Any], list[Layer]]:
    """(config descriptor, layers bottom first with their diff and chain ids), checked to agree."""
    manifest = _obj(manifest_body, "manifest")
    config = _obj(config_body, "image config")
    descs = manifest.get("layers")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(descs, list) or not isinstance(diff_ids, list) or len(descs) != len(diff_ids):
        raise BadInput("the manifest's layers and the config's rootfs.diff_ids do not match")
    for d in [*descs, manifest.get("config")]:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str) or not isinstance(d.get("size"), int):
            raise BadInput("a descriptor in the manifest is malformed")
    for d in diff_ids:
        if not isinstance(d, str) or not d.startswith("sha256:") or len(d) != 71:
            raise BadInput(f"bad diff id {d!r} in the image config")
    layers = [Layer(dict(d), diff, chain) for d, diff, chain in zip(descs, diff_ids, chain_ids(diff_ids), strict=True)]
    for layer in layers:
        if layer.blob:
            digestmod.parse(layer.blob)  # (BadDigest on a malformed annotation)
    return dict(manifest["config"]), layers


def pointer_layers(manifest_body: bytes) -> tuple[str, dict[str, str]]:
    """(the environment a layerstore image names, or ""; {layer descriptor digest: its layerstore
    blob, "" for an ordinary layer}) from an image manifest."""
    manifest = _obj(manifest_body, "manifest")
    descs = manifest.get("layers")
    if not isinstance(descs, list):
        raise BadInput("the manifest has no layer list")
    out: dict[str, str] = {}
    for d in descs:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
            raise BadInput("a layer descriptor in the manifest is malformed")
        blob = str((d.get("annotations") or {}).get(ANNOTATION_BLOB, ""))
        out[d["digest"]] = digestmod.parse(blob) if blob else ""
    return str((manifest.get("annotations") or {}).get(ANNOTATION_ENV, "")), out
