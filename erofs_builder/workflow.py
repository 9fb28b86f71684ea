"""From a source to published layers: resolve what SRC names, build every layer, then publish
(write out, push). `layerctl build` and the runtime shim's commit both go through
`build_and_push`; the CLI adds only its options, a progress bar and the printing.

The rule: every layer of a source is built completely before anything is published, so a source
that turns out to be bad half-way (a refused archive: `BadInput`) leaves no output file and
stores nothing in the store. Layers are built into a private staging directory (or, for one
layer written to a file, to a temp file beside it) and moved into place only when all are done;
chunks and chunk maps are stored only after that.

Compressing while building (`build_layer(sink=StoreSink(store))`) stores chunks *during* the
build, before the source is known to be good. It is therefore used only for sources that say
they may (`LayerSource.refusable=False`: a sandbox's upper being committed, which is not an
archive someone hands in) and only when the store takes objects as fast as a push would; see
docs/erofs-builder.md ("From a source to published layers") for the reasoning, docs/benchmarks-build.md for the figures.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkRef
from layerstore.errors import BadDigest, ConfigError, NotFound
from layerstore.store import PutStats, Store

from .build import BuiltLayer, build_layer, push_layer
from .compress import StoreSink
from .erofs.writer import PACK_TAILS
from .tree import Data, Entry

Progress = Callable[[int], None]
# (description, total bytes or None) -> a callable advancing that task by n bytes
ProgressFactory = Callable[[str, int | None], Progress]
Entries = Iterator[tuple[Entry, Data | None]]
EntriesFactory = Callable[[Progress], Entries]


@dataclass
class LayerSource:
    label: str
    entries: EntriesFactory  # called once with a progress callback (input bytes read)
    size: int | None  # input bytes, when known
    counts_input: bool = True  # False: progress comes from the builder (content bytes added)
    # may be refused half-way (an archive or a directory someone hands in): nothing of it may
    # reach the store before it is built completely. False only for trees whose refusal is a
    # failure of the caller's own (a sandbox upper being committed): their chunks may be
    # stored while they are built (unreferenced until the chunk map, garbage for gc on failure)
    refusable: bool = True


@dataclass
class Source:
    layers: list[LayerSource]
    config: dict[str, Any] | None  # runtime config, for image sources
    multi: bool  # an image: the output is a directory of <blob-hex>.erofs files


@dataclass
class LayerResult:
    layer: BuiltLayer  # its `path` is gone after `build_and_push` when no output was asked for
    path: str | None  # where it was written (the output), None when not kept
    pushed: PutStats | None  # what the push added, None when not pushed


class _Counting:
    def __init__(self, raw: BinaryIO, progress: Progress) -> None:
        self.raw, self.progress = raw, progress

    def read(self, n: int = -1, /) -> bytes:
        data = self.raw.read(n)
        if data:
            self.progress(len(data))
        return data


def tar_layer(label: str, opener: Callable[[], contextlib.AbstractContextManager[BinaryIO]],
              size: int | None) -> LayerSource:
    """A tar stream (plain or compressed) as one layer; `opener` gives the stream."""
    def entries(progress: Progress) -> Entries:
        from .sources.source_tar import tar_entries

        with opener() as f:
            yield from tar_entries(_Counting(f, progress), name=label)

    return LayerSource(label, entries, size)


def dir_layer(path: Path, *, all_root: bool = False, transform: Callable[[Entries], Entries] | None = None,
              refusable: bool = True) -> LayerSource:
    """A directory tree as one layer; `transform` rewrites its entries on the way (a commit
    drops overlayfs's bookkeeping xattrs)."""
    def entries(progress: Progress) -> Entries:
        from .sources.source_dir import dir_entries

        found = dir_entries(path, all_root=all_root)
        return transform(found) if transform is not None else found

    return LayerSource(str(path), entries, None, counts_input=False, refusable=refusable)


def resolve_source(src: str, *, all_root: bool, stdin: BinaryIO | None = None) -> Source:
    """What SRC names: `-` (a tar on stdin), `oci:PATH[:REF]`, `docker-archive:PATH[:REF]`,
    `docker://HOST/NAME[:TAG|@DIGEST]` (a registry), a directory or a tar file."""
    if src == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        return Source([tar_layer("stdin", lambda: contextlib.nullcontext(stream), None)], None, False)
    if src.startswith(("oci:", "docker-archive:", "docker://")):
        from .sources.source_oci import image_layers
        from .sources.source_registry import SCHEME, registry_image

        image = registry_image(src) if src.startswith(SCHEME) else image_layers(src)
        return Source([LayerSource(layer.name, layer.entries, layer.size) for layer in image.layers],
                      image.config, True)
    path = Path(src)
    if path.is_dir():
        return Source([dir_layer(path, all_root=all_root)], None, False)
    if path.is_file():
        return Source([tar_layer(str(path), lambda: open(path, "rb"), path.stat().st_size)], None, False)
    if path.exists():
        raise ConfigError(f"{src}: not a directory, a tar file, oci:PATH[:REF] or docker-archive:PATH")
    raise NotFound(f"{src}: no such file or directory")


STALE_STAGING = 3600.0  # seconds: a staging directory of a dead build older than this is removed


def _staging_dir(prefix: str, parent: Path) -> Path:
    """A fresh private directory `<prefix><pid>-<random>` in `parent`, after removing those of
    builds that died (kill -9 leaves them: their process is gone and they are old)."""
    own = f"{prefix}{os.getpid()}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
                continue
            pid = entry.name[len(prefix):].partition("-")[0]
            try:
                old = time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_STAGING
            except OSError:
                continue
            if pid.isdigit() and old and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=own, dir=parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Staging:
    """Where images are built, and how they are published to the output once all are built.

    Single-layer source with an output file: built to that file directly (the builder writes a
    temp file beside it and renames it). Otherwise: built into a private directory (inside the
    output directory, so the final renames stay on one filesystem; else under `workdir`, or
    the system's temp directory), moved to the output as <blob-hex>.erofs when every layer is
    done, and the private directory removed whatever happens (an output directory this created
    too, on failure)."""

    def __init__(self, output: Path | None, multi: bool, workdir: Path | None = None) -> None:
        self.output, self.multi, self.workdir = output, multi, workdir
        self.tmp: Path | None = None
        self.created_dir = False

    def __enter__(self) -> Staging:
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
            self.tmp = _staging_dir(".layerctl-build-", self.output)
        else:
            self.tmp = _staging_dir("layerctl-build-", Path(self.workdir or tempfile.gettempdir()))
        return self

    def path_for(self, i: int) -> Path:
        if self.tmp is None:
            assert self.output is not None
            return self.output
        return self.tmp / f"layer-{i}.erofs"

    def publish(self, built: list[BuiltLayer]) -> list[str | None]:
        """Move the built layers to the output (call once every layer is built)."""
        if self.output is None:
            return [None] * len(built)
        if not self.multi:
            return [str(self.output)]
        out: list[str | None] = []
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


def _no_progress(description: str, total: int | None) -> Progress | None:
    return None


def streams(source: Source, store: Store | None, push: bool) -> bool:
    """Whether `build_and_push` compresses and stores chunks while it builds (see the module
    docstring): only when pushing, and only a source none of whose layers may be refused."""
    return push and store is not None and not any(layer.refusable for layer in source.layers)


def build_and_push(source: Source, *, store: Store | None = None, push: bool = True, output: Path | None = None,
                   parent: str | None = None, mtime_clamp: int | None = None, all_root: bool = False,
                   progress: ProgressFactory | None = None, workdir: Path | None = None,
                   pack_tails: bool | int = PACK_TAILS) -> list[LayerResult]:
    """Build every layer of `source`, then write them to `output` (a file for a single-layer
    source, a directory of <blob-hex>.erofs files for an image) and push them to `store` (when
    given and `push`): chunks, then each layer's chunk map. Nothing is published unless every
    layer was built. `parent`: an earlier image of the same tree to build on (its `b3:` blob
    digest, or an image file whose chunk map is in `store`). `progress(description, total)`
    gives the callable to advance a task (reading a layer, pushing it). `workdir`: where the
    images are built when there is no output (they are removed on return). `pack_tails`: as for
    `build_layer` (False: every file's data in whole blocks, which a DAX mount reads in place)."""
    if parent is not None and source.multi:
        raise ConfigError("--parent needs a single-layer source (a directory or a tar)")
    task = progress or _no_progress
    stream = streams(source, store, push)
    results: list[LayerResult] = []
    with Staging(output, source.multi, workdir) as staging, _parent(parent, store, output, workdir) as par:
        built = []
        for i, layer in enumerate(source.layers):
            what = f"layer {i + 1}/{len(source.layers)}" if source.multi else "building"
            advance = task(f"{what}: reading", layer.size)
            entries = layer.entries(advance or _ignore)
            built.append(build_layer(entries, staging.path_for(i), mtime_clamp=mtime_clamp, all_root=all_root,
                                     pack_tails=pack_tails, progress=None if layer.counts_input else advance,
                                     parent=par, sink=StoreSink(store) if stream and store is not None else None))
        published = staging.publish(built)
        for i, layer in enumerate(built):
            pushed = None
            if push and store is not None:
                pushed = push_layer(store, layer, progress=task(f"pushing {layer.blob[:15]}", layer.size))
            results.append(LayerResult(layer, published[i], pushed))
    return results


def _ignore(n: int) -> None:
    pass


def _parent(spec: str | None, store: Store | None, output: Path | None,
            workdir: Path | None) -> contextlib.AbstractContextManager[Any]:
    if spec is None:
        return contextlib.nullcontext(None)
    where = output.absolute().parent if output is not None else workdir or Path(tempfile.gettempdir())
    return parent_source(spec, store, where)


@contextlib.contextmanager
def parent_source(spec: str, store: Store | None, workdir: Path) -> Iterator[tuple[Path, list[ChunkRef]]]:
    """(image path, chunk refs) for `--parent DIGEST|FILE`. A digest is read from the store
    into a temporary file under `workdir`; a file needs its chunk map from the store."""
    if store is None:
        raise ConfigError("--parent needs a store (--store URL): the parent's chunk map lives there")
    if spec.startswith(digestmod.PREFIX):
        blob = digestmod.parse(spec)
        cm = store.get_chunk_map(blob)
        fd, tmp = tempfile.mkstemp(prefix=".parent.", suffix=".tmp", dir=workdir)
        try:
            try:
                store.read_blob(blob, fd)
            finally:
                os.close(fd)
            yield Path(tmp), list(cm.chunks)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return
    image = Path(spec)
    if not image.is_file():
        raise ConfigError(f"--parent {spec}: neither a b3: digest nor an image file")
    # A blob id is its chunk list's: the file's name may carry it (`<hex>.erofs`, as
    # `build --output DIR` writes), else the store finds the blob the file's bytes are.
    hint = None
    with contextlib.suppress(BadDigest):
        hint = digestmod.from_hex(image.name.partition(".")[0])
    yield image, list(store.blob_of_file(image, hint).chunks)


__all__ = ["LayerResult", "LayerSource", "Progress", "ProgressFactory", "Source", "Staging", "build_and_push",
           "dir_layer", "parent_source", "resolve_source", "streams", "tar_layer"]
