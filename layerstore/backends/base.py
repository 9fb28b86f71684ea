"""The one abstract backend every store location implements.

A backend moves opaque bytes under validated keys. It knows nothing about chunks or digests;
compression and verification wrap it (see `layerstore.store`). Semantics every backend keeps:

- `store_once(key, data)`: the object is written at most once and is never visible half-written;
  of several concurrent writers exactly one wins, the others get `False`.
- `replace(key, data)`: atomic overwrite, readers see the old or the new bytes, never a mix.
- `load(key, offset, size, max_size=)`: whole object or a byte range; a range past the end is
  truncated like a POSIX read. An object larger than `max_size` (its whole length, whatever the
  range) is a `CorruptObject`, raised before its body is read or any buffer for it allocated:
  the store is untrusted, and an 8 GiB object where a 4 MiB chunk belongs is an error, not an
  allocation. Only plain objects are read: something else at a key (on POSIX a symlink, FIFO,
  socket, device or directory) is a `CorruptObject`, never followed, never read, never waited on.
- `list_info(prefix)`: like `list`, with each object's size and modification time (seconds since
  the epoch, on the store's clock: the file system's or the S3 server's, never the caller's).
  The garbage collector keeps objects younger than its grace period by this time.
- `load_many(keys, max_size=)`: several whole objects, each `(key, bytes)` or `(key, the
  LayerstoreError a load of it raised)`, in the order given; one request for many where the
  backend has it (HTTP: the service's batched read), else one `load` each. `reads_in_batches`
  says which: callers that would rather spread single loads over threads (the node daemon's
  fetcher) batch only where it is True.
- `delete_many(keys)`: remove many objects, in batches where the backend has them (S3
  DeleteObjects); a key that is already gone is not an error. Returns how many were removed.
- `replace_if(key, data, expected)`: compare-and-swap of a mutable object (a tag): replace it
  with `data` only if it holds exactly `expected` (None: only if there is no object), atomically
  with respect to other `replace_if` calls, also from other hosts; False when the object was
  not `expected`. The primitive per backend: POSIX an exclusive `link` of a lock file beside the
  object plus `rename` (no flock: CephFS/NFS clients do not share it); S3 a conditional PUT
  (`If-Match: <etag>`, `If-None-Match: *`); HTTP the service's `If-Match` on top of its
  backend's `replace_if`. Plain `replace` does not take part: last write wins.
- Missing objects raise `NotFound`; transient failures raise `StoreUnavailable`.
- `version(key)`: a token cheaper than the object that changes whenever it is written again
  (POSIX: the file's identity and times), or None (no such thing here, or no object): lets a
  caller keep what it read (the shim's tags) and check it with one cheap call.
- `is_temp_failure(e)`: whether a failure may pass if the request is made again. Only the
  backend knows its own exceptions; when and how often to retry is decided in one place for
  every caller (`layerstore.retry.RetryPolicy`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, LayerstoreError, NotFound
from ..retry import is_temporary


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: its key, its length and when it was last written (store clock)."""

    key: str
    size: int
    mtime: float


class Backend(ABC):
    url: str

    @abstractmethod
    def create(self) -> None:
        """Create the location (directory, bucket) if needed. Idempotent."""

    @abstractmethod
    def check(self) -> None:
        """Raise `NotFound` if the location does not exist, `PermissionDenied` if unusable."""

    @abstractmethod
    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes: ...

    @abstractmethod
    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        """Write `data` under `key` unless it exists. True if this call wrote it."""

    @abstractmethod
    def replace(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; `NotFound` if it is not there."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with `prefix`, page by page (order is not part of the contract)."""

    @abstractmethod
    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """`list`, with each object's size and modification time (store clock)."""

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """Each object of `keys`, whole, in order: its bytes, or the error loading it raised
        (`load`'s errors, retried as `load` retries them)."""
        for key in keys:
            try:
                yield key, self.load(key, max_size=max_size)
            except LayerstoreError as e:
                yield key, e

    @property
    def reads_in_batches(self) -> bool:
        """Does `load_many` read several objects a request here? True for a backend that
        overrides it, unless it says it turned batching off (`batched = False`: an HTTP service
        without batched reads)."""
        return type(self).load_many is not Backend.load_many and bool(getattr(self, "batched", True))

    def delete_many(self, keys: Iterable[str]) -> int:
        """Remove every object of `keys` that exists; returns how many this call removed."""
        removed = 0
        for key in keys:
            try:
                self.delete(key)
            except NotFound:
                continue
            removed += 1
        return removed

    def replace_if(self, key: str, data: bytes, expected: bytes | None) -> bool:
        """Replace `key` with `data` if it holds exactly `expected` (None: if it does not exist);
        True if this call replaced it. Backends that cannot do it atomically refuse."""
        raise ConfigError(f"{type(self).__name__} has no compare-and-swap")

    def version(self, key: str) -> Hashable | None:
        """A token, cheaper to get than the object, that changes whenever the object at `key` is
        written again; None where the backend has none or the object is not there (callers that
        keep what they read, e.g. a tag, then read it again)."""
        return None

    def is_temp_failure(self, e: BaseException) -> bool:
        """May `e` (raised by this backend) pass if the request is made again?"""
        return is_temporary(e)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
