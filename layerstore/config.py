"""Where things live when the user does not say (pure apart from reading the environment)."""

from __future__ import annotations

import os
from pathlib import Path

STORE_ENV = "LAYERSTORE_STORE"


def default_store_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "layerstore" / "store"


def resolve_store_url(explicit: str | None = None) -> str:
    """`--store`, else $LAYERSTORE_STORE, else the embedded default directory."""
    return explicit or os.environ.get(STORE_ENV) or str(default_store_path())
