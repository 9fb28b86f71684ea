"""The runtime config of an environment: what a sandbox runs, with which environment, where, as whom (pure).

    {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["PATH=/usr/bin:/bin"],
     "workdir": "/", "user": ""}

This is the schema `layerctl build --config-out FILE` writes for OCI sources (taken from the image
config's Entrypoint, Cmd, Env, WorkingDir and User). In a manifest every field is present; a config
*file* may leave fields out, which then take the defaults below. `user` "" means the runtime's
default (root).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .canonical import kind_of
from .errors import InvalidManifest

FIELDS = ("cmd", "entrypoint", "env", "user", "workdir")
MAX_PATH = 4096
MAX_ARGS = 4096
_USER_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
_USER = re.compile(rf"{_USER_PART}(:{_USER_PART})?")
_ENV_KEY = re.compile(r"[^=\s\x00]+")


@dataclass(frozen=True)
class RuntimeConfig:
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    workdir: str = "/"
    user: str = ""

    def __post_init__(self) -> None:
        check_config(self)

    @classmethod
    def from_json(cls, obj: Any, where: str = "config", *, partial: bool = False) -> RuntimeConfig:
        """Parse the JSON form. With `partial` (a config file), missing fields take defaults;
        in a manifest every field must be present so that one config has one byte form."""
        if not isinstance(obj, Mapping):
            raise InvalidManifest(f"{where}: want an object, got {kind_of(obj)}")
        extra = sorted(set(obj) - set(FIELDS))
        if extra:
            raise InvalidManifest(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(FIELDS)})")
        missing = [f for f in FIELDS if f not in obj]
        if missing and not partial:
            raise InvalidManifest(f"{where}: missing field {missing[0]!r}")
        kw: dict[str, Any] = {}
        for name in ("entrypoint", "cmd", "env"):
            if name in obj:
                kw[name] = _str_list(obj[name], f"{where}.{name}")
        for name in ("workdir", "user"):
            if name in obj:
                if not isinstance(obj[name], str):
                    raise InvalidManifest(f"{where}.{name}: want a string, got {kind_of(obj[name])}")
                kw[name] = obj[name]
        try:
            return cls(**kw)
        except InvalidManifest as e:
            raise InvalidManifest(f"{where}.{e}") from None

    def to_json(self) -> dict[str, Any]:
        return {"entrypoint": list(self.entrypoint), "cmd": list(self.cmd), "env": list(self.env),
                "workdir": self.workdir, "user": self.user}

    @property
    def argv(self) -> list[str]:
        """What the sandbox runs by default: entrypoint followed by cmd (OCI semantics)."""
        return [*self.entrypoint, *self.cmd]

    def env_map(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.env)  # type: ignore[misc]


def check_config(cfg: RuntimeConfig) -> None:
    """The rules; errors name the field first ("env[2]: ...") so callers can prefix a path."""
    for name in ("entrypoint", "cmd", "env"):
        items = getattr(cfg, name)
        if not isinstance(items, tuple) or not all(isinstance(s, str) for s in items):
            raise InvalidManifest(f"{name}: want a list of strings")
        if len(items) > MAX_ARGS:
            raise InvalidManifest(f"{name}: more than {MAX_ARGS} entries")
        for i, s in enumerate(items):
            _check_text(s, f"{name}[{i}]")
    seen: dict[str, int] = {}
    for i, entry in enumerate(cfg.env):
        key, sep, _value = entry.partition("=")
        if not sep or not key:
            raise InvalidManifest(f"env[{i}]: want KEY=VALUE, got {entry!r}")
        if not _ENV_KEY.fullmatch(key):
            raise InvalidManifest(f"env[{i}]: bad variable name {key!r} (no whitespace or '=')")
        if key in seen:
            raise InvalidManifest(f"env[{i}]: {key} is already set by env[{seen[key]}]")
        seen[key] = i
    if not isinstance(cfg.workdir, str):
        raise InvalidManifest("workdir: want a string")
    _check_text(cfg.workdir, "workdir")
    if not cfg.workdir.startswith("/"):
        raise InvalidManifest(f"workdir: must be an absolute path, got {cfg.workdir!r}")
    if len(cfg.workdir) > MAX_PATH:
        raise InvalidManifest(f"workdir: longer than {MAX_PATH} characters")
    if ".." in cfg.workdir.split("/"):
        raise InvalidManifest(f"workdir: must not contain '..', got {cfg.workdir!r}")
    if not isinstance(cfg.user, str):
        raise InvalidManifest("user: want a string")
    if cfg.user and not _USER.fullmatch(cfg.user):
        raise InvalidManifest(f"user: want USER, UID, USER:GROUP or UID:GID, got {cfg.user!r}")


def _check_text(s: str, where: str) -> None:
    if "\x00" in s:
        raise InvalidManifest(f"{where}: contains a NUL character")
    check_utf8(s, where)


def check_utf8(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidManifest(f"{where}: not valid Unicode (lone surrogate)") from None


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise InvalidManifest(f"{where}: want a list of strings, got {kind_of(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise InvalidManifest(f"{where}[{i}]: want a string, got {kind_of(s)}")
    return tuple(value)

