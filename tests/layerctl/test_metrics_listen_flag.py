"""`layerctl daemon` and `layerctl snapshotter` take `--metrics-listen HOST:PORT` (docs/metrics.md):
shown in `--help` with the variable it replaces, handed to the daemon's config and to the
snapshotter's `serve`, and a malformed address refused before anything starts. No kernel: the
serve functions (and the snapshotter's node pieces) are replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from testkit.cli_helpers import assert_clean_failure, layerctl

from layerctl.main import cli
from layerstore.metrics_listen import NODE_ENV, SNAPSHOTTER_ENV


@pytest.mark.parametrize(("command", "env"), [("daemon", NODE_ENV), ("snapshotter", SNAPSHOTTER_ENV)])
def test_help_shows_the_flag_and_its_variable(command: str, env: str) -> None:
    r = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "--metrics-listen HOST:PORT" in r.output
    assert f"${env}" in r.output


def _daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *extra: str) -> list[Any]:
    import fuse_client.daemon

    seen: list[Any] = []
    monkeypatch.setattr(fuse_client.daemon, "serve", lambda cfg, store_url: seen.append(cfg))
    r = CliRunner().invoke(cli, ["daemon", "--cache", str(tmp_path / "cache"), "--mountpoint",
                                 str(tmp_path / "mnt"), *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    return seen


def test_daemon_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(NODE_ENV, raising=False)
    [cfg] = _daemon(monkeypatch, tmp_path, "--metrics-listen", "127.0.0.1:9411")
    assert cfg.metrics_listen == "127.0.0.1:9411"
    [cfg] = _daemon(monkeypatch, tmp_path)
    assert cfg.metrics_listen is None  # the daemon then reads $LAYERSTORE_NODE_METRICS_LISTEN itself


class _FakeSnapshotter:
    def __init__(self, root: Path, layers: object) -> None:
        self.root, self.layers = root, layers
        self.last_reconcile = type("Rep", (), {"directories": [], "layer_mounts": []})()


def _snapshotter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *extra: str) -> list[tuple[Any, ...]]:
    import snapshotter.layers
    import snapshotter.server
    import snapshotter.snapshots

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(snapshotter.layers.RemoteLayers, "for_node",
                        classmethod(lambda cls, root, node_dir, store_url: ("layers", root, store_url)))
    monkeypatch.setattr(snapshotter.snapshots, "Snapshotter", _FakeSnapshotter)
    monkeypatch.setattr(snapshotter.server, "serve", lambda sn, address, metrics_listen=None:
                        seen.append((sn, address, metrics_listen)))
    r = CliRunner().invoke(cli, ["snapshotter", "--address", str(tmp_path / "snap.sock"), "--node-dir",
                                 str(tmp_path / "node"), "--store", str(tmp_path / "store"), *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    return seen


def test_snapshotter_flag_reaches_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(SNAPSHOTTER_ENV, raising=False)
    [(sn, address, listen)] = _snapshotter(monkeypatch, tmp_path, "--metrics-listen", ":9412")
    assert (address, listen) == (str(tmp_path / "snap.sock"), ":9412")
    assert sn.layers == ("layers", (tmp_path / "node" / "snapshotter").absolute(), str(tmp_path / "store"))
    [(_sn, _address, listen)] = _snapshotter(monkeypatch, tmp_path)
    assert listen is None  # serve then reads $LAYERSTORE_SNAPSHOTTER_METRICS_LISTEN itself


@pytest.mark.parametrize("command", [["daemon", "--cache", "C", "--mountpoint", "M"],
                                     ["snapshotter", "--address", "S", "--node-dir", "N"]])
def test_a_malformed_address_is_refused_before_anything_starts(command: list[str], tmp_path: Path) -> None:
    args = [str(tmp_path / a) if len(a) == 1 else a for a in command]  # C, M, S, N: paths under tmp_path
    for bad, why in (("nowhere", "is not HOST:PORT"), ("127.0.0.1:70000", "out of range")):
        r = layerctl(*args, "--metrics-listen", bad)
        assert_clean_failure(r, why)
        assert r.code == 2
    assert list(tmp_path.iterdir()) == []  # no cache, mount point, node directory or socket made
