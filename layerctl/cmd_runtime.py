"""(filled by the runtime shim work)"""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    pass
