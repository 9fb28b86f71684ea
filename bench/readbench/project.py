"""Every name the read benchmark takes from the project's packages, in one place: when one of them
moves, this is the only module to change. The rest of bench/readbench imports from here."""

from __future__ import annotations

from erofs_builder.build import build_layer, push_layer
from erofs_builder.sources.source_dir import dir_entries
from fuse_client.control import DaemonNotRunning, pin, request_json, unpin
from fuse_client.fuse.fs import BLOBS_INODE, BlobFS
from fuse_client.nodecache import DEFAULT_CONCURRENCY, LazyCache, Stats, open_cache
from layerstore import digest as digestmod
from layerstore import linux
from layerstore.store import Store

__all__ = ["BLOBS_INODE", "DEFAULT_CONCURRENCY", "BlobFS", "DaemonNotRunning", "LazyCache", "Stats", "Store",
           "build_layer", "digestmod", "dir_entries", "linux", "open_cache", "pin", "push_layer", "request_json",
           "unpin"]
