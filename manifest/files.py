"""Local files the manifest tools read and write: runtime configs, prefetch traces, trust
policies and signing keys. Parsing is the pure modules' job; this module only does the I/O and
turns OS errors into the project's errors."""

from __future__ import annotations

import os
from pathlib import Path

from layerstore.errors import ConfigError, NotFound, PermissionDenied
from layerstore.fileio import write_atomic

from . import canonical
from .config import RuntimeConfig
from .errors import InvalidManifest
from .signing import PrivateKey, TrustPolicy, combine_policies
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
    """The caller's trust policy: `path`, else $LAYERSTORE_TRUST_POLICY, else none. A runtime
    applies it on top of its node's policy (`node_policy`), never in its place."""
    chosen = path or os.environ.get(POLICY_ENV) or None
    return read_policy(chosen) if chosen else None


def node_policy(node_file: str | os.PathLike[str], caller: str | os.PathLike[str] | None = None, *,
                caller_env: bool = True) -> TrustPolicy | None:
    """The policy a node applies: its own policy file `node_file` when it exists (the floor),
    combined with the caller's (`load_policy(caller)`; with `caller_env` false only `caller`
    itself, not $LAYERSTORE_TRUST_POLICY), so that the result accepts only what both accept: a
    caller can tighten the node's policy, never loosen it. A node policy file that exists but
    cannot be read or parsed is an error, never "no policy"."""
    floor = read_policy(node_file) if os.path.lexists(node_file) else None
    mine = load_policy(caller) if caller_env else (read_policy(caller) if caller else None)
    return combine_policies(floor, mine)


def read_private_key(path: str | os.PathLike[str]) -> PrivateKey:
    return PrivateKey.from_pem(read_file(path, "key file", 1 << 16), f"key file {path}")


def write_private_key(path: str | os.PathLike[str], key: PrivateKey, *, force: bool = False) -> None:
    """Write the key readable by its owner only. Never overwrites unless `force` (no
    check-then-write race: the file is linked into place); never leaves a partial key file."""
    path = Path(path)
    try:
        write_atomic(path, key.to_pem(), mode=0o600, exclusive=not force)
    except FileExistsError:
        raise ConfigError(f"key file {path}: already exists (use --force to replace it)") from None
    except FileNotFoundError:
        raise NotFound(f"key file {path}: directory {path.parent} does not exist") from None
    except PermissionError:
        raise PermissionDenied(f"key file {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"key file {path}: {os.strerror(e.errno or 0)}") from None
