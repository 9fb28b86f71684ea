"""Canonical JSON: the one byte form of a JSON value that a digest or a signature covers (pure).

    - object keys sorted by code point (every key this package writes is ASCII, so this is also
      the order of UTF-8 bytes and of UTF-16 code units: any language sorts them the same way);
    - no insignificant whitespace (separators "," and ":");
    - UTF-8, non-ASCII characters written as themselves; only '"', '\\' and control characters
      are escaped (short forms \\b \\f \\n \\r \\t, else \\u00XX with lowercase hex);
    - integers only (no fractions, exponents, NaN or infinities), no duplicate keys.

`loads` is strict on input: invalid UTF-8 (or a BOM), duplicate keys, non-finite numbers, nesting
deeper than any schema here needs, or text that is not JSON at all are one `InvalidManifest`,
never another exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import InvalidManifest

MAX_DEPTH = 32


def dumps(obj: Any) -> bytes:
    """The canonical bytes of `obj` (which the caller has validated: str keys, ints, no surrogates)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


class _NonFinite(Exception):
    pass


def loads(data: bytes | bytearray | memoryview, what: str = "JSON") -> Any:
    data = bytes(data)
    if data.startswith(b"\xef\xbb\xbf"):
        raise InvalidManifest(f"{what}: starts with a byte order mark")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidManifest(f"{what}: not UTF-8 (byte {e.start})") from None
    if _depth_exceeds(text, MAX_DEPTH):
        raise InvalidManifest(f"{what}: nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise InvalidManifest(f"{what}: duplicate key {e.key!r}") from None
    except _NonFinite as e:
        raise InvalidManifest(f"{what}: {e.args[0]} is not a JSON number") from None
    except json.JSONDecodeError as e:
        raise InvalidManifest(f"{what}: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of more digits than Python converts
        raise InvalidManifest(f"{what}: not JSON we read: {e}") from None


def _depth_exceeds(text: str, limit: int) -> bool:
    """Nesting depth beyond `limit`? Checked before decoding so the decoder never recurses
    without bound; a bracket count skips the scan for the usual small inputs."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def kind_of(value: Any) -> str:
    """A JSON-ish name for a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__
