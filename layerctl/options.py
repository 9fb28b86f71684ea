"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

store_option = click.option(
    "--store",
    "store_url",
    metavar="URL",
    default=None,
    help="Store URL: a path, file:///path, s3://bucket/prefix[?endpoint=URL] or http(s)://host:port (layerctl serve). "
    "Default: $LAYERSTORE_STORE, else $XDG_DATA_HOME/layerstore/store.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
