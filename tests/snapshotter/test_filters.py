"""containerd's filter syntax (pure): what containerd sends, quoting, and hostile input."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshotter.filters import BadFilter, Selector, matches, matches_any, parse, parse_all


def test_what_containerd_sends() -> None:
    f = parse('labels."containerd.io/snapshot.ref"==sha256:abc,parent=="default/3/sha256:def"')
    assert f == [Selector(("labels", "containerd.io/snapshot.ref"), "==", "sha256:abc"),
                 Selector(("parent",), "==", "default/3/sha256:def")]


def test_quoting_and_operators() -> None:
    assert parse(r'name=="a\"b\\c"') == [Selector(("name",), "==", 'a"b\\c')]
    assert parse("name~=/^x\\.y$/") == [Selector(("name",), "~=", "^x\\.y$")]
    assert parse(" kind != view , labels.a.b ") == [Selector(("kind",), "!=", "view"),
                                                    Selector(("labels", "a", "b"), "")]


@pytest.mark.parametrize("bad", ['name=="x', "==x", "name==", "name=x", "name~=(", 'name=="\\q"', "a,,b", "a b"])
def test_malformed_filters_are_refused(bad: str) -> None:
    with pytest.raises(BadFilter):
        parse(bad)


def test_semantics() -> None:
    fields = {("name",): "n1", ("labels", "k"): "v"}

    def lookup(path: tuple[str, ...]) -> str | None:
        return fields.get(path)

    assert matches(parse("name==n1,labels.k==v"), lookup)
    assert not matches(parse("labels.other==''"), lookup)  # == needs the field present
    assert matches(parse("labels.other!=v"), lookup)  # absent is "" for !=
    assert matches_any(parse_all([]), lookup)
    assert matches_any(parse_all(["name==zz", "name==n1"]), lookup)


@given(st.text(max_size=60))
def test_any_text_parses_or_is_refused_cleanly(text: str) -> None:
    with contextlib.suppress(BadFilter):
        parse(text)
