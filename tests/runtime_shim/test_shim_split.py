"""The shim split by concern (issue 29): a mount is asked with one request value; recovery runs
as named phases, no function of the shim longer than 120 lines; the node daemon is started as a
module and its options are checked by its config. Pure: no root, no mounts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from fuse_client.daemon import DaemonConfig
from layerstore.errors import ConfigError
from runtime_shim.errors import ShimError
from runtime_shim.node import recover
from runtime_shim.node.request import MountRequest
from runtime_shim.supervise.daemon import default_command

ROOT = Path(__file__).resolve().parents[2]


def test_a_mount_request_is_one_frozen_value_with_the_defaults_of_a_mount() -> None:
    req = MountRequest("env:1", sandbox="s1")
    assert (req.target, req.upper, req.eager, req.utab_entry, req.userns, req.guest) == (None, None, False, False,
                                                                                         False, None)
    assert req.nosuid and req.nodev and not req.scratch
    with pytest.raises(AttributeError):
        req.sandbox = "s2"  # type: ignore[misc]
    assert not hasattr(req, "__dict__")  # (slots)


@pytest.mark.parametrize("kw", [{"upper_size": 0}, {"upper_image": -1}, {"upper_image": 1 << 20, "upper_size": 1 << 20},
                                {"guest": "vm", "upper": "/u"}, {"guest": "vm", "upper_size": 1 << 20},
                                {"guest": "vm", "utab_entry": True}, {"guest": "vm", "userns": True}])
def test_a_mount_request_refuses_contradictions_when_made(kw: dict[str, object]) -> None:
    with pytest.raises(ShimError):
        MountRequest("env:1", **kw)  # type: ignore[arg-type]


def test_an_explicit_upper_takes_no_upper_image() -> None:
    req = MountRequest("env:1", upper="/u", upper_image=1 << 20)
    assert req.image_size is None and not req.scratch
    assert MountRequest("env:1", upper_image=1 << 20).scratch


def test_recovery_is_named_phases_each_saying_what_it_repairs() -> None:
    tree = ast.parse(Path(recover.__file__).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "recover")
    called = [c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    phases = [name for name in called if name.startswith("_") and name != "_Picture"]
    assert len(phases) >= 7, phases
    for name in phases:
        doc = getattr(recover, name).__doc__ or ""
        assert doc.split()[:1] in (["Repairs"], ["Unpin"], ["Workloads"]), (name, doc)


def test_the_shim_starts_the_daemon_as_a_module_not_through_the_cli() -> None:
    argv = default_command("file:///s", Path("/n/cache"), Path("/n/fuse"))
    assert argv[:3] == [sys.executable, "-m", "fuse_client.daemon"]
    assert "layerctl" not in " ".join(argv)
    assert argv[3:] == ["--store", "file:///s", "--cache", "/n/cache", "--mountpoint", "/n/fuse"]


@pytest.mark.parametrize(("field", "value", "says"), [("fetch_deadline", 0.0, "--fetch-deadline"),
                                                     ("fetch_concurrency", 0, "--fetch-concurrency"),
                                                     ("readahead", -1, "--readahead"),
                                                     ("high_watermark", 1.5, "watermark")])
def test_the_daemons_config_checks_its_options(tmp_path: Path, field: str, value: object, says: str) -> None:
    cfg = DaemonConfig(cache_dir=tmp_path / "cache", mountpoint=tmp_path / "mnt", cache_size=1 << 30)
    cfg.check()
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=says):
        cfg.check()


def test_the_daemon_module_says_a_bad_option_in_one_line(tmp_path: Path) -> None:
    import subprocess

    p = subprocess.run([sys.executable, "-m", "fuse_client.daemon", "--store", "nosuchscheme://x", "--cache",
                        str(tmp_path / "cache"), "--mountpoint", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and not (tmp_path / "m").exists()  # (refused before mounting anything)
    assert p.stderr.strip().splitlines()[-1].startswith("fuse_client.daemon: error:"), p.stderr
