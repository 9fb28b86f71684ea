"""`layerctl mount|umount|run|sandbox|commit|recover`: the runtime shim's commands (container backend)."""

from __future__ import annotations

import sys
from typing import Any

import click

from .options import emit_json, json_option, store_option

node_dir_option = click.option(
    "--node-dir", "node_dir", metavar="DIR", default=None, envvar="LAYERSTORE_NODE_DIR",
    help="The node directory (daemon cache and mount, layer mounts, sandboxes, state). "
         "Default: $LAYERSTORE_NODE_DIR, else /var/lib/layerstore.")
policy_option = click.option("--policy", "policy", metavar="FILE", default=None,
                             help="Trust policy JSON (default: NODE/policy.json when present).")
eager_option = click.option("--eager", is_flag=True, help="Fetch every chunk of the environment before mounting.")
sandbox_option = click.option("--sandbox", "sandbox", metavar="ID", default=None,
                              help="The sandbox id (default: a fresh one).")


def _shim(node_dir: str | None, store_url: str | None = None, policy: str | None = None) -> Any:
    from runtime_shim.shim import Shim

    return Shim.for_node(node_dir, store_url, policy=policy)


def _sandbox_json(sb: Any) -> dict[str, Any]:
    return {"sandbox": sb.id, "env": sb.env, "manifest": sb.manifest, "target": sb.target, "upper": sb.upper,
            "status": sb.status, "layers": sb.layers, "owned_upper": sb.owned, "error": sb.error,
            "created": sb.created}


@click.command("mount")
@store_option
@node_dir_option
@policy_option
@eager_option
@sandbox_option
@click.option("--upper", metavar="DIR", default=None,
              help="Use this upper directory (resume); it is the caller's and is never deleted.")
@json_option
@click.argument("env")
@click.argument("target", type=click.Path(file_okay=False))
def mount_cmd(store_url: str | None, node_dir: str | None, policy: str | None, eager: bool, sandbox: str | None,
              upper: str | None, as_json: bool, env: str, target: str) -> None:
    """Mount the root filesystem of a new sandbox of ENV (NAME:TAG or b3:...) on TARGET."""
    with _shim(node_dir, store_url, policy) as shim:
        sb = shim.mount(env, target, sandbox=sandbox, upper=upper, eager=eager)
    if as_json:
        emit_json(_sandbox_json(sb))
    else:
        click.echo(f"{sb.id} {sb.target}")


@click.command("umount")
@node_dir_option
@click.argument("target")
def umount_cmd(node_dir: str | None, target: str) -> None:
    """Unmount a sandbox root (by TARGET path or sandbox id) and tear the sandbox down."""
    with _shim(node_dir) as shim:
        shim.unmount(target)


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@store_option
@node_dir_option
@policy_option
@eager_option
@sandbox_option
@click.option("--keep", is_flag=True, help="Leave the sandbox mounted after the command (for commit).")
@click.option("--runtime", type=click.Choice(["runc", "crun"]), default="runc", show_default=True,
              help="The OCI runtime.")
@click.option("-e", "--env", "extra_env", multiple=True, metavar="KEY=VALUE", help="Extra environment variable.")
@click.argument("env")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_cmd(store_url: str | None, node_dir: str | None, policy: str | None, eager: bool, sandbox: str | None,
            keep: bool, runtime: str, extra_env: tuple[str, ...], env: str, command: tuple[str, ...]) -> None:
    """Run COMMAND (default: the environment's) in a new sandbox of ENV; exit with its exit code.

    \b
    layerctl run NAME:TAG -- sh -c 'echo hello'"""
    from layerstore.errors import ConfigError
    from runtime_shim import runner

    if command[:1] == ("--",):  # click keeps the separator once positional parsing has begun
        command = command[1:]
    for item in extra_env:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"--env: want KEY=VALUE, got {item!r}")
    with _shim(node_dir, store_url, policy) as shim:
        res = runner.run(shim, env, list(command) or None, sandbox=sandbox, eager=eager, keep=keep,
                         runtime=runtime, extra_env=extra_env)
    if keep:
        click.echo(f"layerctl: sandbox {res.sandbox} kept", err=True)
    sys.exit(res.exit_code)


