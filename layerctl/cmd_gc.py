"""`layerctl gc`, `layerctl lease ...`, `layerctl tag rm` and `layerctl env rm`: reclaiming the
store (docs/gc.md)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import click

from layerstore import digest as digestmod
from layerstore import keys, leases
from layerstore.errors import ConfigError, NotFound
from layerstore.store import Store

from .cmd_env import env_group
from .cmd_store import open_store
from .options import emit_json, human_bytes, json_option, store_option


# -- gc ---------------------------------------------------------------------------------------------
@click.command("gc")
@store_option
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@click.option("--grace", default="1h", show_default=True, metavar="DURATION",
              help="Keep objects written more recently than this (e.g. 90s, 15m, 2h, 7d).")
@click.option("--keep-last", type=click.IntRange(min=0), default=None, metavar="N",
              help="Retention: keep the N most recently written tags of each environment name; remove the others.")
@click.option("--keep-newer-than", default=None, metavar="DURATION",
              help="Retention: keep tags written more recently than this; remove the others.")
@click.option("--keep", "keep_patterns", multiple=True, metavar="PATTERN",
              help="Retention: tags matching NAME:TAG shell pattern are kept forever; repeat.")
@json_option
def gc_cmd(store_url: str | None, dry_run: bool, grace: str, keep_last: int | None, keep_newer_than: str | None,
           keep_patterns: tuple[str, ...], as_json: bool) -> None:
    """Remove tags the retention policy drops, then every object no tag, lease or node still
    reaches and that is older than the grace period."""
    from layergc import RetentionPolicy, collect, parse_duration

    policy = RetentionPolicy(keep_last, None if keep_newer_than is None else parse_duration(keep_newer_than),
                             keep_patterns)
    with open_store(store_url) as store, _progress(not as_json and sys.stderr.isatty()) as tick:
        report = collect(store, grace=parse_duration(grace), dry_run=dry_run,
                         policy=policy if policy.removes_anything else None, progress=tick)
    if as_json:
        emit_json(report.to_json())
        return
    what = "would delete" if dry_run else "deleted"
    for ref in report.tags_removed:
        click.echo(f"{'would remove' if dry_run else 'removed'} tag {ref}")
    click.echo(f"listed   {report.listed.objects} objects, {human_bytes(report.listed.bytes)}")
    click.echo(f"marked   {report.marked.objects} objects, {human_bytes(report.marked.bytes)}")
    click.echo(f"kept     {report.kept_grace.objects} by grace, {report.kept_lease.objects} by leases, "
               f"{report.rescued.objects} rescued while sweeping")
    click.echo(f"{what:<8} {report.deleted.objects} objects, {human_bytes(report.deleted.bytes)}")
    click.echo("phases   " + ", ".join(f"{k} {v:.2f} s" for k, v in report.phases.items()))
    if report.missing_count:
        click.echo(f"warning: {report.missing_count} referenced object(s) are missing, e.g. {report.missing[0]} "
                   "(run `layerctl store verify`)", err=True)


@contextlib.contextmanager
def _progress(show: bool) -> Iterator[Any]:
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<6}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True, console=None) as bar:
        tasks: dict[str, Any] = {}

        def tick(phase: str, done: int, total: int | None) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield tick


# -- leases ---------------------------------------------------------------------------------------
@click.group("lease")
def lease_group() -> None:
    """Hold objects against the garbage collector for a while."""


def _object_key(store: Store, ref: str) -> str:
    """NAME:TAG -> its manifest; a digest -> whichever stored manifest, chunk map or chunk it names."""
    if not ref.startswith("b3:"):
        return keys.object_key("manifests", store.get_tag(ref))
    digest = digestmod.parse(ref)
    for kind in ("manifests", "blobs", "chunks"):
        key = keys.object_key(kind, digest)
        if store.backend.exists(key):
            return key
    raise NotFound(f"{ref} is not in store {store.url}")


@lease_group.command("create")
@store_option
@click.argument("name")
@click.argument("refs", nargs=-1, required=True, metavar="NAME:TAG|DIGEST...")
@click.option("--ttl", default="1h", show_default=True, metavar="DURATION", help="How long the lease holds.")
@json_option
def lease_create_cmd(store_url: str | None, name: str, refs: tuple[str, ...], ttl: str, as_json: bool) -> None:
    """Hold environments (NAME:TAG) or objects (DIGEST) under lease NAME for --ttl."""
    from layergc import parse_duration

    _check_lease_name(name)
    with open_store(store_url) as store:
        held = sorted({_object_key(store, r) for r in refs})
        lease = leases.Lease(store.backend, kind="operator", name=name, lease_id=name,
                             ttl=parse_duration(ttl), renew=False).open(held)
        # Held first, then: no sweep that may delete one of them is still running, and they are all there.
        leases.wait_out(store.backend, leases.conflicting_sweeps(store.backend, held))
        gone = [k for k in held if not store.backend.exists(k)]
        if gone:
            store.backend.delete_many(leases.lease_keys(store.backend, lease.id))
            raise NotFound(f"{gone[0]} was collected before the lease took hold; lease not created")
    if as_json:
        emit_json({"lease": name, "objects": len(held), "expires": time.time() + parse_duration(ttl)})
    else:
        click.echo(f"lease {name}: {len(held)} object(s) held for {ttl}")


def _check_lease_name(name: str) -> None:
    try:
        keys.validate(name)
    except ConfigError:
        raise ConfigError(f"bad lease name {name!r} (letters, digits and ._-+=@: only)") from None
    if "/" in name or name.startswith(("push-", "node-", "gc-")):
        raise ConfigError(f"bad lease name {name!r} (no '/'; push-, node- and gc- are the system's)")


@lease_group.command("ls")
@store_option
@json_option
def lease_ls_cmd(store_url: str | None, as_json: bool) -> None:
    """List leases: who holds how many objects until when."""
    now = time.time()
    with open_store(store_url) as store:
        found = list(leases.read_leases(store.backend))
    if as_json:
        emit_json([{**lease.to_json(), "live": lease.live(now)} for lease in found])
        return
    for lease in found:
        left = lease.expires - now
        state = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
        click.echo(f"{lease.id:<40} {lease.kind:<9} {len(lease.keys):>8} objects  {state}  {lease.holder}")


@lease_group.command("rm")
@store_option
@click.argument("name")
def lease_rm_cmd(store_url: str | None, name: str) -> None:
    """Release lease NAME."""
    with open_store(store_url) as store:
        found = leases.lease_keys(store.backend, keys.validate(name))
        if not found:
            raise NotFound(f"no lease {name} in store {store.url}")
        store.backend.delete_many(sorted(found, key=lambda k: not k.endswith("/head")))  # head first
    click.echo(f"released lease {name}")


# -- tags and environments -----------------------------------------------------------------------
@click.group("tag")
def tag_group() -> None:
    """Tags: names of environments (NAME:TAG)."""


@tag_group.command("rm")
@store_option
@click.argument("refs", nargs=-1, required=True, metavar="NAME:TAG...")
def tag_rm_cmd(store_url: str | None, refs: tuple[str, ...]) -> None:
    """Remove tags. What they kept alive goes at the next `layerctl gc` (after the grace period)."""
    from manifest.environment import check_environment_tag

    with open_store(store_url) as store:
        for ref in refs:
            store.delete_tag(check_environment_tag(ref))
            click.echo(f"removed tag {ref}")


@click.command("rm")
@store_option
@click.argument("names", nargs=-1, required=True, metavar="NAME[:TAG]...")
def env_rm_cmd(store_url: str | None, names: tuple[str, ...]) -> None:
    """Remove environments: NAME:TAG, or every tag of NAME."""
    from manifest.environment import check_environment_tag, list_environments

    with open_store(store_url) as store:
        envs = list_environments(store)
        for name in names:
            if ":" in name:
                refs = [check_environment_tag(name)]
            else:
                refs = sorted(r for r in envs if r.rpartition(":")[0] == name)
                if not refs:
                    raise NotFound(f"no environment named {name} in store {store.url}")
            for ref in refs:
                store.delete_tag(ref)
                click.echo(f"removed tag {ref}")


def register(cli: click.Group) -> None:
    cli.add_command(gc_cmd)
    cli.add_command(lease_group)
    cli.add_command(tag_group)
    env_group.add_command(env_rm_cmd)
