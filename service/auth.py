"""Tokens and scopes: who may do what to which key (docs/service.md, "Auth").

A token is `lst_<id>_<secret>`; the tokens file keeps only the sha256 of the whole token, so a
request's token is found by hashing it and looking the hash up (nothing secret is compared in
variable time, and the file does not hold a usable token). Scopes:

    read               read every object and list, private names excepted
    read:<prefix>      read, and also the private names under <prefix>
    push:<prefix>      read (private names under <prefix> too), store content-addressed objects,
                       move and delete the tags of names under <prefix>, write leases/;
                       push:* covers every name but the private ones
    lease              create, renew and drop leases (leases/): a node daemon's hold on the blobs
                       it serves, with `read`
    gc                 read everything (private names too), delete anything but `config`, write gc/
    admin              everything: the raw backend, `config`, creating the store

Prefixes are plain string prefixes of environment names (`team/` covers `team/app`). A token
whose only reading scopes are prefixed (`read:P`, `push:P`; no `read`, `push:*`, `gc`, `admin`) is
*namespaced*: its tag listings (and the status page) show only the names its prefixes cover.

Listings (docs/service.md, "What a digest grants"): listing content (`chunks/`, `blobs/`,
`manifests/`, `leases/`, `tags/sig/`, or any prefix that overlaps them, the empty one included)
needs `gc` or `admin`; a reader may list the signatures of one manifest it names by digest
(`tags/sig/<hex>:`) and a lease writer the keys of one lease (`leases/<id>/`). A digest alone is
the capability to read that one object (any reading scope): content addressing, nothing lists it.
The file:

    {"version": 1, "private": ["secret/"], "anonymous": ["read"],
     "tokens": [{"id": "ci", "sha256": "<hex>", "scopes": ["push:team/"], "created": "..."}]}

`TokenTable` re-reads the file when it changes (a `token add` takes effect at once, in every
worker and instance that shares the file); a file that turns malformed fails closed.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerstore.backends import http_wire as wire
from layerstore.errors import ConfigError, PermissionDenied, StoreUnavailable
from layerstore.fileio import write_atomic

TOKEN_PREFIX = "lst_"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,63}")
_SCOPE = re.compile(r"(read|lease|gc|admin)|(read|push):(\*|[a-z0-9][a-z0-9._/-]{0,255})")
CONTENT_LISTINGS = ("chunks/", "blobs/", "manifests/", "leases/")  # enumerating these needs gc
SIG_TAGS = "tags/sig/"
_ONE_MANIFEST_SIGS = re.compile(r"tags/sig/[0-9a-f]{64}:")  # the signatures of one manifest
_ONE_LEASE = re.compile(r"leases/[^/]+/")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(token_id: str) -> str:
    if not _ID.fullmatch(token_id):
        raise ConfigError(f"bad token id {token_id!r} (letters, digits, '.', '-'; at most 64)")
    return f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"


def check_scopes(scopes: Iterable[str]) -> list[str]:
    out = []
    for s in scopes:
        if not isinstance(s, str) or not _SCOPE.fullmatch(s):
            raise ConfigError(f"bad scope {s!r} (read, read:PREFIX, push:PREFIX, push:*, lease, gc, admin)")
        out.append(s)
    return out


@dataclass(frozen=True)
class Principal:
    """What one request may do: the scopes of its token (or of anonymous requests)."""

    id: str
    scopes: frozenset[str]
    private: tuple[str, ...] = ()

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def gc(self) -> bool:
        return self.admin or "gc" in self.scopes

    def _prefixes(self, kind: str) -> list[str]:
        return [s.split(":", 1)[1] for s in self.scopes if s.startswith(kind + ":")]

    @property
    def can_push(self) -> bool:
        return self.admin or bool(self._prefixes("push"))

    @property
    def can_read(self) -> bool:
        return self.gc or "read" in self.scopes or bool(self._prefixes("read")) or self.can_push

    def is_private(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.private)

    def _covers(self, prefix: str, name: str) -> bool:
        """`push:*` covers every name but the private ones: a private name is reached only by a
        scope that names it."""
        return not self.is_private(name) if prefix == "*" else name.startswith(prefix)

    def sees(self, name: str) -> bool:
        """May this principal know that environment `name` exists?"""
        if self.gc:
            return True
        if any(self._covers(p, name) for p in self._prefixes("read") + self._prefixes("push")):
            return True
        return self.can_read and not self.is_private(name)

    @property
    def namespaced(self) -> bool:
        """Reads only through prefixed scopes (`read:P`, `push:P`): listings show its names only."""
        return not self.gc and "read" not in self.scopes and "*" not in self._prefixes("push")

    def lists(self, name: str) -> bool:
        """May a listing (or the status page) show environment `name` to this principal?"""
        if self.namespaced:
            return any(self._covers(p, name) for p in self._prefixes("read") + self._prefixes("push"))
        return self.sees(name)

    def list_refusal(self, prefix: str) -> str | None:
        """Why this principal may not list `prefix` (None: it may; `shows` filters the keys)."""
        if self.gc:
            return None
        if not self.can_read:
            return f"token {self.id} may not list"
        if prefix.startswith(SIG_TAGS):
            if _ONE_MANIFEST_SIGS.match(prefix):
                return None
            return (f"token {self.id} may not list {prefix!r}: listing signatures needs a manifest's digest "
                    f"({SIG_TAGS}<hex>:) or the gc or admin scope")
        for p in CONTENT_LISTINGS:
            if p.startswith(prefix) or prefix.startswith(p):
                if p == "leases/" and _ONE_LEASE.fullmatch(prefix) and self.may_write(prefix + "head"):
                    return None  # the keys of one lease it names (`layerctl lease rm`)
                return (f"token {self.id} may not list {prefix or '/'!r}: listing {p} enumerates the store's "
                        "content and needs the gc or admin scope (a digest alone reads one object)")
        return None

    def shows(self, key: str, prefix: str) -> bool:
        """Whether an allowed listing of `prefix` shows `key`: tags by their names' visibility,
        signatures only in a listing of one manifest's."""
        if self.gc or not key.startswith("tags/"):
            return True
        if key.startswith(SIG_TAGS):
            return _ONE_MANIFEST_SIGS.match(prefix) is not None and self.may_read(key)
        name = wire.tag_name(key)
        return name is not None and self.lists(name)

    def may_read(self, key: str) -> bool:
        name = wire.tag_name(key)
        if name is not None:
            return self.sees(name)
        if key.startswith("tags/"):
            return self.gc  # not a valid tag key: only the raw view
        return self.can_read

    def may_write(self, key: str) -> bool:
        if self.admin:
            return True
        kind = wire.kind_of(key)
        if kind == "leases":
            return self.can_push or "lease" in self.scopes
        if kind in wire.CONTENT_KINDS:
            return self.can_push
        if kind == "tags":
            name = wire.tag_name(key)
            return name is not None and any(self._covers(p, name) for p in self._prefixes("push"))
        if kind == "gc":
            return self.gc
        return False

    def may_delete(self, key: str) -> bool:
        if self.admin:
            return True
        kind = wire.kind_of(key)
        if kind in ("tags", "leases") and self.may_write(key):
            return True
        return self.gc and kind != "config"


