"""The error registry (names, wire form, exit codes in one table) and the one retry policy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layerstore import errors
from layerstore.errors import CorruptObject, LayerstoreError, NotFound, StoreUnavailable, from_wire
from layerstore.retry import RetryPolicy, is_temporary

ROOT = Path(__file__).resolve().parents[2]


def _every_error_module() -> None:
    """Import every module of the project that defines a LayerstoreError subclass."""
    import importlib

    for folder in ("layerstore", "manifest", "erofs_builder", "fuse_client", "runtime_shim", "layerctl"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.ClassDef) and n.bases for n in tree.body):
                rel = path.relative_to(ROOT).with_suffix("")
                name = ".".join(p for p in rel.parts if p != "__init__")
                importlib.import_module(name)


def test_every_error_class_has_a_documented_exit_code() -> None:
    _every_error_module()
    doc = errors.__doc__ or ""
    for name, cls in sorted(errors.registered().items()):
        assert issubclass(cls, LayerstoreError)
        assert cls.exit_code in errors.EXIT_CODES, name
        assert f"| {cls.exit_code} " in doc, (name, cls.exit_code)
    for code in errors.EXIT_CODES:
        assert f"| {code} " in doc


def test_errors_cross_a_socket_as_their_own_class() -> None:
    for err in (NotFound("no such blob"), CorruptObject("bad chunk"), StoreUnavailable("down")):
        back = from_wire(err.to_wire())
        assert type(back) is type(err) and str(back) == str(err) and back.exit_code == err.exit_code


def test_an_unknown_kind_keeps_its_exit_code() -> None:
    back = from_wire({"kind": "SomethingNew", "error": "from a newer daemon", "exit_code": 7})
    assert type(back) is LayerstoreError and back.exit_code == 7 and str(back) == "from a newer daemon"
    assert from_wire({"kind": "X", "error": "e", "exit_code": 99}).exit_code == 1  # not a documented code
    assert from_wire("garbage", "fallback text").args == ("fallback text",)


def test_two_classes_of_one_name_are_refused() -> None:
    with pytest.raises(TypeError, match="two error classes named NotFound"):
        type("NotFound", (LayerstoreError,), {"__qualname__": "elsewhere.NotFound"})


def test_policy_delays_grow_to_the_cap_and_stop_at_the_attempts() -> None:
    sched = RetryPolicy(first=0.1, cap=0.3, attempts=5, jitter=False).schedule(0.0)
    assert [sched.next_delay(0.0) for _ in range(5)] == [0.1, 0.2, 0.3, 0.3, None]


def test_policy_stops_before_the_deadline() -> None:
    sched = RetryPolicy(first=1.0, cap=1.0, deadline=2.5, jitter=False).schedule(10.0)
    assert sched.next_delay(10.0) == 1.0
    assert sched.next_delay(11.0) == 1.0
    assert sched.next_delay(12.0) is None  # 12 + 1 >= 12.5


def test_policy_call_retries_only_temporary_failures() -> None:
    calls: list[int] = []
    slept: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreUnavailable("try again")
        return "ok"

    policy = RetryPolicy(first=0.01, cap=0.01, attempts=3, jitter=False)
    assert policy.call(flaky, is_temporary, sleep=slept.append) == "ok"
    assert len(calls) == 3 and slept == [0.01, 0.01]

    def broken() -> str:
        calls.append(1)
        raise CorruptObject("never passes")

    calls.clear()
    with pytest.raises(CorruptObject):
        policy.call(broken, is_temporary, sleep=slept.append)
    assert len(calls) == 1

    def down() -> str:
        calls.append(1)
        raise StoreUnavailable("down")

    calls.clear()
    with pytest.raises(StoreUnavailable):
        RetryPolicy(attempts=2, jitter=False).call(down, is_temporary, sleep=lambda _s: None)
    assert len(calls) == 2


def test_a_policy_needs_a_bound() -> None:
    with pytest.raises(ValueError):
        RetryPolicy()
