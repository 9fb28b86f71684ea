"""`layerctl build SRC`: turn a directory, a tar stream or an OCI/Docker image into EROFS layers,
optionally write them out and push them (chunks first, then the chunk map) to a store.

Every layer is built completely before anything is published: a source that turns out to be bad
half-way leaves no output file and nothing in the store. With a multi-layer source (oci:,
docker-archive:, docker://) `--output` names a directory that receives one `<blob-hex>.erofs` per layer;
the `--json` list gives their order, base first. A push leaves a lease behind (`push-kept-...`,
printed, in `--json` as `lease`) that keeps its layers from garbage collection until `env create`
names them or `--lease-ttl` passes (docs/gc.md, "A push's layers until an environment names them").
The work is `erofs_builder.workflow.build_and_push`;
this module holds the options, the progress bar and the printing.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from layerstore import leases
from layerstore.errors import ConfigError, LayerstoreError, NotFound, PermissionDenied
from layerstore.fileio import write_atomic

from .options import emit_json, human_bytes, json_option, store_option

Progress = Callable[[int], None]


# -- progress ---------------------------------------------------------------------------------
class ProgressBar:
    """A rich progress bar on stderr, silent when stderr is not a terminal or with --json."""

    def __init__(self, enabled: bool) -> None:
        from rich import progress as rp
        from rich.console import Console

        console = Console(stderr=True)
        self.progress = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(),
                                    rp.TransferSpeedColumn(), rp.TimeElapsedColumn(), console=console,
                                    transient=True, disable=not (enabled and console.is_terminal))

    def __enter__(self) -> ProgressBar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def task(self, description: str, total: int | None) -> Progress:
        task_id = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task_id, n)


# -- the command ------------------------------------------------------------------------------
@click.command("build")
@click.argument("src")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
              help="Write the image here (a directory of <blob-hex>.erofs files for oci:/docker-archive:/docker://).")
@click.option("--push", is_flag=True, help="Store the image's chunks and chunk map in the store.")
@click.option("--lease-ttl", default="1h", show_default=True, metavar="DURATION",
              help="With --push: how long the push's lease keeps its layers from `layerctl gc` if no `env create` "
                   "names them first (env create releases it).")
@store_option
@click.option("--role", type=click.Choice(["base", "toolkit", "workspace"]), default=None,
              help="The layer's role, reported with the result.")
@click.option("--all-root", is_flag=True, help="Record every file as owned by root (0:0).")
@click.option("--mtime", type=click.IntRange(min=0), default=None, metavar="N",
              help="Clamp modification times to at most N (seconds since the epoch).")
@json_option
@click.option("--config-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the image's runtime config JSON here (oci:/docker-archive:/docker:// sources).")
@click.option("--parent", default=None, metavar="DIGEST|FILE",
              help="Build on an earlier image of the same tree (its blob digest, or an image file whose chunk map "
                   "is in the store): unchanged files keep their chunks.")
@click.option("--no-pack-tails", "no_pack_tails", is_flag=True,
              help="Keep the data of every file of a block or more in whole blocks (no tail packed inline), so that "
                   "a DAX mount reads it in place: for layers VMs map as pmem (--layer-device pmem). Images "
                   "grow by up to a block a file.")
def build_cmd(src: str, output: Path | None, push: bool, lease_ttl: str, store_url: str | None, role: str | None,
              all_root: bool, mtime: int | None, as_json: bool, config_out: Path | None, parent: str | None,
              no_pack_tails: bool) -> None:
    """Build SRC into EROFS layer images.

    SRC is a directory, a tar file (plain, gzip or zstd; '-' reads stdin), oci:PATH[:REF] (an OCI
    image layout), docker-archive:PATH[:REF] (a `docker save` tar) or
    docker://HOST[:PORT]/NAME[:TAG|@DIGEST] (an image in a registry; credentials from
    ~/.docker/config.json or $LAYERSTORE_REGISTRY_USER/_PASSWORD; plain HTTP only for loopback
    hosts and $LAYERSTORE_INSECURE_REGISTRIES). `layerctl env create --from SRC` makes a whole
    image an environment in one step.
    """
    from layergc.retention import parse_duration

    from erofs_builder.workflow import build_and_push, resolve_source

    keep_for = parse_duration(lease_ttl)
    if keep_for <= 0:
        raise ConfigError(f"--lease-ttl must be positive, got {lease_ttl!r}")
    source = resolve_source(src, all_root=all_root)
    if config_out is not None and source.config is None:
        raise ConfigError("--config-out needs an image source (oci:PATH, docker-archive:PATH or docker://REF)")
    if parent is not None and source.multi:
        raise ConfigError("--parent needs a single-layer source (a directory or a tar)")
    store = None
    if push or parent is not None:
        from .cmd_store import open_store

        store = open_store(store_url)
        if push:
            store.name_lease(leases.PUSH_KEPT)
    results: list[dict[str, Any]] = []
    try:
        with ProgressBar(not as_json) as bar:
            built = build_and_push(source, store=store, push=push, output=output, parent=parent, mtime_clamp=mtime,
                                   all_root=all_root, progress=bar.task,
                                   **({"pack_tails": False} if no_pack_tails else {}))
        for r in built:
            layer = r.layer
            res: dict[str, Any] = {"blob": layer.blob, "size": layer.size, "chunks": len(layer.refs),
                                   "new_bytes": None, "files": layer.files}
            if r.pushed is not None:
                res["chunks"], res["new_bytes"] = r.pushed.chunks, r.pushed.new_bytes
            if role:
                res["role"] = role
            if parent is not None:
                res["parent_used"] = layer.parent_used
            res["_path"] = r.path
            res["_payload"] = sum(ref.length for ref in layer.refs)
            results.append(res)
        if push and store is not None:
            # Only a build that succeeded keeps its lease; a failed one releases it at close.
            kept = store.keep_lease(keep_for, [r.layer.blob for r in built])
            for res in results:
                res["lease"], res["lease_expires"] = kept if kept is not None else (None, None)
        if config_out is not None:
            write_atomic(config_out, json.dumps(source.config, indent=2, sort_keys=True).encode() + b"\n", mode=0o644)
    except OSError as e:
        cls = {errno.ENOENT: NotFound, errno.EACCES: PermissionDenied, errno.EPERM: PermissionDenied,
               errno.EROFS: PermissionDenied}.get(e.errno or 0, LayerstoreError)
        raise cls(f"build failed: {e.filename or ''}: {e.strerror}") from None
    finally:
        if store is not None:
            store.close()
    _report(results, source.multi, as_json, store.url if store is not None else None)


def _report(results: list[dict[str, Any]], multi: bool, as_json: bool, store_url: str | None) -> None:
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    if as_json:
        emit_json(public if multi else public[0])
        return
    for i, r in enumerate(results):
        head = f"layer {i + 1}/{len(results)} " if multi else ""
        role = f" ({r['role']})" if r.get("role") else ""
        click.echo(f"{head}{r['blob']}{role}")
        click.echo(f"  {r['files']} files, image {human_bytes(r['size'])}, {r['chunks']} chunks")
        if r.get("parent_used") is False:
            click.echo("  parent set aside (too much of it is no longer referenced): laid out afresh")
        if r["new_bytes"] is not None:
            dedup = max(0, r["_payload"] - r["new_bytes"])
            click.echo(f"  pushed to {store_url}: {human_bytes(r['new_bytes'])} new, "
                       f"{human_bytes(dedup)} deduplicated")
        if r["_path"] is not None:
            click.echo(f"  written to {r['_path']}")
    if results and results[0].get("lease"):
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(results[0]["lease_expires"]))
        click.echo(f"kept by lease {results[0]['lease']} until {until} (`layerctl env create` naming "
                   f"{'them' if multi else 'it'} releases it)")


def register(cli: click.Group) -> None:
    cli.add_command(build_cmd)


__all__ = ["register", "LayerstoreError"]
