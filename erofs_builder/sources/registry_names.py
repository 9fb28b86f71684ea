"""Image references and the names a registry's URLs are built from (pure): `Reference.parse`
(`HOST[:PORT]/NAME[:TAG][@DIGEST]`, with no implicit default registry), repository, tag and
digest checks (they keep every URL path to what distribution's grammar allows), and the manifest
media types. Used by `erofs_builder.sources.registry` (the client)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from layerstore.errors import BadInput, ConfigError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_MEDIA_TYPES = (OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST)
MAX_MANIFEST = 4 << 20  # as source_oci.MAX_MANIFEST_JSON; distribution itself refuses larger ones

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_REGISTRY = re.compile(rf"{_HOST}(?::[0-9]{{1,5}})?")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})")

@dataclass(frozen=True)
class Reference:
    """`HOST[:PORT]/NAME[:TAG][@DIGEST]`; the tag defaults to `latest` when there is no digest."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        what = f"image reference {text[:200]!r}"
        if len(text) > 4096:
            raise ConfigError(f"{what}: too long")
        rest, digest = text, None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if not _DIGEST.fullmatch(digest):
                raise ConfigError(f"{what}: bad digest (want sha256:<64 hex>)")
        host, sep, path = rest.partition("/")
        if not sep or not ("." in host or ":" in host or host == "localhost"):
            raise ConfigError(f"{what}: name the registry (HOST[:PORT]/NAME[:TAG]); there is no default registry")
        if not _REGISTRY.fullmatch(host):
            raise ConfigError(f"{what}: bad registry host {host!r}")
        name, tag = path, None
        last = path.rsplit("/", 1)[-1]
        if ":" in last:
            name, tag = path.rsplit(":", 1)
            if not _TAG.fullmatch(tag):
                raise ConfigError(f"{what}: bad tag {tag!r}")
        if not _REPOSITORY.fullmatch(name) or len(name) > 255:
            raise ConfigError(f"{what}: bad repository name {name!r} (lowercase letters, digits, . _ - and /)")
        if tag is None and digest is None:
            tag = "latest"
        return cls(host, name, tag, digest)

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest when given, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def check_repository(repo: str) -> str:
    if not _REPOSITORY.fullmatch(repo) or len(repo) > 255:
        raise ConfigError(f"bad repository name {repo[:200]!r}")
    return repo


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise BadInput(f"bad digest {str(digest)[:100]!r} (want sha256:<64 hex>)")
    return digest


def check_manifest_ref(ref: str) -> str:
    if not (_DIGEST.fullmatch(ref) or _TAG.fullmatch(ref)):
        raise ConfigError(f"bad tag or digest {ref[:200]!r}")
    return ref


def is_digest(ref: str) -> bool:
    return _DIGEST.fullmatch(ref) is not None


def registry_host_ok(registry: str) -> bool:
    return _REGISTRY.fullmatch(registry) is not None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


__all__ = ["DOCKER_LIST", "DOCKER_MANIFEST", "MANIFEST_MEDIA_TYPES", "MAX_MANIFEST", "OCI_INDEX", "OCI_MANIFEST",
           "Reference", "check_digest", "check_manifest_ref", "check_repository", "is_digest", "registry_host_ok",
           "sha256_digest"]