ADMIN = Principal("admin", frozenset({"admin"}))


@dataclass
class TokenFile:
    """The parsed tokens file."""

    tokens: list[dict[str, Any]] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    anonymous: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, raw: bytes, where: str) -> TokenFile:
        try:
            obj = json.loads(raw)
        except ValueError:
            raise ConfigError(f"tokens file {where} is not JSON") from None
        if not isinstance(obj, dict) or obj.get("version", 1) != 1:
            raise ConfigError(f"tokens file {where}: want an object with version 1")
        tokens = obj.get("tokens", [])
        private = obj.get("private", [])
        anonymous = check_scopes(obj.get("anonymous", []))
        if not isinstance(tokens, list) or not isinstance(private, list):
            raise ConfigError(f"tokens file {where}: tokens and private are lists")
        for t in tokens:
            if (not isinstance(t, dict) or not isinstance(t.get("id"), str)
                    or not re.fullmatch(r"[0-9a-f]{64}", str(t.get("sha256", "")))):
                raise ConfigError(f"tokens file {where}: malformed token entry {t!r:.100}")
            check_scopes(t.get("scopes", []))
        if not all(isinstance(p, str) and p for p in private):
            raise ConfigError(f"tokens file {where}: private holds non-empty name prefixes")
        return cls(tokens, private, anonymous)

    def to_json(self) -> bytes:
        return json.dumps({"version": 1, "private": self.private, "anonymous": self.anonymous,
                           "tokens": self.tokens}, indent=1, sort_keys=True).encode() + b"\n"

    def add(self, token_id: str, scopes: list[str]) -> str:
        check_scopes(scopes)
        if any(t["id"] == token_id for t in self.tokens):
            raise ConfigError(f"a token {token_id!r} exists (remove it first)")
        token = new_token(token_id)
        self.tokens.append({"id": token_id, "sha256": hash_token(token), "scopes": scopes,
                            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
        return token

    def remove(self, token_id: str) -> bool:
        before = len(self.tokens)
        self.tokens = [t for t in self.tokens if t["id"] != token_id]
        return len(self.tokens) != before


def load_token_file(path: Path) -> TokenFile:
    try:
        return TokenFile.parse(path.read_bytes(), str(path))
    except FileNotFoundError:
        return TokenFile()
    except OSError as e:
        raise PermissionDenied(f"cannot read tokens file {path}: {os.strerror(e.errno or 0)}") from None


def save_token_file(path: Path, tf: TokenFile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, tf.to_json(), mode=0o600)


class TokenTable:
    """The tokens of a file, re-read when the file changes. `path=None`: no tokens file, every
    request is admin (only allowed on loopback or a Unix socket, see `layerctl serve`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._by_hash: dict[str, Principal] = {}
        self._anonymous: Principal | None = None
        self._error: str | None = None
        if path is not None:
            self._reload(strict=True)

    def _reload(self, *, strict: bool) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        except OSError as e:
            raise PermissionDenied(f"tokens file {self.path}: {os.strerror(e.errno or 0)}") from None
        if stamp == self._stamp:
            return
        try:
            tf = load_token_file(self.path)
        except (ConfigError, PermissionDenied) as e:
            if strict:
                raise
            self._error, self._stamp, self._by_hash, self._anonymous = str(e), stamp, {}, None
            return
        private = tuple(tf.private)
        self._by_hash = {t["sha256"]: Principal(t["id"], frozenset(t.get("scopes", [])), private) for t in tf.tokens}
        self._anonymous = Principal("anonymous", frozenset(tf.anonymous), private) if tf.anonymous else None
        self._stamp, self._error = stamp, None

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of a request's `Authorization` header; `Unauthenticated` if it names no
        known token (or names none and anonymous requests may do nothing)."""
        if self.path is None:
            return ADMIN
        with self._lock:
            self._reload(strict=False)
            if self._error is not None:
                raise StoreUnavailable(f"the service's tokens file is unusable: {self._error}")
            by_hash, anonymous = self._by_hash, self._anonymous
        if not authorization:
            if anonymous is None:
                raise wire.Unauthenticated("a token is required (Authorization: Bearer ...)")
            return anonymous
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise wire.Unauthenticated("malformed Authorization header (want: Bearer <token>)")
        principal = by_hash.get(hash_token(token.strip()))
        if principal is None:
            raise wire.Unauthenticated("unknown token")
        return principal
