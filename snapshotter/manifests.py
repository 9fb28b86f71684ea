"""An image's manifest from a registry, as `layerctl ctr pull` and the snapshotter's CRI path
(`cri`) both read it: one implementation of reference -> verified manifest."""

from __future__ import annotations

from erofs_builder.sources.registry import Reference, RegistryClient
from layerstore.errors import BadInput

from .image import DOCKER_LIST, OCI_INDEX, pick_manifest


def read_manifest(reg: RegistryClient, r: Reference) -> tuple[bytes, str, str]:
    """The image manifest a reference names (the host platform's, through an index): (body, media
    type, digest), verified against its digest by the registry client. Shared by `pull` and by the
    snapshotter's CRI path (`cri.CriPointers`)."""
    body, media, digest = reg.get_manifest(r.repository, r.reference)
    if media in (OCI_INDEX, DOCKER_LIST):
        desc = pick_manifest(body)
        body, media, digest = reg.get_manifest(r.repository, str(desc["digest"]))
    if media in (OCI_INDEX, DOCKER_LIST):
        raise BadInput(f"{r}: an index inside an index")
    return body, media, digest
