"""`layerctl daemon-upgrade`: replace the running node daemon by a new process without failing reads
on the fanotify data path (docs/fanotify.md)."""

from __future__ import annotations

from pathlib import Path

import click

from .options import emit_json, json_option


@click.command("daemon-upgrade")
@click.option("--cache", "cache_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The cache directory of the running daemon.")
@click.option("--log", "log", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Where the new daemon logs (default: where the old one did).")
@json_option
def daemon_upgrade_cmd(cache_dir: Path, log: Path | None, as_json: bool) -> None:
    """Stop the node daemon of --cache (SIGTERM: it leaves unanswered reads to its successor) and
    start it again with the same arguments (the installed version): reads on layers mounted on
    the fanotify data path wait in the gap and complete; none fails."""
    from fuse_client.fanotify.upgrade import upgrade

    res = upgrade(cache_dir, log=log)
    if as_json:
        emit_json(res)
    else:
        click.echo(f"daemon {res['old_pid']} replaced by {res['new_pid']} ({res['data_path']} data path, "
                   f"{res['gap_seconds']} s)")


def register(cli: click.Group) -> None:
    cli.add_command(daemon_upgrade_cmd)
