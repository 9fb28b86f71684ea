"""`layerctl build SRC`: turn a directory, a tar stream or an OCI/Docker image into EROFS layers,
optionally write them out and push them (chunks first, then the chunk map) to a store.

Every layer is built completely before anything is published: a source that turns out to be bad
half-way leaves no output file and nothing in the store. With a multi-layer source (oci:,
docker-archive:) `--output` names a directory that receives one `<blob-hex>.erofs` per layer;
the `--json` list gives their order, base first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import click

from layerstore.errors import ConfigError, LayerstoreError, NotFound, PermissionDenied
from layerstore.fileio import write_atomic

from .options import emit_json, human_bytes, json_option, store_option

Progress = Callable[[int], None]
EntriesFactory = Callable[[Progress], Iterator[Any]]


@dataclass
class LayerSource:
    label: str
    entries: EntriesFactory  # called once with a progress callback (input bytes read)
    size: int | None  # input bytes, when known
    counts_input: bool = True  # False: progress comes from the builder (content bytes added)


@dataclass
class Source:
    layers: list[LayerSource]
    config: dict[str, Any] | None  # runtime config, for image sources
    multi: bool  # an image: --output is a directory, --json prints a list


class _Counting:
    def __init__(self, raw: BinaryIO, progress: Progress) -> None:
        self.raw, self.progress = raw, progress

    def read(self, n: int = -1, /) -> bytes:
        data = self.raw.read(n)
        if data:
            self.progress(len(data))
        return data


def _tar_layer(label: str, opener: Callable[[], BinaryIO], size: int | None) -> LayerSource:
    def entries(progress: Progress) -> Iterator[Any]:
        from erofs_builder.source_tar import tar_entries

        with opener() as f:
            yield from tar_entries(_Counting(f, progress), name=label)

    return LayerSource(label, entries, size)


def resolve_source(src: str, *, all_root: bool) -> Source:
    if src == "-":
        stdin = sys.stdin.buffer
        return Source([_tar_layer("stdin", lambda: contextlib.nullcontext(stdin), None)], None,
                      False)  # type: ignore[arg-type, return-value]
    if src.startswith(("oci:", "docker-archive:")):
        from erofs_builder.source_oci import image_layers

        image = image_layers(src)
        return Source([LayerSource(layer.name, layer.entries, layer.size) for layer in image.layers],
                      image.config, True)
    path = Path(src)
    if path.is_dir():
        from erofs_builder.source_dir import dir_entries

        def dir_layer(progress: Progress) -> Iterator[Any]:
            return dir_entries(path, all_root=all_root)

        return Source([LayerSource(str(path), dir_layer, None, counts_input=False)], None, False)
    if path.is_file():
        return Source([_tar_layer(str(path), lambda: open(path, "rb"), path.stat().st_size)], None, False)
    if path.exists():
        raise ConfigError(f"{src}: not a directory, a tar file, oci:PATH[:REF] or docker-archive:PATH")
    raise NotFound(f"{src}: no such file or directory")


# -- progress ---------------------------------------------------------------------------------
class _Bar:
    """A rich progress bar on stderr, silent when stderr is not a terminal or with --json."""

    def __init__(self, enabled: bool) -> None:
        from rich import progress as rp
        from rich.console import Console

        console = Console(stderr=True)
        self.progress = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(),
                                    rp.TransferSpeedColumn(), rp.TimeElapsedColumn(), console=console,
                                    transient=True, disable=not (enabled and console.is_terminal))

    def __enter__(self) -> _Bar:
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
              help="Write the image here (a directory of <blob-hex>.erofs files for oci:/docker-archive:).")
@click.option("--push", is_flag=True, help="Store the image's chunks and chunk map in the store.")
@store_option
@click.option("--role", type=click.Choice(["base", "toolkit", "workspace"]), default=None,
              help="The layer's role, reported with the result.")
@click.option("--all-root", is_flag=True, help="Record every file as owned by root (0:0).")
@click.option("--mtime", type=click.IntRange(min=0), default=None, metavar="N",
              help="Clamp modification times to at most N (seconds since the epoch).")
@json_option
@click.option("--config-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the image's runtime config JSON here (oci:/docker-archive: sources).")
@click.option("--parent", default=None, metavar="DIGEST|FILE",
              help="Build on an earlier image of the same tree (its blob digest, or an image file whose chunk map "
                   "is in the store): unchanged files keep their chunks.")
def build_cmd(src: str, output: Path | None, push: bool, store_url: str | None, role: str | None, all_root: bool,
              mtime: int | None, as_json: bool, config_out: Path | None, parent: str | None) -> None:
    """Build SRC into EROFS layer images.

    SRC is a directory, a tar file (plain, gzip or zstd; '-' reads stdin), oci:PATH[:REF] (an OCI
    image layout) or docker-archive:PATH[:REF] (a `docker save` tar).
    """
    from erofs_builder.build import build_layer, push_layer

    source = resolve_source(src, all_root=all_root)
    if config_out is not None and source.config is None:
        raise ConfigError("--config-out needs an image source (oci:PATH or docker-archive:PATH)")
    if parent is not None and source.multi:
        raise ConfigError("--parent needs a single-layer source (a directory or a tar)")
    store = None
    if push or parent is not None:
        from .cmd_store import open_store

        store = open_store(store_url)
    results: list[dict[str, Any]] = []
    try:
        with _Bar(not as_json) as bar, _Staging(output, source.multi) as staging, _parent(parent, store, output) as par:
            built = []
            for i, layer in enumerate(source.layers):
                what = f"layer {i + 1}/{len(source.layers)}" if source.multi else "building"
                progress = bar.task(f"{what}: reading", layer.size)
                built.append(build_layer(layer.entries(progress), staging.path_for(i), mtime_clamp=mtime,
                                         all_root=all_root, progress=None if layer.counts_input else progress,
                                         parent=par))
            published = staging.publish(built)
            for i, layer in enumerate(built):
                res: dict[str, Any] = {"blob": layer.blob, "size": layer.size, "chunks": len(layer.refs),
                                       "new_bytes": None, "files": layer.files}
                if push and store is not None:
                    stats = push_layer(store, layer, progress=bar.task(f"pushing {layer.blob[:15]}", layer.size))
                    res["chunks"], res["new_bytes"] = stats.chunks, stats.new_bytes
                if role:
                    res["role"] = role
                if parent is not None:
                    res["parent_used"] = layer.parent_used
                res["_path"] = published[i]
                res["_payload"] = sum(ref.length for ref in layer.refs)
                results.append(res)
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


def _parent(spec: str | None, store: Any, output: Path | None) -> contextlib.AbstractContextManager[Any]:
    if spec is None:
        return contextlib.nullcontext(None)
    from erofs_builder.parent import parent_source

    return parent_source(spec, store, output.absolute().parent if output is not None else Path(tempfile.gettempdir()))


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


class _Staging:
    """Where images are built, and how they are published to --output once all are built.

    Single-layer source with --output FILE: built to FILE directly (the builder writes a temp file
    and renames it). Otherwise: built into a private directory (next to --output DIR, so the final
    renames stay on one filesystem), moved to DIR as <blob-hex>.erofs when every layer is done,
    and the private directory removed whatever happens."""

    def __init__(self, output: Path | None, multi: bool) -> None:
        self.output, self.multi = output, multi
        self.tmp: Path | None = None
        self.created_dir = False

    def __enter__(self) -> _Staging:
        if self.output is not None and not self.output.absolute().parent.is_dir():
            raise NotFound(f"--output {self.output}: directory {self.output.absolute().parent} does not exist")
        if self.output is not None and not self.multi:
            if self.output.is_dir():
                raise ConfigError(f"--output {self.output}: is a directory (a single-layer source writes a file)")
            return self
        if self.output is not None:
            if self.output.exists() and not self.output.is_dir():
                raise ConfigError(f"--output {self.output}: not a directory (an image source writes one "
                                  "file per layer into a directory)")
            if not self.output.exists():
                self.output.mkdir(parents=True)
                self.created_dir = True
            self.tmp = Path(tempfile.mkdtemp(prefix=".layerctl-build-", dir=self.output))
        else:
            self.tmp = Path(tempfile.mkdtemp(prefix="layerctl-build-"))
        return self

    def path_for(self, i: int) -> Path:
        if self.tmp is None:
            assert self.output is not None
            return self.output
        return self.tmp / f"layer-{i}.erofs"

    def publish(self, built: list[Any]) -> list[str | None]:
        if self.output is None:
            return [None] * len(built)
        if not self.multi:
            return [str(self.output)]
        out = []
        for layer in built:
            final = self.output / (layer.blob.split(":", 1)[1] + ".erofs")
            os.replace(layer.path, final)
            layer.path = final
            out.append(str(final))
        return out

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if exc_type is not None and self.created_dir and self.output is not None:
            shutil.rmtree(self.output, ignore_errors=True)


def register(cli: click.Group) -> None:
    cli.add_command(build_cmd)


__all__ = ["register", "resolve_source", "LayerstoreError"]
