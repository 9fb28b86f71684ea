"""(filled by a later issue)"""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    pass
