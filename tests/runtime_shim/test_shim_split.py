"""The shim split by concern (issue 29): a mount is asked with one request value. Pure: no root,
no mounts."""

from __future__ import annotations

import pytest

from runtime_shim.errors import ShimError
from runtime_shim.node.request import MountRequest


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
