"""Local files the manifest tools read and write: runtime configs, prefetch traces, trust
policies and signing keys. Parsing is the pure modules' job; this module only does the I/O and
turns OS errors into the project's errors."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from layerstore.errors import ConfigError, NotFound, PermissionDenied

from . import canonical
from .config import RuntimeConfig
from .errors import InvalidManifest
from .signing import PrivateKey, TrustPolicy
from .trace import parse_trace

MAX_FILE = 64 << 20
POLICY_ENV = "LAYERSTORE_TRUST_POLICY"


def read_file(path: str | os.PathLike[str], what: str, limit: int = MAX_FILE) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise NotFound(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path}: is a directory") from None
    except PermissionError:
        raise PermissionDenied(f"{what} {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: {os.strerror(e.errno or 0)}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path}: larger than {limit} bytes")
    return data


def read_config(path: str | os.PathLike[str]) -> RuntimeConfig:
    """A runtime config file (as `layerctl build --config-out` writes); missing fields take defaults."""
    where = f"config file {path}"
    obj = canonical.loads(read_file(path, "config file"), where)
    try:
        return RuntimeConfig.from_json(obj, "config", partial=True)
    except InvalidManifest as e:
        raise InvalidManifest(f"{where}: {e}") from None


def read_trace(path: str | os.PathLike[str]) -> dict[str, list[int]]:
    return parse_trace(read_file(path, "prefetch trace"), f"prefetch trace {path}")


def read_policy(path: str | os.PathLike[str]) -> TrustPolicy:
    return TrustPolicy.from_bytes(read_file(path, "trust policy"), f"trust policy {path}")


def load_policy(path: str | os.PathLike[str] | None = None) -> TrustPolicy | None:
    """The trust policy a runtime applies: `path`, else $LAYERSTORE_TRUST_POLICY, else none
    (no signature checks)."""
    chosen = path or os.environ.get(POLICY_ENV) or None
    return read_policy(chosen) if chosen else None


def read_private_key(path: str | os.PathLike[str]) -> PrivateKey:
    return PrivateKey.from_pem(read_file(path, "key file", 1 << 16), f"key file {path}")


def write_private_key(path: str | os.PathLike[str], key: PrivateKey, *, force: bool = False) -> None:
    """Write the key readable by its owner only. Never overwrites unless `force`; never leaves
    a partial key file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        raise NotFound(f"key file {path}: directory {path.parent} does not exist") from None
    except PermissionError:
        raise PermissionDenied(f"key file {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"key file {path}: {os.strerror(e.errno or 0)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.to_pem())
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if the file exists: no check-then-write race
            except FileExistsError:
                raise ConfigError(f"key file {path}: already exists (use --force to replace it)") from None
            except OSError as e:
                raise ConfigError(f"key file {path}: {os.strerror(e.errno or 0)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)

