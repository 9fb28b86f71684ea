"""The runtime part of an OCI (or Docker) image config, as the small JSON object environments use:

    {"entrypoint": [...], "cmd": [...], "env": [...], "workdir": "/...", "user": "..."}

(`manifest.config.RuntimeConfig`, read back by `layerctl env create --config FILE`). Taken from
the image config's `config` object: Entrypoint, Cmd, Env, WorkingDir, User. Normalisations: an
unset WorkingDir is "/", a relative one is taken from "/" (as Docker does); an unset User is ""
(the runtime's default, root); an Env variable set twice keeps its last value at the place of
its first. Everything else that breaks the schema is refused with `BadInput`.
"""

from __future__ import annotations

from typing import Any

from layerstore.errors import BadInput
from manifest.config import RuntimeConfig
from manifest.errors import InvalidManifest


def runtime_config(image_config: dict[str, Any], what: str = "image config") -> dict[str, Any]:
    """The runtime config JSON of an image config document."""
    cfg = image_config.get("config") or image_config.get("Config") or {}
    if not isinstance(cfg, dict):
        raise BadInput(f"{what}: 'config' is not an object")

    def strings(key: str) -> list[str]:
        value = cfg.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise BadInput(f"{what}: config.{key} is not a list of strings")
        return value

    def string(key: str) -> str:
        value = cfg.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise BadInput(f"{what}: config.{key} is not a string")
        return value

    env: dict[str, str] = {}
    for item in strings("Env"):
        key, sep, _ = item.partition("=")
        if not sep:
            raise BadInput(f"{what}: config.Env entry {item[:80]!r} is not KEY=VALUE")
        env[key] = item  # dicts keep first-insertion order; the value is the last one
    workdir = string("WorkingDir")
    if not workdir.startswith("/"):
        workdir = "/" + workdir
    try:
        rc = RuntimeConfig(entrypoint=tuple(strings("Entrypoint")), cmd=tuple(strings("Cmd")),
                           env=tuple(env.values()), workdir=workdir, user=string("User"))
    except InvalidManifest as e:
        raise BadInput(f"{what}: {e}") from None
    return rc.to_json()
