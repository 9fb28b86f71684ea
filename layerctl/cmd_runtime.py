"""`layerctl mount|umount|run|sandbox|commit|recover`: the runtime shim's commands (container,
microVM and VM backends)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import click

from .options import emit_json, json_option, store_option

node_dir_option = click.option(
    "--node-dir", "node_dir", metavar="DIR", default=None, envvar="LAYERSTORE_NODE_DIR",
    help="The node directory (daemon cache and mount, layer mounts, sandboxes, state). "
         "Default: $LAYERSTORE_NODE_DIR, else /var/lib/layerstore.")
policy_option = click.option("--policy", "policy", metavar="FILE", default=None,
                             help="Trust policy JSON; it combines with NODE/policy.json (only tightens it).")
eager_option = click.option("--eager", is_flag=True, help="Fetch every chunk of the environment before mounting.")
sandbox_option = click.option("--sandbox", "sandbox", metavar="ID", default=None,
                              help="The sandbox id (default: a fresh one).")


@contextlib.contextmanager
def _shim(node_dir: str | None, store_url: str | None = None, policy: str | None = None) -> Iterator[Any]:
    """The node's shim, with SIGTERM and SIGHUP stopping a command as SIGINT does (raised as
    `signals.Stopped`, a KeyboardInterrupt: the shim's clean-ups run, the CLI exits 130)."""
    from runtime_shim.backends import signals
    from runtime_shim.node.shim import Shim

    with signals.stopping(), Shim.for_node(node_dir, store_url, policy=policy) as shim:
        yield shim


def _sandbox_json(sb: Any) -> dict[str, Any]:
    return {"sandbox": sb.id, "env": sb.env, "manifest": sb.manifest, "target": sb.target, "upper": sb.upper,
            "status": sb.status, "layers": sb.layers, "owned_upper": sb.owned, "error": sb.error,
            "created": sb.created, "backend": sb.backend or "container", "lost": sb.lost}


@click.command("mount")
@store_option
@node_dir_option
@policy_option
@eager_option
@sandbox_option
@click.option("--upper", metavar="DIR", default=None,
              help="Use this upper directory (resume); it is the caller's and is never deleted.")
@click.option("--upper-size", default=None, metavar="SIZE",
              help="The quota of the sandbox's own upper: a sparse image of SIZE on the node disk, e.g. 10G "
                   "(0: none); refused (exit 2) when the disk's free space cannot hold it and the other kept "
                   "uppers. Default: the node's (10G). Not with --upper.")
@json_option
@click.argument("env")
@click.argument("target", type=click.Path(file_okay=False))
def mount_cmd(store_url: str | None, node_dir: str | None, policy: str | None, eager: bool, sandbox: str | None,
              upper: str | None, upper_size: str | None, as_json: bool, env: str, target: str) -> None:
    """Mount the root filesystem of a new sandbox of ENV (NAME:TAG or b3:...) on TARGET."""
    from runtime_shim.node.request import MountRequest
    from runtime_shim.sandbox.runner import kept_upper_image

    from .cmd_daemon import parse_size

    with _shim(node_dir, store_url, policy) as shim:
        image = None if upper else kept_upper_image(shim.paths, parse_size(upper_size) if upper_size else None)
        sb = shim.mount(MountRequest(env, target, sandbox=sandbox, upper=upper, eager=eager, upper_image=image))
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
@click.option("--backend", type=click.Choice(["container", "microvm", "vm"]), default="container",
              show_default=True,
              help="What runs the sandbox: a container (runc/crun), a microVM whose guest stacks a read-only drive "
                   "per layer, or a full VM (q35) whose root is one flattened device over the layers, or with "
                   "--layer-device pmem a virtio-pmem device per layer (QEMU; KVM where it works, else TCG).")
@click.option("--runtime", type=click.Choice(["runc", "crun"]), default="runc", show_default=True,
              help="The OCI runtime (container backend).")
@click.option("--layer-device", type=click.Choice(["blk", "pmem"]), default=None,
              help="How a VM gets its layers. blk (the default): virtio-blk, fetched lazily: a drive per layer "
                   "(microvm), or one flattened multi-device EROFS root over a drive per layer blob (vm). "
                   "pmem (vm only; microvm refuses it): a virtio-pmem device per layer, mounted with DAX, so the "
                   "node's VMs share the layers' pages; each layer is fetched whole before the VM boots. "
                   "See docs/vm-memory.md.")
