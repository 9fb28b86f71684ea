"""The store service's wire, shared by the service (`service/`) and its client (`backends.http`):
paths, headers, ETags, the listing's line format, and the one mapping between the error family
and HTTP statuses, both ways (pure: no I/O). See docs/service.md.

An error answer is `LayerstoreError.to_wire()` as JSON with the class's `http_status`; the client
rebuilds the class by name (`from_wire`). The statuses the HTTP layer adds have their classes here,
each a subclass of the family's class a caller already catches.
"""

from __future__ import annotations

import json
from typing import Any

from .. import digest as digestmod
from .. import keys
from ..errors import (
    BadInput,
    CorruptObject,
    LayerstoreError,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    from_wire,
)

API = "/v1"
OBJECTS = API + "/objects/"
LIST = API + "/list"
DELETE_MANY = API + "/delete"
BATCH = API + "/batch"
BATCH_TYPE = "application/vnd.layerstore.batch.v1"
MAX_BATCH_KEYS = 64  # keys one batched read may name
MAX_BATCH_BODY = 64 << 10  # its request body (JSON)
MAX_FRAME_HEAD = 512  # "<status> <length> <key>\n"
STORE = API + "/store"
TOKEN_ENV = "LAYERSTORE_TOKEN"
CREDENTIALS_ENV = "LAYERSTORE_CREDENTIALS"
IMMUTABLE = "public, max-age=31536000, immutable"
MUTABLE = "no-cache"
MUTABLE_KINDS = ("tags", "leases", "gc")
CONTENT_KINDS = keys.KINDS  # chunks, blobs, manifests: the key names the content's digest
BATCH_STATUSES = (200, 400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504)


class Unauthenticated(PermissionDenied):
    """No token, or one the service does not know (401)."""

    http_status = 401


class TooLarge(BadInput):
    """A request body larger than any object of its key's kind can be (413)."""

    http_status = 413


class RejectedObject(CorruptObject):
    """A body that fails the checks of its key's kind: not stored (422). The store's own corrupt
    bytes stay a plain `CorruptObject` (502)."""

    http_status = 422


class SlowRequest(BadInput):
    """A request body not received within the service's deadline (408)."""

    http_status = 408


class RangeNotSatisfiable(BadInput):
    """A range that starts at or after the object's end (416); the client reads it as an empty
    read, like POSIX."""

    http_status = 416


class PreconditionFailed(LayerstoreError):
    """A conditional write whose condition does not hold (412): the key exists (`If-None-Match:
    *`) or changed (`If-Match`). The client turns it into the backend call's False."""

    exit_code = 2
    http_status = 412


def kind_of(key: str) -> str:
    """What a (validated) key is: chunks, blobs, manifests, tags, leases, gc, config or other."""
    head = key.split("/", 1)[0]
    if key == keys.CONFIG:
        return "config"
    if head in CONTENT_KINDS:
        return head
    if head in MUTABLE_KINDS and "/" in key:
        return head
    return "other"


def tag_name(key: str) -> str | None:
    """The environment name a tag key holds (`tags/<name>:<tag>` -> name), else None."""
    if not key.startswith("tags/"):
        return None
    try:
        return keys.parse_tag(keys.tag_of_key(key))[0]
    except LayerstoreError:
        return None


def etag_of(key: str, data: bytes | memoryview) -> str:
    """A content-addressed object's digest (its key says it); any other object's blake3."""
    if kind_of(key) in CONTENT_KINDS:
        return keys.digest_of_key(key)[1]
    return digestmod.of(data)


def quote(etag: str) -> str:
    return f'"{etag}"'


def etags_in(header: str) -> list[str]:
    """The entity tags of an `If-Match` / `If-None-Match` header (weak ones compared strongly)."""
    out = []
    for part in header.split(","):
        part = part.strip()
        if part.startswith("W/"):
            part = part[2:]
        if part:
            out.append(part.strip('"') if part != "*" else "*")
    return out


def list_line(key: str, size: int | None = None, mtime: float | None = None) -> bytes:
    obj: dict[str, Any] = {"k": key}
    if size is not None:
        obj["s"] = size
        obj["m"] = mtime
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def parse_list_line(line: bytes) -> tuple[str, int | None, float | None]:
    try:
        obj = json.loads(line)
        key = keys.validate(obj["k"])
        size, mtime = obj.get("s"), obj.get("m")
        if size is not None and (not isinstance(size, int) or size < 0 or not isinstance(mtime, int | float)):
            raise ValueError
    except (ValueError, KeyError, TypeError, LayerstoreError):
        raise StoreUnavailable(f"malformed listing line from the store service: {line[:200]!r}") from None
    return key, size, (float(mtime) if mtime is not None else None)


def error_body(e: LayerstoreError) -> bytes:
    return json.dumps(e.to_wire()).encode()


