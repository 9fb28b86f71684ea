"""The store's key layout and grammar (pure).

    config                      store format marker, written once by `init`
    chunks/ab/cd/<hex>          chunk objects, id = blake3 of the uncompressed payload
    blobs/ab/cd/<hex>           chunk maps, id = blake3 of the whole blob
    manifests/ab/cd/<hex>       manifests (chunk-object encoded), id = blake3 of the canonical JSON
    tags/<name>:<tag>           the only mutable objects: the text of a manifest digest

Two levels of fan-out keep directories small on POSIX stores and spread S3 prefixes.
"""

from __future__ import annotations

import re

from . import digest as digestmod
from .errors import BadKey, ConfigError

CONFIG = "config"
KINDS = ("chunks", "blobs", "manifests")

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+=@-]{0,254}")
_PREFIX = re.compile(r"[A-Za-z0-9_./:+=@-]*")
_TAG_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*")
_TAG_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def validate(key: str) -> str:
    """Keys are '/'-separated segments of a conservative alphabet: no '..', no empty segment,
    no leading dot (temporary files on POSIX stores start with one)."""
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise BadKey(f"bad key: {key!r}")
    for seg in key.split("/"):
        if not _SEGMENT.fullmatch(seg):
            raise BadKey(f"bad key: {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key cut anywhere (may end in '/' or mid-segment)."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix) or len(prefix) > 1024:
        raise BadKey(f"bad key prefix: {prefix!r}")
    segs = prefix.split("/")
    if any(s == "" or s.startswith(".") for s in segs[:-1]) or segs[-1].startswith("."):
        raise BadKey(f"bad key prefix: {prefix!r}")
    return prefix


def object_key(kind: str, digest: str) -> str:
    if kind not in KINDS:
        raise ValueError(kind)
    h = digestmod.hex_of(digest)
    return f"{kind}/{h[:2]}/{h[2:4]}/{h}"


def digest_of_key(key: str) -> tuple[str, str]:
    """Inverse of `object_key`: (kind, digest). Raises `BadKey` for anything else."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] not in KINDS:
        raise BadKey(f"not an object key: {key!r}")
    kind, a, b, h = parts
    try:
        d = digestmod.from_hex(h)
    except Exception:
        raise BadKey(f"not an object key: {key!r}") from None
    if h[:2] != a or h[2:4] != b:
        raise BadKey(f"object key has the wrong fan-out: {key!r}")
    return kind, d


def parse_tag(ref: str) -> tuple[str, str]:
    """`name:tag` -> (name, tag); names are lowercase paths, tags follow OCI's grammar."""
    name, sep, tag = ref.rpartition(":")
    if not sep or not _TAG_NAME.fullmatch(name) or not _TAG_TAG.fullmatch(tag):
        raise ConfigError(f"not a tag reference (want NAME:TAG, e.g. python-env:v1): {ref!r}")
    return name, tag


def tag_key(ref: str) -> str:
    name, tag = parse_tag(ref)
    return f"tags/{name}:{tag}"


def tag_of_key(key: str) -> str:
    if not key.startswith("tags/"):
        raise BadKey(f"not a tag key: {key!r}")
    return key[len("tags/") :]
