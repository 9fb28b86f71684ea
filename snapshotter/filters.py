"""containerd's filter syntax, as `Walk` (`List`) receives it: pure parsing and matching.

    filters   := one string per alternative (any may match)
    filter    := selector ("," selector)*            (every selector must match)
    selector  := fieldpath [ ("==" | "!=" | "~=") value ]   (a bare fieldpath: the field is present)
    fieldpath := field ("." field)*
    field     := identifier | quoted
    value     := quoted | /regexp/ | characters up to "," or the end

Quoted strings take Go's escapes. containerd itself sends e.g.
`labels."containerd.io/snapshot.ref"==sha256:...,parent=="default/3/sha256:..."` when it looks for
a remote snapshot after `AlreadyExists`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from layerstore.errors import BadInput

_IDENT = re.compile(r"[A-Za-z0-9_]+")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "/": "/", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v"}


class BadFilter(BadInput):
    """A filter string containerd's syntax does not allow."""


@dataclass(frozen=True)
class Selector:
    fieldpath: tuple[str, ...]
    op: str  # "" (present), "==", "!=", "~="
    value: str = ""


Filter = list[Selector]
# fieldpath -> the field's value, or None when the object has no such field
Lookup = Callable[[tuple[str, ...]], "str | None"]


class _Scanner:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def eof(self) -> bool:
        return self.i >= len(self.s)

    def peek(self, n: int = 1) -> str:
        return self.s[self.i:self.i + n]

    def skip_space(self) -> None:
        while not self.eof() and self.s[self.i].isspace():
            self.i += 1

    def fail(self, what: str) -> BadFilter:
        return BadFilter(f"filter {self.s!r}: {what} at offset {self.i}")

    def quoted(self, end: str) -> str:
        assert self.s[self.i] in "\"'/"
        self.i += 1
        out = []
        while True:
            if self.eof():
                raise self.fail("unterminated quoted string")
            c = self.s[self.i]
            self.i += 1
            if c == end:
                return "".join(out)
            if c == "\\":
                if self.eof():
                    raise self.fail("dangling escape")
                e = self.s[self.i]
                self.i += 1
                if e in _ESCAPES and (end != "/" or e == "/"):
                    out.append(_ESCAPES[e])
                elif end == "/":  # a regexp keeps its escapes for `re`
                    out.append("\\" + e)
                else:
                    raise self.fail(f"unknown escape \\{e}")
            else:
                out.append(c)

    def field(self) -> str:
        self.skip_space()
        if self.peek() in ('"', "'"):
            return self.quoted(self.peek())
        m = _IDENT.match(self.s, self.i)
        if not m:
            raise self.fail("expected a field name")
        self.i = m.end()
        return m.group()

    def value(self) -> str:
        self.skip_space()
        if self.peek() in ('"', "'", "/"):
            return self.quoted(self.peek())
        start = self.i
        while not self.eof() and self.s[self.i] != ",":
            self.i += 1
        val = self.s[start:self.i].strip()
        if not val:
            raise self.fail("expected a value")
        return val


def parse(text: str) -> Filter:
    sc = _Scanner(text)
    selectors: Filter = []
    while True:
        path = [sc.field()]
        while sc.peek() == ".":
            sc.i += 1
            path.append(sc.field())
        sc.skip_space()
        op = sc.peek(2)
        if op in ("==", "!=", "~="):
            sc.i += 2
            value = sc.value()
            if op == "~=":
                try:
                    re.compile(value)
                except re.error as e:
                    raise sc.fail(f"bad regular expression ({e})") from None
            selectors.append(Selector(tuple(path), op, value))
        else:
            selectors.append(Selector(tuple(path), ""))
        sc.skip_space()
        if sc.eof():
            return selectors
        if sc.peek() != ",":
            raise sc.fail("expected ',' or an operator")
        sc.i += 1


def parse_all(filters: Sequence[str]) -> list[Filter]:
    return [parse(f) for f in filters if f.strip()]


def matches(selectors: Filter, lookup: Lookup) -> bool:
    """containerd's semantics: `==` needs the field present; `!=` and `~=` compare an absent
    field as ""."""
    for sel in selectors:
        got = lookup(sel.fieldpath)
        value = got or ""
        if sel.op == "":
            ok = got is not None
        elif sel.op == "==":
            ok = got is not None and value == sel.value
        elif sel.op == "!=":
            ok = value != sel.value
        else:
            ok = re.search(sel.value, value) is not None
        if not ok:
            return False
    return True


def matches_any(filters: list[Filter], lookup: Lookup) -> bool:
    """No filters: everything matches; else any one filter whose every selector matches."""
    return not filters or any(matches(f, lookup) for f in filters)
