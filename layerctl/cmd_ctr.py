"""`layerctl ctr push|pull`: environments as containerd images (docs/snapshotter.md).

    layerctl ctr push ENV REF          the environment as an OCI image of layer pointers in a registry
    layerctl ctr pull REF              into containerd, layerstore layers mounted by the snapshotter
    ctr run --snapshotter layerstore REF ID CMD
"""

from __future__ import annotations

import click

from .cmd_store import open_store
from .options import emit_json, json_option, store_option

DEFAULT_CONTAINERD = "/run/containerd/containerd.sock"


@click.group("ctr")
def ctr_group() -> None:
    """containerd images from environments, pulled through the layerstore snapshotter."""


@ctr_group.command("push")
@store_option
@click.argument("env")
@click.argument("ref")
@json_option
def push_cmd(store_url: str | None, env: str, ref: str, as_json: bool) -> None:
    """Push environment ENV (NAME:TAG or digest) to registry reference REF (HOST/NAME:TAG) as an
    OCI image whose layers point at the environment's blobs."""
    from runtime_shim.resolve.environment import resolve
    from snapshotter.push import push

    with open_store(store_url) as store:
        spec = resolve(store, env)
    rep = push(spec, ref)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(f"{rep.reference}@{rep.manifest} ({len(rep.layers)} layerstore layers)")


@ctr_group.command("pull")
@click.argument("ref")
@click.option("--address", default=DEFAULT_CONTAINERD, show_default=True, metavar="SOCKET", envvar="CONTAINERD_ADDRESS",
              show_envvar=True, help="containerd's gRPC socket (as ctr's).")
@click.option("--namespace", "-n", default="default", show_default=True, envvar="CONTAINERD_NAMESPACE",
              show_envvar=True, help="containerd namespace (as ctr's).")
@click.option("--snapshotter", default="layerstore", show_default=True,
              help="The snapshotter to unpack into (the proxy plugin's name in containerd's config).")
@click.option("--name", default=None, help="The image's name in containerd (default: REF).")
@json_option
def pull_cmd(ref: str, address: str, namespace: str, snapshotter: str, name: str | None, as_json: bool) -> None:
    """Pull REF from its registry into containerd: layerstore layers are mounted lazily by the
    snapshotter (nothing downloaded), other layers fetched and unpacked by containerd."""
    from snapshotter.client import ContainerdClient
    from snapshotter.pull import pull

    with ContainerdClient(address, namespace) as ctd:
        rep = pull(ref, ctd, snapshotter, name=name)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(f"{rep.image}: {rep.manifest}; {len(rep.remote_layers)} layerstore layer(s) mounted lazily, "
                   f"{len(rep.unpacked_layers)} unpacked, {len(rep.present_layers)} present; "
                   f"{rep.bytes_fetched} bytes fetched")


def register(cli: click.Group) -> None:
    cli.add_command(ctr_group)
