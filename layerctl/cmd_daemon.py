"""`layerctl daemon`, `prefetch`, `cache ls|verify|evict|gc`, `stats`: the node daemon and the
commands that talk to it over the control socket in its cache directory."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import click

from layerstore import digest as digestmod
from layerstore.errors import BadInput, ConfigError

from .options import emit_json, human_bytes, json_option, metrics_listen_option, store_option

cache_dir_option = click.option("--cache", "cache_dir", required=True, metavar="DIR",
                                type=click.Path(file_okay=False, path_type=Path),
                                help="The node cache directory (local disk); its control socket lives there.")

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024): 512M, 2GiB, 1048576."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"not a size: {text!r} (e.g. 512M, 2G, 1048576)")
    suffix = m.group(2).lower()
    return int(float(m.group(1)) * (1024 ** ("kmgt".index(suffix) + 1) if suffix else 1))


@click.command("daemon")
@store_option
@cache_dir_option
@click.option("--mountpoint", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where to mount; blobs appear as MOUNTPOINT/blobs/<digest>.")
@click.option("--cache-size", default=None, metavar="BYTES",
              help="Disk budget of the cache (e.g. 20G); default: half of the cache filesystem's size.")
@click.option("--high-watermark", default=None, type=float, metavar="FRACTION",
              help="Start evicting above this fraction of --cache-size (default 0.90).")
@click.option("--low-watermark", default=None, type=float, metavar="FRACTION",
              help="Evict down to this fraction of --cache-size (default 0.75).")
@click.option("--record-trace", default=None, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Record the first-access order of chunks per blob to FILE (JSON).")
@click.option("--fetch-deadline", default=None, type=float, metavar="SECONDS",
              help="How long a read retries an unreachable store before EIO (default 10).")
@click.option("--fetch-concurrency", default=None, type=int, metavar="N", help="Parallel chunk fetches (default 16).")
@click.option("--readahead", default=None, type=int, metavar="CHUNKS",
              help="Chunks fetched ahead of a sequential reader (default 16; 0 disables).")
@click.option("--control-group", default=None, metavar="GROUP",
              help="A group whose members may use the control socket (mode 0660) and read blobs through the "
                   "mount (allow_other, blobs 0440); default: root only (socket 0600, blobs 0400, no allow_other).")
@click.option("--cache-format", default=None, type=click.Choice(["plain", "zstd"]),
              help="How a new cache stores chunks: plain, or zstd (compressed as fetched; read through FUSE "
                   "only). Fixed when the cache is created. Default: $LAYERSTORE_CACHE_FORMAT, else plain.")
@metrics_listen_option("LAYERSTORE_NODE_METRICS_LISTEN")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def daemon_cmd(store_url: str | None, cache_dir: Path, mountpoint: Path, cache_size: str | None,
               high_watermark: float | None, low_watermark: float | None, record_trace: Path | None,
               fetch_deadline: float | None, fetch_concurrency: int | None, readahead: int | None,
               control_group: str | None, cache_format: str | None, metrics_listen: str | None, log_level: str) -> None:
    """Serve every blob of the store read-only at MOUNTPOINT/blobs/<digest>, lazily, through
    the node cache. Runs in the foreground until SIGTERM or SIGINT; ready once mounted."""
    from fuse_client.daemon import DaemonConfig, serve

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = DaemonConfig(cache_dir=cache_dir, mountpoint=mountpoint,
                       cache_size=parse_size(cache_size) if cache_size else None,
                       record_trace=record_trace, control_group=control_group, cache_format=cache_format,
                       metrics_listen=metrics_listen)
    for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark),
                        ("fetch_deadline", fetch_deadline), ("fetch_concurrency", fetch_concurrency),
                        ("readahead", readahead)):
        if value is not None:
            setattr(cfg, name, value)
    serve(cfg, store_url)  # (checks the config before mounting: a ConfigError is the CLI's one line)


@click.command("prefetch")
@cache_dir_option
@click.argument("digest")
@click.option("--ranges", "ranges_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="JSON: a list of [offset, length] byte ranges, or an access trace "
                   '({"version": 1, "blobs": {...}}) whose entry for DIGEST gives chunk indexes.')
@click.option("--all", "all_chunks", is_flag=True, help="Every chunk of the blob (metadata first).")
@click.option("--wait", is_flag=True, help="Return when the prefetch has finished.")
@json_option
def prefetch_cmd(cache_dir: Path, digest: str, ranges_file: Path | None, all_chunks: bool, wait: bool,
                 as_json: bool) -> None:
    """Ask the daemon to fetch chunks of blob DIGEST in the background, below demand reads.
    Without --ranges or --all, the blob's metadata chunks."""
    from fuse_client.control import request_json

    digestmod.parse(digest)
    if ranges_file and all_chunks:
        raise ConfigError("--ranges and --all exclude each other")
    req: dict[str, Any] = {"blob": digest, "wait": wait}
    if all_chunks:
        req["all"] = True
    elif ranges_file:
        req.update(_read_ranges(ranges_file, digest))
    res = request_json(cache_dir, "POST", "/prefetch", req, timeout=None if wait else 60.0)
    if as_json:
        emit_json(res)
    elif wait:
        click.echo(f"{digest}: {res['done']} chunk(s) fetched, {res['failed']} failed, of {res['queued']}")
    else:
        click.echo(f"{digest}: {res['queued']} chunk(s) queued")