@click.option("-e", "--env", "extra_env", multiple=True, metavar="KEY[=VALUE]",
              help="Extra environment variable; KEY alone takes its value from this process's environment "
                   "(keeps a secret off the command line). Values never reach a command line or a log.")
@click.option("--pids-limit", type=int, default=None, metavar="N",
              help="At most N tasks in the sandbox (0: no limit). Default: the node's (1024).")
@click.option("--memory", default=None, metavar="SIZE",
              help="Memory limit, e.g. 2G (0: none). Default: the node's (4G).")
@click.option("--cpus", type=float, default=None, metavar="N",
              help="CPU limit in CPUs (0: none). Default: the node's (2).")
@click.option("--upper-size", default=None, metavar="SIZE",
              help="The writable layer's quota: a tmpfs of SIZE, e.g. 1G (0: none, on the node disk); "
                   "with --keep a sparse image of SIZE on the node disk (survives a reboot; refused, exit 2, "
                   "when the disk's free space cannot hold it and the other kept uppers). "
                   "Default: the node's (1G; with --keep 10G).")
@click.option("--seccomp", type=click.Choice(["default", "unconfined"]), default="default", show_default=True,
              help="The syscall filter (unconfined: none).")
@click.option("--allow-ptrace", is_flag=True, help="Let the seccomp profile allow ptrace (debuggers, strace).")
@click.option("--allow-setuid", is_flag=True,
              help="Let setuid binaries and file capabilities work (no no_new_privileges, root without nosuid).")
@click.option("--allow-devices", is_flag=True, help="Mount the root without nodev (device files in it open).")
@click.option("--unmask-system-paths", is_flag=True, help="Leave /proc and /sys paths unmasked and writable.")
@click.option("--userns", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="A user namespace with an id range of the sandbox's own (root in it is an unprivileged uid "
                   "on the host): auto = where the kernel supports it (else without, with a warning); "
                   "on = required; off = none (the sandbox's root is the host's root).")
@click.option("--no-init", "no_init", is_flag=True,
              help="Run the workload as the container's PID 1 (an image with an init of its own: systemd, s6, "
                   "dumb-init) instead of as the child of a minimal init (tini, bound at /dev/init: signals "
                   "and exit codes as in a VM, orphans reaped). Container backend only: a VM's guest init "
                   "always runs the workload as its child.")
@click.argument("env")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_cmd(store_url: str | None, node_dir: str | None, policy: str | None, eager: bool, sandbox: str | None,
            keep: bool, backend: str, runtime: str, layer_device: str | None, extra_env: tuple[str, ...],
            pids_limit: int | None,
            memory: str | None, cpus: float | None, upper_size: str | None, seccomp: str, allow_ptrace: bool,
            allow_setuid: bool, allow_devices: bool, unmask_system_paths: bool, userns: str, no_init: bool,
            env: str, command: tuple[str, ...]) -> None:
    """Run COMMAND (default: the environment's) in a new sandbox of ENV; exit with its exit code.

    Least privilege unless relaxed by an option: a seccomp profile, Docker's default capabilities,
    no new privileges, masked /proc and /sys paths, nosuid,nodev mounts, limits on tasks, memory,
    CPU and the writable layer (NODE/limits.json sets the node's defaults), a user namespace of
    the sandbox's own where the kernel supports it. A container's PID 1 is tini, the command its
    child (--no-init: the command is PID 1).

    \b
    layerctl run NAME:TAG -- sh -c 'echo hello'
    API_TOKEN=... layerctl run -e API_TOKEN NAME:TAG -- ./agent"""
    from runtime_shim.backends.base import Confinement
    from runtime_shim.sandbox import runner

    from .cmd_daemon import parse_size

    if command[:1] == ("--",):  # click keeps the separator once positional parsing has begun
        command = command[1:]
    variables = _env_items(extra_env)
    if layer_device is not None and backend == "container":
        raise click.UsageError("--layer-device is for the VM backends (--backend microvm|vm)")
    if no_init and backend != "container":
        raise click.UsageError(f"--no-init is for the container backend: the {backend} guest's init always runs "
                               f"the workload as its child")
    if backend == "container" and not no_init:
        from runtime_shim.backends.pid1 import find_init

        find_init()  # (no usable tini: said now, not after a sandbox was mounted for nothing)
    with _shim(node_dir, store_url, policy) as shim:
        if layer_device is not None:
            shim.backends[backend].use_layer_device(layer_device)  # type: ignore[attr-defined]
        node = runner.NodeDefaults.load(shim.paths)

        def limit(given: float | None, default: float | None) -> float | None:
            return default if given is None else (given or None)  # (0: no limit)

        memory_limit = limit(parse_size(memory) if memory is not None else None, node.memory)
        confinement = Confinement(seccomp=seccomp == "default", ptrace=allow_ptrace, new_privileges=allow_setuid,
                                  system_paths=unmask_system_paths,
                                  pids=None if (p := limit(pids_limit, node.pids)) is None else int(p),
                                  memory=None if memory_limit is None else int(memory_limit),
                                  cpus=limit(cpus, node.cpus), init=not no_init)
        res = runner.run(shim, env, list(command) or None, sandbox=sandbox, eager=eager, keep=keep,
                         runtime=runtime if backend == "container" else backend,
                         extra_env=variables, confinement=confinement, nodev=not allow_devices,
                         upper_size=parse_size(upper_size) if upper_size is not None else None,
                         userns={"auto": None, "on": True, "off": False}[userns])
    if res.lost:  # (one line: the workload's own errors above it say EIO, SIGBUS, "exec format error"...)
        click.echo(f"layerctl: the node daemon died under sandbox {res.sandbox}: {res.lost}", err=True)
    if keep:
        click.echo(f"layerctl: sandbox {res.sandbox} kept", err=True)
    sys.exit(res.exit_code)


