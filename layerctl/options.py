"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
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


def metrics_listen_option(env: str) -> Callable[[Any], Any]:
    """`--metrics-listen HOST:PORT`: a Prometheus `/metrics` listener (docs/metrics.md). Unset, the
    process reads `env` (the listener module decides); the address is checked here, before the
    process starts anything. (`env` is a literal at the call: importing the listener module here
    would load prometheus-client at every start of `layerctl`.)"""

    def check(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            from layerstore.metrics_listen import parse_address

            parse_address(value)  # ConfigError: the CLI's one line, exit 2
        return value

    return click.option(
        "--metrics-listen", "metrics_listen", default=None, metavar="HOST:PORT", callback=check,
        help=f"Serve Prometheus text at http://HOST:PORT/metrics (PORT alone: 127.0.0.1). Default: ${env}, "
             "else no listener.")
