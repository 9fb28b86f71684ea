"""`layerctl ctr push ENV REF`: an environment as an OCI image in a registry (`image`): the layer
pointers, the config, then the manifest under the reference's tag. Nothing of the layers' data
leaves the store: a node pulls the image with `layerctl ctr pull` and mounts the blobs lazily."""

from __future__ import annotations

from dataclasses import dataclass

from erofs_builder.sources.registry import Reference, RegistryClient
from layerstore.errors import ConfigError
from runtime_shim.resolve.environment import EnvSpec

from .image import EnvImage, image_of_environment


@dataclass
class PushReport:
    reference: str
    manifest: str
    layers: list[str]  # layerstore blobs, bottom first

    def to_json(self) -> dict[str, object]:
        return {"reference": self.reference, "manifest": self.manifest, "layers": self.layers}


def image_of(spec: EnvSpec) -> EnvImage:
    return image_of_environment(spec.manifest, [(la.blob, la.size, la.role) for la in spec.layers], spec.config)


def push(spec: EnvSpec, ref: str, *, registry: RegistryClient | None = None) -> PushReport:
    r = Reference.parse(ref)
    if r.digest:
        raise ConfigError(f"{ref}: push to a tag, not a digest")
    img = image_of(spec)
    own = registry is None
    reg = registry or RegistryClient(r.registry)
    try:
        for blob in [*img.layers, img.config]:
            reg.push_blob(r.repository, blob.data, blob.digest)
        digest = reg.put_manifest(r.repository, r.reference, img.manifest.data, img.manifest.media_type)
    finally:
        if own:
            reg.close()
    return PushReport(ref, digest, spec.blobs)
