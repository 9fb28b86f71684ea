"""`layerctl snapshotter`: containerd's proxy snapshotter for this node (docs/snapshotter.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from .cmd_runtime import node_dir_option
from .options import metrics_listen_option, store_option

DEFAULT_ADDRESS = "/run/layerstore/snapshotter.sock"


@click.command("snapshotter")
@click.option("--address", default=DEFAULT_ADDRESS, show_default=True, metavar="SOCKET",
              help="The unix socket containerd's proxy_plugins entry names.")
@node_dir_option
@store_option
@click.option("--root", default=None, type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Where snapshots and their metadata live (default NODE/snapshotter).")
@metrics_listen_option("LAYERSTORE_SNAPSHOTTER_METRICS_LISTEN")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def snapshotter_cmd(address: str, node_dir: str | None, store_url: str | None, root: Path | None,
                    metrics_listen: str | None, log_level: str) -> None:
    """Serve containerd's snapshots service: layerstore layers mounted lazily through the node
    daemon, ordinary OCI layers in directories, containers' writes in overlay uppers."""
    from runtime_shim.nodestate.paths import NodePaths
    from snapshotter.layers import RemoteLayers
    from snapshotter.server import serve
    from snapshotter.snapshots import Snapshotter

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node = NodePaths.resolve(node_dir)
    snap_root = (root or node.root / "snapshotter").absolute()
    layers = RemoteLayers.for_node(snap_root, node.root, store_url)
    try:
        sn = Snapshotter(snap_root, layers)
    except BaseException:
        layers.close()
        raise
    rep = sn.last_reconcile
    if rep.directories or rep.layer_mounts:
        logging.getLogger("layerstore.snapshotter").info(
            "start-up cleanup: %d orphan directories, %d layer holds released", len(rep.directories),
            len(rep.layer_mounts))
    serve(sn, address, metrics_listen)


def register(cli: click.Group) -> None:
    cli.add_command(snapshotter_cmd)
