"""A store in a POSIX directory: a local disk (the embedded default) or a distributed mount
(CephFS, 3FS, NFS, JuiceFS). Same code for all of them, so it relies on nothing such filesystems
lack: no flock, no fcntl locks. Publication uses only

- `link(tmp, final)`: exclusive (EEXIST for the loser), also across CephFS clients, so exactly
  one of several concurrent writers publishes an immutable object;
- `rename(tmp, final)`: atomic replace, for the mutable tag objects;
- compare-and-swap (`replace_if`): a lock file `.lock-<name>` beside the object, taken with an
  exclusive `link`, then the comparison and a `rename` (or `link` to create); a dead writer's
  lock is broken after `LOCK_STALE` seconds by the store's clock.

Temporary files live next to their target (same directory, so same filesystem) and start with
'.tmp-', which no key may, so listings never show them. A writer that dies leaves at most such a
temporary file behind; `sweep_temporaries` removes old ones.

The directory may be written by others (a shared CephFS), so what sits at a key is not trusted:
an object is opened with O_NOFOLLOW (a symlink is never followed) and O_NONBLOCK (a FIFO cannot
hang the reader), and read only if `fstat` says it is a regular file no larger than the caller's
`max_size`; anything else is a `CorruptObject`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path

from ..config import STORE_ENV, default_store_path
from ..errors import ConfigError, CorruptObject, NotFound, PermissionDenied, StoreUnavailable
from ..keys import validate, validate_prefix
from .base import Backend, ObjectInfo

TMP_PREFIX = ".tmp-"
LOCK_PREFIX = ".lock-"  # a compare-and-swap in progress (hidden from listings like temporaries)
LOCK_STALE = 30.0  # seconds on the store's clock after which a lock is a dead writer's
LOCK_WAIT = 10.0  # seconds a compare-and-swap waits for another one's lock



def missing_root(url: str, root: Path) -> str:
    """Why the store directory is not there, with `layerctl store init` named only where it is the
    fix: the directory is missing but its parent is there (a new store), or it is the default store
    (nobody typed that path: on a fresh machine its parents are missing too). Any other path whose
    parent is missing is more likely mistyped; a path that is a file is not a store at all."""
    if root.exists() or root.is_symlink():
        return f"store {url}: {root} is not a directory"
    if root == default_store_path().absolute():
        return (f"store {url} does not exist: it is the default store, the one used without --store or "
                f"${STORE_ENV} (run `layerctl store init` to create it)")
    if not root.parent.is_dir():
        return f"store {url} does not exist, nor does its parent directory {root.parent} (check the path)"
    return f"store {url} does not exist (run `layerctl store init` to create it)"

def _translate(e: OSError, what: str) -> Exception:
    if e.errno == errno.ENOENT:
        return NotFound(f"{what}: not found")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{what}: {os.strerror(e.errno)}")
    return StoreUnavailable(f"{what}: {os.strerror(e.errno or 0) or e}")


class PosixBackend(Backend):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        root = Path(root)
        if not root.is_absolute():
            root = Path.cwd() / root
        self.root = root
        self._root_s = str(root)  # (the hot `version` joins strings: no Path objects)
        self.url = f"file://{root}"
        self._fsync = fsync

    # -- location ------------------------------------------------------------------------
    def create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"store path {self.root} exists and is not a directory") from None
        except OSError as e:
            raise _translate(e, f"cannot create store directory {self.root}") from None
        self.check()

    def check(self) -> None:
        if not self.root.is_dir():
            raise NotFound(missing_root(self.url, self.root))
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise PermissionDenied(f"store {self.url}: permission denied")

    def _path(self, key: str) -> Path:
        return self.root / validate(key)

    # -- objects -------------------------------------------------------------------------
    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        path = self._path(key)
        if offset < 0 or (size is not None and size < 0):
            raise ValueError("negative offset or size")
        try:
            # O_NONBLOCK: opening a FIFO does not wait for a writer (and nothing is read from it)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:
            raise _translate_object(e, key, path) from None
        try:
            length = _object_length(fd, key, max_size)
            size = max(length - offset, 0) if size is None else min(size, max(length - offset, 0))
            parts = []
            while size > 0:
                b = os.pread(fd, size, offset)
                if not b:
                    break
                parts.append(b)
                offset += len(b)
                size -= len(b)
            return b"".join(parts)
        except OSError as e:
            raise _translate(e, f"object {key}") from None
        finally:
            os.close(fd)

    def _write_temp(self, path: Path, data: bytes | memoryview) -> Path:
        """Write `data` to a fresh temporary file beside `path`, durably."""
        tmp = path.parent / f"{TMP_PREFIX}{path.name[:64]}-{secrets.token_hex(8)}"
        for attempt in range(5):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise _translate(e, f"cannot create {path.parent}") from None
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileNotFoundError:
                if attempt == 4:  # pruned again and again (`delete_many` removes empty directories)
                    raise StoreUnavailable(f"cannot write to store {self.url}: {path.parent} keeps vanishing") from None
            except OSError as e:
                raise _translate(e, f"cannot write to store {self.url}") from None
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self._fsync:
                os.fsync(fd)
        except OSError as e:
            os.close(fd)
            _unlink_quietly(tmp)
            raise _translate(e, f"cannot write to store {self.url}") from None
        os.close(fd)
        return tmp

    def _sync_dir(self, path: Path) -> None:
        if not self._fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        return self._publish(self._write_temp(path, data), path, key, exclusive=True)

    def replace(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._publish(self._write_temp(path, data), path, key, exclusive=False)

    def _publish(self, tmp: Path, path: Path, key: str, *, exclusive: bool) -> bool:
        """Put the temporary file `tmp` in place at `path`: `link` (exclusive: False if `path`
        exists) or `rename` (replacing it). The temporary is gone afterwards either way."""
        try:
            if exclusive:
                os.link(tmp, path)
            else:
                os.rename(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            raise _translate(e, f"cannot publish {key}") from None
        finally:
            _unlink_quietly(tmp)
        self._sync_dir(path.parent)
        return True

    def replace_if(self, key: str, data: bytes, expected: bytes | None) -> bool:
        """Compare-and-swap under a lock file beside the object, taken with an exclusive `link`
        (the one primitive that is exclusive across CephFS/NFS clients; no flock). Readers take
        no lock: they see the old or the new object (`rename`). A lock left by a writer that
        died is broken once it is `LOCK_STALE` seconds old by the store's clock (the mtime of a
        file this call just wrote), never by the caller's."""
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            with self._cas_lock(path, key):
                try:
                    current: bytes | None = self.load(key, max_size=len(expected) if expected is not None else 0)
                except NotFound:
                    current = None
                except CorruptObject:
                    return False  # larger than expected, or not a plain object: not `expected`
                if current != expected:
                    return False
                return self._publish(tmp, path, key, exclusive=expected is None)
        finally:
            _unlink_quietly(tmp)

    @contextlib.contextmanager
    def _cas_lock(self, path: Path, key: str) -> Iterator[None]:
        lock = path.parent / f"{LOCK_PREFIX}{path.name}"
        nonce = secrets.token_hex(16).encode()
        mine = self._write_temp(lock, nonce)
        held = False
        try:
            deadline = time.monotonic() + LOCK_WAIT
            delay = 0.002
            while not held:
                try:
                    os.link(mine, lock)
                    held = True
                    break
                except FileExistsError:
                    pass
                except OSError as e:
                    raise _translate(e, f"cannot lock {key}") from None
                _break_if_stale(lock, mine)
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"{key}: another writer has held its lock ({lock.name}) for {LOCK_WAIT:g} s")
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
            yield
        finally:
            if held and _read_small(lock) == nonce:
                _unlink_quietly(lock)
            _unlink_quietly(mine)

    def exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(key)).st_mode)
        except OSError:
            return False

    def size(self, key: str) -> int:
        try:
            st = os.lstat(self._path(key))
        except OSError as e:
            raise _translate(e, f"object {key}") from None
        _check_regular(st, key)
        return st.st_size

    def version(self, key: str) -> Hashable | None:
        """The object file's identity and times: a write is a new file renamed into place (a new
        inode), and any change moves its ctime, on every host sharing the directory."""
        try:
            st = os.stat(f"{self._root_s}/{validate(key)}", follow_symlinks=False)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except OSError as e:
            raise _translate(e, f"object {key}") from None
        # Empty fan-out directories are left here; `delete_many` (the collector's) prunes them.

    def delete_many(self, keys: Iterable[str]) -> int:
        """Unlink each; then remove the directories that became empty (fan-out directories of a
        collected store would otherwise pile up and slow every listing). A writer that loses its
        directory to this between creating it and creating its temporary file creates it again."""
        removed = 0
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _translate(e, f"object {key}") from None
            removed += 1
            parents.add(path.parent)
        while parents:
            deepest = max(len(p.parts) for p in parents)
            level = {p for p in parents if len(p.parts) == deepest}
            parents -= level
            for d in level:
                if d == self.root or self.root not in d.parents:
                    continue
                try:
                    os.rmdir(d)
                except OSError:
                    continue  # not empty (the usual case), or gone
                parents.add(d.parent)
        return removed

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _entry in self._entries(prefix):
            yield key

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key, entry in self._entries(prefix):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the directory was read
            except OSError as e:
                raise _translate(e, f"object {key}") from None
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _entries(self, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        validate_prefix(prefix)
        head, _, _ = prefix.rpartition("/")
        start = self.root / head if head else self.root
        if not start.is_dir():
            if not self.root.is_dir():
                self.check()
            return
        yield from self._walk(start, head + "/" if head else "", prefix)

    def _walk(self, directory: Path, rel: str, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _translate(e, f"listing {directory}") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = rel + entry.name
            if entry.is_dir(follow_symlinks=False):
                # descend only where the prefix can still match
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(Path(entry.path), key + "/", prefix)
            elif key.startswith(prefix):
                yield key, entry

    def sweep_temporaries(self, older_than: float = 3600.0) -> int:
        """Remove temporary files left by writers that died; returns how many."""
        cutoff = time.time() - older_than
        removed = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    try:
                        if os.stat(p).st_mtime < cutoff:
                            os.unlink(p)
                            removed += 1
                    except OSError:
                        pass
        return removed


def _translate_object(e: OSError, key: str, path: Path) -> Exception:
    """An object that cannot be opened: a symlink (ELOOP under O_NOFOLLOW), a socket (ENXIO), a
    non-directory where the key needs a directory (ENOTDIR), or a device on a `nodev` mount
    (EACCES) is corruption, not a failure."""
    if e.errno in (errno.EACCES, errno.EPERM):
        try:
            wrong = _not_an_object(os.lstat(path), key)
        except OSError:
            wrong = None
        if wrong is not None:
            return wrong
    if e.errno == errno.ELOOP:
        return CorruptObject(f"object {key}: a symlink, not an object (never followed)")
    if e.errno == errno.ENXIO:
        return CorruptObject(f"object {key}: a socket or device, not an object")
    if e.errno == errno.ENOTDIR:
        return CorruptObject(f"object {key}: a file where the key needs a directory")
    return _translate(e, f"object {key}")


def _not_an_object(st: os.stat_result, key: str) -> CorruptObject | None:
    """The error for what is at `key` if it is not a regular file."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    kind = ("a symlink" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "not a file")
    return CorruptObject(f"object {key}: {kind}, not an object (never read)")


def _check_regular(st: os.stat_result, key: str) -> None:
    wrong = _not_an_object(st, key)
    if wrong is not None:
        raise wrong


def _object_length(fd: int, key: str, max_size: int | None) -> int:
    """The length of the regular file open at `fd`, at most `max_size`; `CorruptObject` otherwise."""
    st = os.fstat(fd)
    _check_regular(st, key)
    if max_size is not None and st.st_size > max_size:
        raise CorruptObject(f"object {key}: {st.st_size} bytes, more than such an object can have ({max_size})")
    return st.st_size


def _read_small(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, 64)
    except OSError:
        return None
    finally:
        os.close(fd)


def _break_if_stale(lock: Path, mine: Path) -> None:
    """Remove `lock` if it is older than LOCK_STALE by the store's clock (`mine` was just
    written). It is renamed away first and removed only if it is still the lock judged stale (a
    writer may have broken it and taken a fresh one meanwhile: that one is put back)."""
    try:
        age = os.lstat(mine).st_mtime - os.lstat(lock).st_mtime
    except OSError:
        return
    if age <= LOCK_STALE:
        return
    stale = _read_small(lock)
    aside = lock.with_name(f"{TMP_PREFIX}broken-{secrets.token_hex(8)}")
    try:
        os.rename(lock, aside)
    except OSError:
        return  # gone already
    if _read_small(aside) != stale:
        with contextlib.suppress(OSError):
            os.link(aside, lock)  # someone's fresh lock: put it back (if nobody took another)
    _unlink_quietly(aside)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
