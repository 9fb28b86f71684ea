"""Backends, chosen by URL scheme.

    /abs/path, rel/path, file:///abs/path   PosixBackend (local disk, CephFS, 3FS, NFS mounts)
    s3://bucket[/prefix][?endpoint=URL&region=R]   S3Backend (boto3: Ceph RGW, AWS, MinIO)
    http(s)://host[:port][/prefix], http+unix://%2Fsocket[/prefix]   HttpBackend (the store service)
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import ConfigError
from .base import Backend, ObjectInfo

__all__ = ["Backend", "ObjectInfo", "open_backend"]


def open_backend(url: str) -> Backend:
    if not url:
        raise ConfigError("empty store URL")
    if "://" not in url:
        if url.startswith("-"):
            raise ConfigError(f"malformed store URL: {url!r}")
        from .posix import PosixBackend

        return PosixBackend(os.path.abspath(url))
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ConfigError(f"malformed store URL {url!r}: {e}") from None
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(f"malformed file URL (want file:///absolute/path): {url!r}")
        if parts.query or parts.fragment:
            raise ConfigError(f"file URLs take no query or fragment: {url!r}")
        from .posix import PosixBackend

        return PosixBackend(unquote(parts.path))
    if scheme == "s3":
        try:
            query = parse_qs(parts.query, strict_parsing=bool(parts.query))
        except ValueError:
            raise ConfigError(f"malformed query in store URL: {url!r}") from None
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise ConfigError(f"unknown store URL parameter(s) {sorted(unknown)} in {url!r}")
        if not parts.netloc:
            raise ConfigError(f"malformed S3 URL (want s3://bucket/prefix): {url!r}")
        from .s3 import S3Backend

        return S3Backend(
            bucket=parts.netloc,
            prefix=parts.path.strip("/"),
            endpoint=query.get("endpoint", [None])[0],
            region=query.get("region", [None])[0],
        )
    if scheme in ("http", "https", "http+unix"):
        from .http import HttpBackend

        return HttpBackend(url)
    raise ConfigError(f"unknown store URL scheme {scheme!r} in {url!r} (want a path, file://, s3://, http(s)://)")
