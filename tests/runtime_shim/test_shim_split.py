"""The shim split by concern (issue 29): a mount is asked with one request value; recovery runs
as named phases, no function of the shim longer than 120 lines. Pure: no root, no mounts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runtime_shim.errors import ShimError
from runtime_shim.node import recover
from runtime_shim.node.request import MountRequest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 120


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


def _functions(folder: Path) -> list[tuple[int, str]]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return out


def test_no_function_of_the_shim_is_longer_than_120_lines() -> None:
    assert [f for n, f in _functions(ROOT / "runtime_shim") if n > MAX_LINES] == []


def test_recovery_is_named_phases_each_saying_what_it_repairs() -> None:
    tree = ast.parse(Path(recover.__file__).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "recover")
    called = [c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    phases = [name for name in called if name.startswith("_") and name != "_Picture"]
    assert len(phases) >= 7, phases
    for name in phases:
        doc = getattr(recover, name).__doc__ or ""
        assert doc.split()[:1] in (["Repairs"], ["Unpin"], ["Workloads"]), (name, doc)