def _read_ranges(path: Path, digest: str) -> dict[str, Any]:
    from fuse_client.nodecache import parse_trace

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: not JSON: {e}") from None
    if isinstance(data, dict) and "version" in data:
        return {"chunks": parse_trace(data).get(digest, [])}
    if isinstance(data, dict) and "ranges" in data:
        data = data["ranges"]
    if not isinstance(data, list):
        raise BadInput(f"{path}: want a list of [offset, length] ranges or an access trace")
    return {"ranges": data}


@click.group("cache")
def cache_group() -> None:
    """Inspect and maintain a node cache (through its daemon, or directly when none runs)."""


@cache_group.command("ls")
@cache_dir_option
@json_option
def cache_ls_cmd(cache_dir: Path, as_json: bool) -> None:
    """List the blobs in the cache and how much of each is cached."""
    res = _with_daemon_or_offline(cache_dir, "GET", "/cache", None, "ls")
    if as_json:
        emit_json(res)
        return
    budget = res.get("budget")
    click.echo(f"cache {cache_dir}: {human_bytes(res['used_bytes'])} used"
               + (f" of {human_bytes(budget['size'])} ({budget.get('source', 'configured')})" if budget else "")
               + f", {len(res['blobs'])} blob(s)"
               + (f", {human_bytes(res['unverified_bytes'])} not re-verified since the last start"
                  if res.get("unverified_bytes") else ""))
    for b in res["blobs"]:
        click.echo(f"{b['blob']}  {b['cached_chunks']}/{b['chunks']} chunks, "
                   f"{human_bytes(b['cached_bytes'])} of {human_bytes(b['size'])}"
                   + (f", open {b['open']}" if b["open"] else "")
                   + (f", pinned by {', '.join(b['pinned_by'])}" if b.get("pinned_by") else ""))


def _pin_options(fn: Any) -> Any:
    for deco in reversed((cache_dir_option, click.argument("digest"),
                          click.option("--holder", required=True,
                                       help="Who holds the pin (e.g. the mount that uses the file)."),
                          json_option)):
        fn = deco(fn)
    return fn


@cache_group.command("pin")
@_pin_options
def cache_pin_cmd(cache_dir: Path, digest: str, holder: str, as_json: bool) -> None:
    """Pin a complete blob: print the path of its cache file, an EROFS image the daemon will not
    modify until unpinned (mount it file-backed). Exit 3 if the blob is not complete."""
    from fuse_client.control import pin
    from fuse_client.nodecache import BlobIncomplete

    path = pin(cache_dir, digestmod.parse(digest), holder)
    if path is None:
        raise BlobIncomplete(f"blob {digest} is not complete in the node cache {cache_dir}: not pinned")
    if as_json:
        emit_json({"blob": digest, "holder": holder, "complete": True, "path": str(path)})
    else:
        click.echo(str(path))


@cache_group.command("unpin")
@_pin_options
def cache_unpin_cmd(cache_dir: Path, digest: str, holder: str, as_json: bool) -> None:
    """Drop a pin (idempotent); works without a daemon."""
    from fuse_client.control import unpin

    removed = unpin(cache_dir, digestmod.parse(digest), holder)
    if as_json:
        emit_json({"blob": digest, "holder": holder, "removed": removed})
    else:
        click.echo(f"{digest}: {'unpinned' if removed else 'was not pinned'} by {holder}")


@cache_group.command("verify")
@cache_dir_option
@json_option
def cache_verify_cmd(cache_dir: Path, as_json: bool) -> None:
    """Re-hash every committed chunk and drop the bad ones; exit 1 if any was bad."""
    res = _with_daemon_or_offline(cache_dir, "POST", "/cache/verify", {}, "verify")
    if as_json:
        emit_json(res)
    else:
        click.echo(f"{res['checked']} chunk(s) checked, {len(res['bad'])} bad (dropped)")
        for b in res["bad"]:
            click.echo(f"bad: {b['blob']} chunk {b['chunk']} ({b['digest']})")
    if res["bad"]:
        sys.exit(1)


