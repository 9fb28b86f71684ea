"""A whole image as an environment in one step (`layerctl env create --from SRC -t NAME:TAG`):
build and push every layer of an image source (`oci:`, `docker-archive:`, `docker://`), give the
layers their roles, take the image's runtime config, and create the tagged environment.

Role mapping (`image_roles`, pure): the bottom layer is the base, every other layer a toolkit, in
image order; with `top_workspace` the top layer is the workspace instead. A blob that occurs
twice keeps only its upper occurrence: the lower copy lies under an identical twin that shadows
every path, whiteout and opaque directory it holds, so the composed tree is the same, and the
manifest schema names each blob once. Images have at most 500 layers (the readers' limit, and
overlayfs' stack), which the schema allows, so nothing is squashed.

Order of writes, and what a crash leaves: layers are built completely and then pushed (chunks,
then each chunk map: `workflow.build_and_push`); then the manifest, the signature, the tag
(`manifest.environment.create_environment`). A crash leaves at most unreferenced chunks and chunk
maps (gc's to collect); running again stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerstore.errors import ConfigError
from manifest import environment as envmod
from manifest.config import RuntimeConfig
from manifest.schema import BASE, TOOLKIT, WORKSPACE, Manifest

from .workflow import LayerResult, ProgressFactory, build_and_push, resolve_source

if TYPE_CHECKING:
    from layerstore.store import Store
    from manifest.signing import PrivateKey

IMAGE_SOURCES = ("oci:", "docker-archive:", "docker://")


@dataclass
class ImageEnvironment:
    created: envmod.Created
    manifest: Manifest
    built: list[LayerResult]  # every image layer, base first (duplicates included)
    dropped: int  # image layers left out as lower duplicates of another


def image_roles(blobs: Sequence[str], *, top_workspace: bool = False) -> tuple[list[tuple[str, str]], int]:
    """(blob, role) bottom first, and how many lower duplicates were dropped (see the module
    docstring)."""
    kept: list[str] = []
    seen: set[str] = set()
    for blob in reversed(blobs):
        if blob not in seen:
            seen.add(blob)
            kept.append(blob)
    kept.reverse()
    if not kept:
        raise ConfigError("the image has no layers")
    if top_workspace and len(kept) < 2:
        raise ConfigError("--top-workspace needs an image of at least two distinct layers (one is the base)")
    roles = [(kept[0], BASE), *((b, TOOLKIT) for b in kept[1:])]
    if top_workspace:
        roles[-1] = (roles[-1][0], WORKSPACE)
    return roles, len(blobs) - len(kept)


def environment_from_image(store: Store, src: str, tag: str, *, top_workspace: bool = False,
                           workspace: str | None = None, config: RuntimeConfig | None = None,
                           trace: Mapping[str, list[int]] | None = None,
                           annotations: Mapping[str, str] | None = None, key: PrivateKey | None = None,
                           all_root: bool = False, progress: ProgressFactory | None = None) -> ImageEnvironment:
    """Build and push image `src`, then create environment `tag` from it. `workspace`: a blob
    already in the store to put on top; `config`: replaces the image's runtime config."""
    envmod.check_environment_tag(tag)
    if not src.startswith(IMAGE_SOURCES):
        raise ConfigError(f"--from {src}: want an image (oci:PATH[:REF], docker-archive:PATH[:REF] or "
                          "docker://HOST/NAME[:TAG|@DIGEST]); for a directory or a tar use build + env create")
    if workspace is not None and top_workspace:
        raise ConfigError("--workspace and --top-workspace both name the workspace: give one")
    source = resolve_source(src, all_root=all_root)
    assert source.multi and source.config is not None  # every image source is
    image_config = config or RuntimeConfig.from_json(source.config, f"{src}: runtime config")
    built = build_and_push(source, store=store, push=True, all_root=all_root, progress=progress)
    roles, dropped = image_roles([r.layer.blob for r in built], top_workspace=top_workspace)
    toolkits = [b for b, role in roles[1:] if role == TOOLKIT]
    top = workspace if workspace is not None else next((b for b, role in roles if role == WORKSPACE), None)
    manifest = envmod.build_manifest(store, base=roles[0][0], toolkits=toolkits, workspace=top,
                                     config=image_config, trace=trace, annotations=annotations)
    created = envmod.create_environment(store, manifest, tag, key=key)
    return ImageEnvironment(created, manifest, built, dropped)


__all__ = ["IMAGE_SOURCES", "ImageEnvironment", "environment_from_image", "image_roles"]