@click.group("sandbox")
def sandbox_group() -> None:
    """Sandboxes on this node."""


@sandbox_group.command("ls")
@node_dir_option
@json_option
def sandbox_ls_cmd(node_dir: str | None, as_json: bool) -> None:
    """List the sandboxes on this node."""
    with _shim(node_dir) as shim:
        sbs = sorted(shim.sandboxes(), key=lambda s: s.created)
        refs = shim.layer_refs()
    if as_json:
        emit_json({"sandboxes": [_sandbox_json(sb) for sb in sbs], "layers": refs})
        return
    for sb in sbs:
        click.echo(f"{sb.id}  {sb.status:9}  {sb.env or sb.manifest or '-'}  {sb.target}")


@sandbox_group.command("rm")
@node_dir_option
@click.argument("sandbox")
def sandbox_rm_cmd(node_dir: str | None, sandbox: str) -> None:
    """Unmount and remove SANDBOX (its shim-created upper goes with it)."""
    with _shim(node_dir) as shim:
        shim.unmount(sandbox)


@click.command("commit")
@store_option
@node_dir_option
@click.option("-t", "--tag", "tag", required=True, metavar="NAME:TAG", help="The new environment's tag.")
@json_option
@click.argument("sandbox")
def commit_cmd(store_url: str | None, node_dir: str | None, tag: str, as_json: bool, sandbox: str) -> None:
    """Commit SANDBOX's writes as a new layer; tag the environment with it on top.

    A container still running in SANDBOX is frozen (paused) while its files are read."""
    from layerstore.store import Store
    from runtime_shim.commit import commit

    with _shim(node_dir, store_url) as shim:
        sb = shim.find(sandbox)
        with Store.open(store_url or shim.store_url) as store:
            store.check()
            res = commit(store, sb, tag, backends=shim.backends.values())  # a running workload is frozen
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(f"{res.tag} -> {res.manifest} (layer {res.layer}, {res.files} paths)")


@click.command("recover")
@node_dir_option
@json_option
def recover_cmd(node_dir: str | None, as_json: bool) -> None:
    """Rebuild the node's mounts after a crash of the shim or the daemon (also runs on every start)."""
    from runtime_shim.shim import Shim

    with Shim.for_node(node_dir, auto_recover=False) as shim:
        rep = shim.recover()
    if as_json:
        emit_json(rep.to_json())
        return
    if rep.rebooted:
        click.echo("the state belonged to an earlier boot: rebuilt from the sandboxes' record files")
    click.echo(f"recovered: {len(rep.remounted_sandboxes)} sandbox(es) and {len(rep.remounted_layers)} layer(s) "
               f"remounted, {len(rep.finished_teardowns)} teardown(s) finished, {len(rep.rolled_back)} interrupted "
               f"mount(s) rolled back, {len(rep.orphan_mounts)} orphan mount(s) removed, {len(rep.adopted)} "
               f"sandbox(es) rebuilt from records, {len(rep.deleted_containers)} leftover container(s) deleted")
    for sid, why in sorted(rep.broken.items()):
        click.echo(f"broken: {sid}: {why}")
    for sid in rep.unrecorded:
        click.echo(f"unrecorded: {sid}: a sandbox directory without a readable record (left as it is)")


@click.group("node")
def node_group() -> None:
    """This node's daemon."""


@node_group.command("stop")
@node_dir_option
def node_stop_cmd(node_dir: str | None) -> None:
    """Stop the node daemon (refused while sandboxes are mounted)."""
    from runtime_shim.shim import Shim

    with Shim.for_node(node_dir, auto_recover=False) as shim:
        stopped = shim.stop_daemon()
    click.echo("node daemon stopped" if stopped else "no node daemon running")


def register(cli: click.Group) -> None:
    for cmd in (mount_cmd, umount_cmd, run_cmd, sandbox_group, commit_cmd, recover_cmd, node_group):
        cli.add_command(cmd)
