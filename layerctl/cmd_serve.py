"""`layerctl serve`: the HTTP store service in front of a store, and its tokens (docs/service.md)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from layerstore.errors import ConfigError, NotFound

from .options import emit_json, json_option, store_option

tokens_option = click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False, path_type=Path),
                             help="The tokens file (JSON; see `layerctl serve token add`).")


def parse_listen(listen: str) -> dict[str, object]:
    """HOST:PORT, [V6]:PORT or unix:PATH -> uvicorn's arguments."""
    if listen.startswith("unix:"):
        path = listen[5:]
        if not path:
            raise ConfigError("--listen unix:PATH needs a path")
        return {"uds": os.path.abspath(path)}
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen wants HOST:PORT or unix:PATH, not {listen!r}")
    return {"host": host.strip("[]") or "127.0.0.1", "port": int(port)}


def is_local(bind: dict[str, object]) -> bool:
    """Only this machine can connect (a Unix socket, a loopback address)."""
    host = bind.get("host")
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        return False


@click.group("serve", invoke_without_command=True)
@store_option
@click.option("--listen", default="127.0.0.1:8470", show_default=True, metavar="HOST:PORT|unix:PATH",
              help="Where to listen.")
@tokens_option
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True, path_type=Path), help="PEM certificate.")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True, path_type=Path), help="PEM private key.")
@click.option("--workers", type=int, default=2, show_default=True, help="uvicorn worker processes.")
@click.option("--body-timeout", type=float, default=None,
              help="Seconds a request body may take to arrive (default 120); slower is a 408.")
@click.option("--max-connections", type=int, default=None,
              help="Open connections per worker (default 4096, kept below the file limit); at the cap a new "
                   "connection closes the least recently active idle one.")
@click.option("--header-timeout", type=float, default=None,
              help="Seconds a connection may take to send a request's headers (default 10); slower is closed.")
@click.option("--idle-timeout", type=float, default=None,
              help="Seconds an idle keep-alive connection stays open (default 15).")
