"""The shipped configuration examples say what the code does."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from testkit.cli_helpers import layerctl

CONTRIB = Path(__file__).resolve().parents[2] / "snapshotter" / "contrib"


def test_config_toml_names_the_snapshotters_default_socket() -> None:
    from layerctl.cmd_snapshotter import DEFAULT_ADDRESS

    cfg = tomllib.loads((CONTRIB / "config.toml").read_text())
    assert cfg["version"] == 2
    assert cfg["proxy_plugins"]["layerstore"] == {"type": "snapshot", "address": DEFAULT_ADDRESS}


def test_systemd_unit_runs_a_command_layerctl_takes() -> None:
    lines = (CONTRIB / "layerstore-snapshotter.service").read_text().splitlines()
    [exec_start] = [line.split("=", 1)[1] for line in lines if line.startswith("ExecStart=")]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("layerctl") and argv[1] == "snapshotter"
    help_text = layerctl("snapshotter", "--help").out
    for opt in (a for a in argv[2:] if a.startswith("--")):
        assert opt in help_text
    assert "KillMode=process" in lines  # a restart must not take the node daemon down with it


def test_cri_config_passes_the_snapshot_labels_to_layerstore() -> None:
    from layerctl.cmd_snapshotter import DEFAULT_ADDRESS

    cfg = tomllib.loads((CONTRIB / "containerd-cri.toml").read_text())
    assert cfg["proxy_plugins"]["layerstore"] == {"type": "snapshot", "address": DEFAULT_ADDRESS}
    ctd = cfg["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert ctd["snapshotter"] == "layerstore"
    assert ctd["disable_snapshot_annotations"] is False  # (containerd 1.6's default drops the CRI labels)
