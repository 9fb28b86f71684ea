"""`layerctl store ...`: initialise, fill, read, list and verify a store."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from layerstore.errors import LayerstoreError, NotFound, PermissionDenied
from layerstore.store import Store

from .options import emit_json, human_bytes, json_option, store_option


def open_store(url: str | None, *, check: bool = True) -> Store:
    store = Store.open(url)
    if check:
        store.check()
    return store


@click.group("store")
def store_group() -> None:
    """Manage a content-addressed store."""


@store_group.command("init")
@store_option
def init_cmd(store_url: str | None) -> None:
    """Create the store if needed (idempotent)."""
    with open_store(store_url, check=False) as store:
        created = store.init()
        store.check()
        click.echo(f"{'initialised' if created else 'already initialised'}: {store.url}")


@store_group.command("put-blob")
@store_option
@json_option
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def put_blob_cmd(store_url: str | None, as_json: bool, file: Path) -> None:
    """Store FILE as a blob of fixed-size chunks; print its digest."""
    with open_store(store_url) as store:
        res = store.put_blob(file)
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(f"{res.blob}  {human_bytes(res.size)} in {res.chunks} chunks, "
                   f"{human_bytes(res.new_bytes)} new")


@store_group.command("get-blob")
@store_option
@click.argument("digest")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def get_blob_cmd(store_url: str | None, digest: str, out: Path) -> None:
    """Write the verified blob DIGEST to OUT (or '-' for stdout)."""
    from layerstore import digest as digestmod

    digestmod.parse(digest)
    with open_store(store_url) as store:
        if str(out) == "-":
            _get_to_stdout(store, digest)
            return
        tmp = out.with_name(f".{out.name}.part-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise PermissionDenied(f"cannot write {out}: {os.strerror(e.errno or 0)}") from None
        try:
            try:
                store.read_blob(digest, fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _get_to_stdout(store: Store, digest: str) -> None:
    import tempfile

    # Verification needs the whole blob before anything is trusted, so stage it first.
    with tempfile.TemporaryFile() as f:
        store.read_blob(digest, f.fileno())
        f.seek(0)
        while buf := f.read(1 << 20):
            sys.stdout.buffer.write(buf)
    sys.stdout.buffer.flush()


@store_group.command("ls")
@store_option
@json_option
def ls_cmd(store_url: str | None, as_json: bool) -> None:
    """List the blobs, manifests and tags in the store."""
    with open_store(store_url) as store:
        blobs = []
        for blob in store.list_digests("blobs"):
            try:
                cm = store.get_chunk_map(blob)
            except LayerstoreError:
                blobs.append({"blob": blob, "size": None, "chunks": None, "corrupt": True})
                continue
            blobs.append({"blob": blob, "size": cm.size, "chunks": len(cm.chunks)})
        manifests = list(store.list_digests("manifests"))
        tags = store.tags()
        chunk_count = sum(1 for _ in store.list_digests("chunks"))
    if as_json:
        emit_json({"blobs": blobs, "manifests": manifests, "tags": tags, "chunks": chunk_count})
        return
    click.echo(f"store {store.url}: {len(blobs)} blobs, {len(manifests)} manifests, "
               f"{len(tags)} tags, {chunk_count} chunks")
    for b in blobs:
        size = "corrupt" if b.get("corrupt") else f"{human_bytes(b['size'])}, {b['chunks']} chunks"
        click.echo(f"blob      {b['blob']}  {size}")
    for m in manifests:
        click.echo(f"manifest  {m}")
    for ref, m in sorted(tags.items()):
        click.echo(f"tag       {ref} -> {m}")


@store_group.command("migrate")
@store_option
@json_option
def migrate_cmd(store_url: str | None, as_json: bool) -> None:
    """Re-key the chunk maps an older layerstore wrote (blob id = blake3 of the whole blob)
    under the ids their chunk lists give them, each only after the whole blob was read back and
    matched its old id. Manifests naming old ids must be re-created (and re-signed)."""
    moved: dict[str, str] = {}
    refused: dict[str, str] = {}
    with open_store(store_url) as store:
        for blob in list(store.list_digests("blobs")):
            try:
                new = store.migrate_chunk_map(blob)
            except LayerstoreError as e:
                refused[blob] = str(e)
                continue
            if new is not None:
                moved[blob] = new
    if as_json:
        emit_json({"migrated": moved, "refused": refused})
    else:
        for old, new in sorted(moved.items()):
            click.echo(f"migrated  {old} -> {new}")
        for old, why in sorted(refused.items()):
            click.echo(f"refused   {old}: {why}")
        click.echo(f"{len(moved)} chunk map(s) migrated, {len(refused)} refused")
    if refused:
        sys.exit(4)


@store_group.command("verify")
@store_option
@json_option
def verify_cmd(store_url: str | None, as_json: bool) -> None:
    """Re-read and check every object; exit 1 if anything is corrupt."""
    with open_store(store_url) as store:
        report = store.verify()
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(f"{report.objects} objects checked, {len(report.corrupt)} corrupt")
        for key in sorted(report.corrupt):
            click.echo(f"corrupt: {key}")
    if report.corrupt:
        sys.exit(1)


def register(cli: click.Group) -> None:
    cli.add_command(store_group)


__all__ = ["register", "open_store", "NotFound"]
