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
    from . import cmd_build, cmd_daemon, cmd_env, cmd_runtime, cmd_store

    for mod in (cmd_store, cmd_build, cmd_env, cmd_daemon, cmd_runtime):
        mod.register(cli)


_register()


def main() -> None:
    rv = run_cli(lambda: cli.main(standalone_mode=False))
    sys.exit(rv if isinstance(rv, int) else 0)
