"""`layerctl`: the command line on top of every other package.

Each command family lives in its own module and registers itself on `cli`; this module only
wires them together and owns the error edge.
"""

from __future__ import annotations

import sys

import click

from layerstore import __version__

from .errors import run_cli


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="layerctl")
def cli() -> None:
    """layerstore: lazy, content-addressed EROFS layers for agent sandboxes."""


def _register() -> None:
    """Every `cmd_*` module of this package registers its commands: a new command family is a new
    module, and nothing here changes."""
    import importlib
    import os
    import pkgutil

    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"{__package__}.{info.name}").register(cli)


_register()


def main() -> None:
    rv = run_cli(lambda: cli.main(standalone_mode=False))
    sys.exit(rv if isinstance(rv, int) else 0)
