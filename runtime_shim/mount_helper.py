"""`mount.layerstore` and `umount.layerstore`: the shim as a mount(8) helper for sandbox runtimes.

    mount -t layerstore ENV TARGET -o sandbox=ID[,upper=DIR][,store=URL][,node_dir=DIR][,eager][,policy=FILE]
    -> /sbin/mount.layerstore ENV TARGET [-sfnv] [-N NS] [-o OPTS] [-t layerstore]
    umount.layerstore TARGET [-flnrv] [-N NS] [-t TYPE]      (or `layerctl umount TARGET`)

The argv grammar is parsed purely (`parse_mount_argv`); exit codes follow mount(8): 0 success,
1 bad usage, 32 mount failure. The node's trust policy (NODE/policy.json) is a floor:
`-o policy=FILE` combines with it (it can only tighten), and `-o node_dir=` cannot pick a node
whose policy is weaker than the default node's. `mount.layerstore` records the root in /run/mount/utab with
`helper=layerstore` (see `utab`), so that a plain `umount TARGET` calls `umount.layerstore` and
the sandbox is torn down, not only detached. A node installs the helpers with
    ln -sf "$(command -v mount.layerstore)" /sbin/mount.layerstore
    ln -sf "$(command -v umount.layerstore)" /sbin/umount.layerstore
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from layerstore.errors import ConfigError, LayerstoreError, PermissionDenied

EXIT_USAGE, EXIT_FAILURE = 1, 32
# Generic options mount(8) may pass along; they mean nothing to an overlay root and are ignored.
GENERIC = {"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "nofail", "_netdev", "exec",
           "suid", "dev", "async", "relatime", "noatime", "atime", "loud", "silent"}


@dataclass
class MountRequest:
    env: str
    target: str
    sandbox: str | None = None
    upper: str | None = None
    store: str | None = None
    node_dir: str | None = None
    policy: str | None = None
    eager: bool = False
    fake: bool = False
    verbose: bool = False
    ignored: list[str] = field(default_factory=list)


def _split_opts(text: str) -> list[str]:
    return [o for o in text.split(",") if o]


def parse_mount_argv(argv: Sequence[str]) -> MountRequest:
    """`ENV TARGET [-sfnv] [-N NS] [-o OPTS] [-t TYPE]` in any order, as mount(8) calls helpers."""
    positional: list[str] = []
    opts: list[str] = []
    sloppy = fake = verbose = False
    it = iter(argv)
    for arg in it:
        if arg == "-o":
            opts += _split_opts(next(it, ""))
        elif arg.startswith("-o") and len(arg) > 2:
            opts += _split_opts(arg[2:])
        elif arg in ("-t", "-N"):
            next(it, None)
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvrl"):
            sloppy |= "s" in arg
            fake |= "f" in arg
            verbose |= "v" in arg
        elif arg.startswith("-") and len(arg) > 1:
            raise ConfigError(f"mount.layerstore: unknown flag {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise ConfigError("usage: mount.layerstore ENV TARGET [-sfnv] [-o sandbox=ID[,upper=DIR]...]")
    req = MountRequest(env=positional[0], target=positional[1], fake=fake, verbose=verbose)
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key in ("sandbox", "upper", "store", "node_dir", "policy") and sep and value:
            setattr(req, key, value)
        elif key == "eager" and not sep:
            req.eager = True
        elif key == "ro":
            raise ConfigError("mount.layerstore: a sandbox root is writable (its upper); 'ro' is not supported")
        elif key in GENERIC or sloppy:
            req.ignored.append(opt)
        else:
            raise ConfigError(f"mount.layerstore: unknown option {opt!r}")
    return req


def parse_umount_argv(argv: Sequence[str]) -> str:
    """`TARGET [-flnrv] [-N NS] [-t TYPE]`; the flags change nothing for a sandbox root."""
    positional = []
    it = iter(argv)
    for arg in it:
        if arg in ("-t", "-N"):
            next(it, None)
        elif not (arg.startswith("-") and len(arg) > 1):
            positional.append(arg)
    if len(positional) != 1:
        raise ConfigError("usage: umount.layerstore TARGET [-flnrv]")
    return positional[0]


def node_dir_of(target: str) -> str | None:
    """The node directory of a sandbox root, read from its overlay's upperdir when the upper is
    the shim's own (NODE/sandboxes/<id>/upper, or NODE/sandboxes/<id>/scratch/upper on its own
    size-limited filesystem); None otherwise (then the default applies)."""
    import os
    import re

    from layerstore import linux

    m = linux.find_mount(os.path.abspath(target))  # parses only the lines naming the target
    if m is None or m.fstype != "overlay":
        return None
    found = re.search(r"(?:^|,)upperdir=([^,]+)/sandboxes/[^/,]+/(?:scratch/)?upper(?:,|$)", m.options)
    return found.group(1) if found else None


def check_node_dir(req: MountRequest) -> None:
    """`-o node_dir=` cannot move a mount out from under the node's trust policy: when the
    default node (`$LAYERSTORE_NODE_DIR`, else /var/lib/layerstore) has a policy.json, the node
    directory chosen must have one at least as strict. (`-o policy=` only tightens, in
    `Shim.for_node`.)"""
    if req.node_dir is None:
        return
    from .nodestate.paths import resolve_node_dir
    from .resolve.environment import node_floor

    default, chosen = resolve_node_dir(None), resolve_node_dir(req.node_dir)
    if chosen == default:
        return
    floor = node_floor(default)
    if floor is None:
        return
    mine = node_floor(chosen)
    if mine is None or not mine.at_least_as_strict_as(floor):
        raise PermissionDenied(f"node_dir={req.node_dir}: its trust policy is weaker than the node's "
                               f"({default}/policy.json); a mount option cannot loosen it")


def _fail(e: LayerstoreError, code: int) -> int:
    print(f"layerstore: {e}", file=sys.stderr)
    return code


def mount_main(argv: Sequence[str] | None = None) -> int:
    from .node.request import MountRequest
    from .node.shim import Shim
    from .sandbox.runner import kept_upper_image

    try:
        req = parse_mount_argv(sys.argv[1:] if argv is None else argv)
    except LayerstoreError as e:
        return _fail(e, EXIT_USAGE)
    if req.fake:
        return 0
    try:
        check_node_dir(req)
        with Shim.for_node(req.node_dir, req.store, policy=req.policy) as shim:
            # the utab entry makes a plain `umount TARGET` come back to umount.layerstore
            # a shim-owned upper gets the node's quota (a sparse image: NodeDefaults.kept_upper_size)
            image = None if req.upper else kept_upper_image(shim.paths)
            sb = shim.mount(MountRequest(req.env, req.target, sandbox=req.sandbox, upper=req.upper, eager=req.eager,
                            utab_entry=True, upper_image=image))
    except LayerstoreError as e:
        return _fail(e, EXIT_FAILURE)
    if req.verbose:
        print(f"layerstore: sandbox {sb.id} ({sb.manifest}) mounted on {sb.target}")
    return 0


def umount_main(argv: Sequence[str] | None = None) -> int:
    import os

    from .node.shim import Shim

    try:
        target = parse_umount_argv(sys.argv[1:] if argv is None else argv)
    except LayerstoreError as e:
        return _fail(e, EXIT_USAGE)
    from layerstore import linux

    from .errors import SandboxNotFound
    from .nodestate import utab

    try:
        with Shim.for_node(os.environ.get("LAYERSTORE_NODE_DIR") or node_dir_of(target)) as shim:
            shim.unmount(target)
    except SandboxNotFound as e:
        # umount(8) sent us a mount the node does not know (its record is gone): still unmount it,
        # as umount(8) itself would have.
        if not linux.is_mount(target):
            return _fail(e, EXIT_FAILURE)
        try:
            linux.detach(target)
        except LayerstoreError as e2:
            return _fail(e2, EXIT_FAILURE)
        with contextlib.suppress(OSError):
            utab.remove(os.path.abspath(target))
        print(f"layerstore: {e}; unmounted {target} only", file=sys.stderr)
    except LayerstoreError as e:
        return _fail(e, EXIT_FAILURE)
    return 0


def main() -> None:
    sys.exit(mount_main())


def umount_entry() -> None:
    sys.exit(umount_main())
