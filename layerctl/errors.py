"""The CLI edge of the error family: one clear line on stderr and an exit code, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import click

from layerstore.errors import LayerstoreError

T = TypeVar("T")


def run_cli(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except LayerstoreError as e:
        click.echo(f"layerctl: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        click.echo(f"layerctl: error: {e.format_message()}{hint}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort) as e:
        # A stop signal during a shim call (runtime_shim.backends.signals) is a KeyboardInterrupt saying what
        # it stopped; click hands it on as the cause of an Abort.
        cause = e.__cause__ if isinstance(e, click.exceptions.Abort) else e
        said = str(cause) if isinstance(cause, KeyboardInterrupt) else ""
        click.echo(f"layerctl: {said}" if said else "layerctl: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(141)