@cache_group.command("evict")
@cache_dir_option
@click.option("--blob", "blob", default=None, metavar="DIGEST", help="Drop every cached chunk of this blob.")
@click.option("--all", "evict_all", is_flag=True, help="Drop every chunk that is not being read.")
@click.option("--to", "to_bytes", default=None, metavar="BYTES", help="Drop LRU chunks until usage <= BYTES.")
@json_option
def cache_evict_cmd(cache_dir: Path, blob: str | None, evict_all: bool, to_bytes: str | None, as_json: bool) -> None:
    """Evict chunks (default: least recently used, down to the daemon's low watermark)."""
    if sum(x is not None and x is not False for x in (blob, evict_all or None, to_bytes)) > 1:
        raise ConfigError("--blob, --all and --to exclude each other")
    req: dict[str, Any] = {}
    if blob:
        req["blob"] = digestmod.parse(blob)
    elif evict_all:
        req["all"] = True
    elif to_bytes is not None:
        req["to_bytes"] = parse_size(to_bytes)
    res = _with_daemon_or_offline(cache_dir, "POST", "/cache/evict", req, "evict")
    if as_json:
        emit_json(res)
    else:
        held = res.get("protected_bytes") or 0
        click.echo(f"evicted {res['evicted_chunks']} chunk(s), {human_bytes(res['evicted_bytes'])}; "
                   f"{human_bytes(res['used_bytes'])} used"
                   + (f" ({human_bytes(held)} of it in attached blobs, not evictable while mounted)" if held else ""))
        if res.get("skipped"):
            click.echo(f"skipped: {res['skipped']}")


@cache_group.command("gc")
@cache_dir_option
@click.option("--older-than", "older_than", default="1d", show_default=True, metavar="DURATION",
              help="Forget blobs not used for this long (90s, 30m, 12h, 1d2h, 1w).")
@click.option("--dry-run", is_flag=True, help="Say what would be forgotten; change nothing.")
@json_option
def cache_gc_cmd(cache_dir: Path, older_than: str, dry_run: bool, as_json: bool) -> None:
    """Forget cached blobs that nothing on the node uses (no mount, no pin, no open file) and
    that were not used for longer than --older-than: their chunks, map and data file. Through
    the daemon when it runs, else directly (docs/gc.md, the node side). Watermark eviction is separate."""
    from layergc.retention import parse_duration

    from fuse_client.control import DaemonNotRunning, request_json
    from fuse_client.nodecache import maintenance

    seconds = parse_duration(older_than)
    try:
        res = request_json(cache_dir, "POST", "/cache/gc", {"older_than": seconds, "dry_run": dry_run}, timeout=None)
    except DaemonNotRunning:
        res = maintenance.gc_offline(cache_dir, older_than=seconds, dry_run=dry_run)
    if as_json:
        emit_json(res)
        return
    verb = "would forget" if dry_run else "forgot"
    click.echo(f"{verb} {res['dropped_blobs']} blob(s), {human_bytes(res['dropped_bytes'])}; kept "
               f"{res['kept_in_use']} in use, {res['kept_recent']} used in the last {older_than}")
    for d in res["dropped"]:
        click.echo(f"{d['blob']}  {human_bytes(d['bytes'])}")


def _with_daemon_or_offline(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None,
                            what: str) -> Any:
    from fuse_client.control import DaemonNotRunning, request_json
    from fuse_client.nodecache import maintenance

    try:
        return request_json(cache_dir, method, path, body, timeout=None)
    except DaemonNotRunning:
        pass
    if what == "ls":
        return maintenance.ls(cache_dir)
    if what == "verify":
        return maintenance.verify(cache_dir)
    req = body or {}
    return maintenance.evict_offline(cache_dir, blob=req.get("blob"), all_chunks=bool(req.get("all")),
                                     to_bytes=req.get("to_bytes"))


@click.command("stats")
@cache_dir_option
@json_option
def stats_cmd(cache_dir: Path, as_json: bool) -> None:
    """What the daemon fetched and served, per blob, since it started."""
    from fuse_client.control import request_json

    res = request_json(cache_dir, "GET", "/stats")
    if as_json:
        emit_json(res)
        return
    click.echo(f"corrupt chunks: {res['corrupt_chunks']}, store errors: {res['store_errors']}")
    for blob, s in res["blobs"].items():
        click.echo(f"{blob}  size {human_bytes(s['size'])}, fetched {human_bytes(s['fetched_bytes'])}, "
                   f"served {human_bytes(s['served_bytes'])}, {s['hits']} hits, {s['misses']} misses")


def register(cli: click.Group) -> None:
    for cmd in (daemon_cmd, prefetch_cmd, cache_group, stats_cmd):
        cli.add_command(cmd)