def _env_items(items: tuple[str, ...]) -> list[str]:
    """-e KEY=VALUE, or -e KEY (its value from this process's environment; left out if unset, as
    docker does). Errors name the key only: a value may be a secret."""
    import os

    from layerstore.errors import ConfigError

    out = []
    for item in items:
        key, eq, _value = item.partition("=")
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"--env: want KEY=VALUE or KEY, got {'an empty' if not key else 'a bad'} name "
                              f"(value not shown)")
        if eq:
            out.append(item)
        elif key in os.environ:
            out.append(f"{key}={os.environ[key]}")
    return out


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
        where = f"(composed in its {sb.backend} guest)" if sb.backend else sb.target
        lost = f"  lost: {sb.lost}" if sb.lost else ""
        click.echo(f"{sb.id}  {sb.status:9}  {sb.env or sb.manifest or '-'}  {where}{lost}")


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

    A container still running in SANDBOX is frozen (paused) while its files are read. A microVM
    sandbox is committed once its VM has stopped: a helper VM reads its upper drive."""
    from layerstore.store import Store
    from runtime_shim.sandbox.commit import commit

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
    from runtime_shim.node.shim import Shim

    with Shim.for_node(node_dir, auto_recover=False) as shim:
        rep = shim.recover()
    if as_json:
        emit_json(rep.to_json())
        return
    if rep.rebooted:
        click.echo("the state belonged to an earlier boot: rebuilt from the sandboxes' records")
    click.echo(f"recovered: {len(rep.remounted_sandboxes)} sandbox(es) and {len(rep.remounted_layers)} layer(s) "
               f"remounted, {len(rep.finished_teardowns)} teardown(s) finished, {len(rep.rolled_back)} interrupted "
               f"mount(s) rolled back, {len(rep.orphan_mounts)} orphan mount(s) removed, {len(rep.adopted)} "
               f"sandbox(es) rebuilt from records, {len(rep.deleted_containers)} leftover container(s) deleted, "
               f"{len(rep.dead_mounts)} dead FUSE mount(s) removed")
    for sid, why in sorted(rep.lost.items()):
        click.echo(f"lost: {sid}: {why}")
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
    """Stop the node daemon and its watch, and remove what a dead daemon left (its FUSE mount, layer
    mounts on it); refused while sandboxes are mounted."""
    from runtime_shim.node.shim import CLEARED, STOPPED, Shim

    with Shim.for_node(node_dir, auto_recover=False) as shim:
        done = shim.stop_daemon()
    click.echo({STOPPED: "node daemon stopped", CLEARED: "no node daemon running: what a dead one left is removed"}
               .get(done, "no node daemon running"))


def register(cli: click.Group) -> None:
    for cmd in (mount_cmd, umount_cmd, run_cmd, sandbox_group, commit_cmd, recover_cmd, node_group):
        cli.add_command(cmd)