def error_of(status: int, body: bytes, what: str) -> LayerstoreError:
    """The error an HTTP answer carries: the class its JSON body names (the service's own
    answers), else one chosen by status (a proxy or load balancer in between)."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        obj = None
    if isinstance(obj, dict) and obj.get("kind"):
        err = from_wire(obj, fallback=f"{what}: HTTP {status}")
        return err
    text = body[:200].decode("utf-8", "replace").strip()
    detail = f"{what}: HTTP {status}" + (f" ({text})" if text else "")
    if status == 404:
        return NotFound(detail)
    if status == 401:
        return Unauthenticated(detail)
    if status == 403:
        return PermissionDenied(detail)
    if status == 412:
        return PreconditionFailed(detail)
    if status == 413:
        return TooLarge(detail)
    if status == 416:
        return RangeNotSatisfiable(detail)
    if status in (408, 429) or status >= 500:
        return StoreUnavailable(detail)
    if 400 <= status < 500:
        return BadInput(detail)
    return LayerstoreError(detail)


# -- batched reads (POST /v1/batch) ------------------------------------------------------------
# Request: {"keys": [key, ...]}: at most MAX_BATCH_KEYS distinct content-addressed keys.
# Answer: 200 of BATCH_TYPE, one frame per key in the order asked, each a head line
# "<status> <length> <key>\n" and <length> bytes: the object (status 200) or the error family's
# JSON (any other status, as a single GET of that key would answer it).


def batch_request(keys_: list[str]) -> bytes:
    return json.dumps({"keys": keys_}, separators=(",", ":")).encode()


def frame_head(status: int, length: int, key: str) -> bytes:
    return b"%d %d %s\n" % (status, length, key.encode())


class BatchFrames:
    """The frames of a batch answer, fed the body as it arrives (pure: no I/O). Each frame's head
    is checked before its body is taken: the key must be the next one asked for, the status one a
    GET may answer, the length at most `max_size` (an object) or MAX_ERROR (an error body); a
    frame for a key not asked for, out of order or twice, or a body that does not end where the
    last frame does is a broken answer (`StoreUnavailable`). Objects come back as they are: their
    content is checked against their key by the caller, exactly as after a single GET."""

    MAX_ERROR = 64 << 10

    def __init__(self, keys_: list[str], max_size: int | None) -> None:
        self.expected = keys_
        self.max_size = max_size
        self.next = 0  # index in `expected` of the frame being read
        self.head = bytearray()
        self.status = 0
        self.want = -1  # bytes of the current frame's body still to come; -1: reading a head
        self.parts: list[memoryview] = []  # views of the fed parts: the body is copied once, by the join

    def feed(self, data: bytes) -> list[tuple[str, int, bytes]]:
        """The frames `data` completes: (key, status, body)."""
        out: list[tuple[str, int, bytes]] = []
        view = memoryview(data)
        while view:
            if self.want < 0:
                nl = bytes(view[: MAX_FRAME_HEAD + 1]).find(b"\n")
                if nl < 0:
                    self.head += view
                    if len(self.head) > MAX_FRAME_HEAD:
                        raise StoreUnavailable("batch answer: a frame head too long")
                    return out
                self.head += view[:nl]
                view = view[nl + 1 :]
                self._start()
            else:
                take = view[: self.want]
                self.parts.append(take)
                self.want -= len(take)
                view = view[len(take) :]
            if self.want == 0:
                out.append(self._finish())
        return out

    def _start(self) -> None:
        if len(self.head) > MAX_FRAME_HEAD:
            raise StoreUnavailable("batch answer: a frame head too long")
        if self.next >= len(self.expected):
            raise StoreUnavailable("batch answer: more frames than keys asked for")
        key = self.expected[self.next]
        try:
            status_s, length_s, got = bytes(self.head).decode("ascii").split(" ", 2)
            if not (status_s.isdigit() and length_s.isdigit() and len(status_s) == 3 and len(length_s) <= 19):
                raise ValueError
            status, length = int(status_s), int(length_s)
        except ValueError:
            raise StoreUnavailable(f"batch answer: a malformed frame head {bytes(self.head[:100])!r}") from None
        if got != key:
            raise StoreUnavailable(f"batch answer: a frame for {got[:200]!r} where {key} was due")
        if status not in BATCH_STATUSES:
            raise StoreUnavailable(f"batch answer: status {status} for {key}")
        if status == 200 and self.max_size is not None and length > self.max_size:
            raise CorruptObject(f"object {key}: {length} bytes, more than such an object can have "
                                f"({self.max_size})")
        if status != 200 and length > self.MAX_ERROR:
            raise StoreUnavailable(f"batch answer: an error of {length} bytes for {key}")
        self.head.clear()
        self.status, self.want = status, length

    def _finish(self) -> tuple[str, int, bytes]:
        key = self.expected[self.next]
        whole = len(self.parts) == 1 and isinstance(self.parts[0].obj, bytes) and self.parts[0].nbytes == len(
            self.parts[0].obj)
        body = self.parts[0].obj if whole else b"".join(self.parts)
        self.parts, self.want = [], -1
        self.next += 1
        return key, self.status, body

    def check_done(self) -> None:
        """At the end of the body: every frame was whole (a cut answer is a broken stream)."""
        if self.want >= 0 or self.head:
            raise StoreUnavailable("batch answer: cut in the middle of a frame (broken stream)")