@click.option("--max-inflight", type=int, default=None,
              help="Requests in progress per token and worker (default 64; 0: no limit); more are a 429.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@click.pass_context
def serve_group(ctx: click.Context, store_url: str | None, listen: str, tokens_file: Path | None,
                tls_cert: Path | None, tls_key: Path | None, workers: int, body_timeout: float | None,
                max_connections: int | None, header_timeout: float | None, idle_timeout: float | None,
                max_inflight: int | None, log_level: str) -> None:
    """Serve the store over HTTP (FastAPI on uvicorn) until SIGTERM or SIGINT. Clients use the
    store URL http(s)://HOST:PORT with a token ($LAYERSTORE_TOKEN or a credentials file)."""
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn

    from layerstore.config import resolve_store_url
    from layerstore.store import Store
    from service import connections
    from service.app import BODY_TIMEOUT_ENV, STORE_ENV, TOKENS_ENV
    from service.inflight import MAX_INFLIGHT_ENV

    bind = parse_listen(listen)
    if workers < 1:
        raise ConfigError("--workers must be at least 1")
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if tokens_file is None and not is_local(bind):
        raise ConfigError("--tokens is required to listen beyond loopback (without it every request is admin)")
    if tokens_file is not None and not tokens_file.exists():
        raise NotFound(f"tokens file {tokens_file} does not exist (create it with `layerctl serve token add`)")
    url = resolve_store_url(store_url)
    Store.open(url).close()  # a malformed URL fails here, not in every worker
    os.environ[STORE_ENV] = url
    os.environ[TOKENS_ENV] = str(tokens_file.resolve()) if tokens_file else ""
    if body_timeout is not None:
        if body_timeout <= 0:
            raise ConfigError("--body-timeout must be positive")
        os.environ[BODY_TIMEOUT_ENV] = str(body_timeout)
    limits = {connections.MAX_CONNECTIONS_ENV: (max_connections, 1, "--max-connections"),
              connections.HEADER_TIMEOUT_ENV: (header_timeout, 1e-9, "--header-timeout"),
              MAX_INFLIGHT_ENV: (max_inflight, 0, "--max-inflight")}
    for env, (value, least, flag) in limits.items():
        if value is not None:
            if value < least:
                raise ConfigError(f"{flag} must be at least {least:g}" if least >= 1 else f"{flag} must be positive")
            os.environ[env] = str(value)
    if idle_timeout is not None and idle_timeout <= 0:
        raise ConfigError("--idle-timeout must be positive")
    connections.raise_nofile()  # the workers inherit it
    # Several workers sum their counts through files in a fresh directory; one worker is this
    # process, whose metrics may already exist in memory (prometheus-client picks its mode when it is
    # first imported), so it counts in memory and exposes its own registry.
    metrics_dir = tempfile.mkdtemp(prefix="layerstore-metrics-") if workers > 1 else None
    if metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    else:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if "uds" in bind:
        Path(str(bind["uds"])).unlink(missing_ok=True)
    try:
        uvicorn.run("service.app:app_from_env", factory=True, workers=workers, log_level=log_level,
                    ssl_certfile=str(tls_cert) if tls_cert else None, ssl_keyfile=str(tls_key) if tls_key else None,
                    timeout_graceful_shutdown=10, server_header=False, access_log=log_level == "debug",
                    http="service.connections:GuardedHttp", loop="service.connections:guarded_loop",
                    backlog=connections.BACKLOG,
                    timeout_keep_alive=idle_timeout or connections.DEFAULT_IDLE_TIMEOUT,  # type: ignore[arg-type]
                    **bind)  # type: ignore[arg-type]
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    sys.exit(0)


@serve_group.group("token")
def token_group() -> None:
    """Manage the service's tokens (stored hashed in the tokens file)."""


def _tokens(path: Path | None) -> Path:
    if path is None:
        raise ConfigError("--tokens FILE is required")
    return path


@token_group.command("add")
@tokens_option
@click.option("--scope", "scopes", multiple=True, required=True,
              help="read, read:PREFIX, push:PREFIX, push:*, lease, gc or admin (repeatable).")
@click.argument("token_id")
def token_add(tokens_file: Path | None, scopes: tuple[str, ...], token_id: str) -> None:
    """Create token TOKEN_ID with SCOPEs; print the token (shown once, stored hashed)."""
    from service.auth import load_token_file, save_token_file

    path = _tokens(tokens_file)
    tf = load_token_file(path)
    token = tf.add(token_id, list(scopes))
    save_token_file(path, tf)
    click.echo(token)


@token_group.command("rm")
@tokens_option
@click.argument("token_id")
def token_rm(tokens_file: Path | None, token_id: str) -> None:
    """Revoke token TOKEN_ID (every instance sharing the file stops accepting it at once)."""
    from service.auth import load_token_file, save_token_file

    path = _tokens(tokens_file)
    tf = load_token_file(path)
    if not tf.remove(token_id):
        raise NotFound(f"no token {token_id!r} in {path}")
    save_token_file(path, tf)


@token_group.command("ls")
@tokens_option
@json_option
def token_ls(tokens_file: Path | None, as_json: bool) -> None:
    """The tokens (ids and scopes; never the secrets), the private name prefixes, anonymous scopes."""
    from service.auth import load_token_file

    tf = load_token_file(_tokens(tokens_file))
    rows = [{"id": t["id"], "scopes": t.get("scopes", []), "created": t.get("created")} for t in tf.tokens]
    if as_json:
        emit_json({"tokens": rows, "private": tf.private, "anonymous": tf.anonymous})
        return
    for r in rows:
        click.echo(f"{r['id']}\t{' '.join(r['scopes'])}\t{r['created'] or ''}")
    if tf.private:
        click.echo(f"private names: {' '.join(tf.private)}")
    if tf.anonymous:
        click.echo(f"anonymous: {' '.join(tf.anonymous)}")


@token_group.command("private")
@tokens_option
@click.option("--add", "add", multiple=True, metavar="PREFIX", help="Mark names under PREFIX private.")
@click.option("--remove", "remove", multiple=True, metavar="PREFIX")
def token_private(tokens_file: Path | None, add: tuple[str, ...], remove: tuple[str, ...]) -> None:
    """Private environment names: only read:/push: scopes naming a covering prefix (and gc, admin)
    see them."""
    from service.auth import load_token_file, save_token_file

    path = _tokens(tokens_file)
    tf = load_token_file(path)
    tf.private = sorted((set(tf.private) | {p for p in add if p}) - set(remove))
    save_token_file(path, tf)


@token_group.command("anonymous")
@tokens_option
@click.argument("scopes", nargs=-1)
def token_anonymous(tokens_file: Path | None, scopes: tuple[str, ...]) -> None:
    """What requests without a token may do (none by default; e.g. `read` for a public store)."""
    from service.auth import check_scopes, load_token_file, save_token_file

    path = _tokens(tokens_file)
    tf = load_token_file(path)
    tf.anonymous = check_scopes(scopes)
    save_token_file(path, tf)


def register(cli: click.Group) -> None:
    cli.add_command(serve_group)
