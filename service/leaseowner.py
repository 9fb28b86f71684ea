"""Leases belong to the token that wrote them (issue 27; docs/lease-owners.md).

A lease (`leases/<id>/head` and its shards, `layerstore.leases`) keeps the collector away from
the objects it holds. Through the service, a token that may write `leases/` could otherwise drop
or shorten any holder's lease and let the collector delete what it held. So the service stamps a
lease head it stores for a token without `gc` with that token's id (`"owner"` in the head's JSON,
whatever the client sent) and, for such a token, refuses (403) any write or delete of a lease
whose head another token owns, or that no token owns (a head written directly to the backend,
or by gc/admin, belongs to them). A head is written by compare-and-swap against the head it was
checked against (`Backend.replace_if`), so two writers cannot both pass the check. `gc` and
`admin` do not come here: they may still drop any lease (the collector's expiry, `lease rm`).

Shards (`leases/<id>/s<seq>`, create-once) may be written and deleted only by the head's owner;
keys of a lease whose head is gone are left to the collector (its orphan sweep) by a bulk delete,
and a 403 for a single delete, so no token can remove a shard of a lease another token is
creating under the same id at that moment.

Everything here is blocking (backend calls): the app runs it in a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from layerstore import leases
from layerstore.backends import Backend
from layerstore.backends import http_wire as wire
from layerstore.errors import NotFound, PermissionDenied, StoreUnavailable

from .auth import Principal

OWNER = "owner"
CAS_ATTEMPTS = 16  # a head changes only by its owner's (or gc's) hand: a few tries are plenty


def lease_of(key: str) -> tuple[str, str]:
    """(lease id, leaf) of a checked lease key `leases/<id>/<leaf>`."""
    lease_id, _, leaf = key[len(leases.LEASES):].partition("/")
    return lease_id, leaf


def owner_of(head: bytes) -> str | None:
    """The token id a stored head names as its owner (None: no token owns it)."""
    try:
        obj = json.loads(head)
    except (ValueError, RecursionError):
        return None
    owner = obj.get(OWNER) if isinstance(obj, dict) else None
    return owner if isinstance(owner, str) else None


def stamp(data: bytes, owner: str, key: str) -> bytes:
    """The head `data` with its owner set to `owner` (a client's own `owner` is overwritten)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise wire.RejectedObject(f"{key}: a lease head is a JSON object") from None
    if not isinstance(obj, dict):
        raise wire.RejectedObject(f"{key}: a lease head is a JSON object")
    obj[OWNER] = owner
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _refuse(who: Principal, lease_id: str, owner: str | None, what: str) -> PermissionDenied:
    holder = f"token {owner}" if owner else "no token (only gc or admin may change it)"
    return PermissionDenied(f"token {who.id} may not {what} lease {lease_id}: it belongs to {holder}")


class LeaseGuard:
    """The owner checks for one backend, for principals without `gc`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _head(self, lease_id: str) -> bytes | None:
        try:
            return self.backend.load(leases.head_key(lease_id), max_size=leases.MAX_HEAD)
        except NotFound:
            return None

    def put(self, who: Principal, key: str, data: bytes, *, if_match: list[str] | None = None,
            create_only: bool = False) -> tuple[bool, bytes]:
        """Store a lease key for `who`: (created, the bytes stored). A head is stamped and
        written by compare-and-swap; a shard needs its lease's head to be `who`'s."""
        lease_id, leaf = lease_of(key)
        if leaf != "head":
            head = self._head(lease_id)
            if head is None or owner_of(head) != who.id:
                raise _refuse(who, lease_id, None if head is None else owner_of(head), "add to")
            if not self.backend.store_once(key, data):
                if create_only:
                    raise wire.PreconditionFailed(f"{key}: the condition of the write does not hold")
                return False, data
            return True, data
        stored = stamp(data, who.id, key)
        for _ in range(CAS_ATTEMPTS):
            current = self._head(lease_id)
            if current is not None:
                if owner_of(current) != who.id:
                    raise _refuse(who, lease_id, owner_of(current), "replace or shorten")
                if create_only or (if_match is not None and "*" not in if_match
                                   and wire.etag_of(key, current) not in if_match):
                    raise wire.PreconditionFailed(f"{key}: the condition of the write does not hold")
            elif if_match is not None:
                raise wire.PreconditionFailed(f"{key}: the condition of the write does not hold")
            if self.backend.replace_if(key, stored, current):
                return current is None, stored
        raise StoreUnavailable(f"lease {lease_id}: its head kept changing while it was written; try again")

    def check_delete(self, who: Principal, key: str) -> None:
        """Raise unless `who` may delete this lease key (its lease's head is `who`'s)."""
        lease_id, _ = lease_of(key)
        head = self._head(lease_id)
        if head is None:
            raise _refuse(who, lease_id, None, "delete from (its head is gone: the collector removes the rest)")
        if owner_of(head) != who.id:
            raise _refuse(who, lease_id, owner_of(head), "drop")

    def deletable(self, who: Principal, keys: Iterable[str]) -> list[str]:
        """The keys of a bulk delete that may go: any other token's lease refuses the whole
        request (403); keys of a lease whose head is gone are left to the collector."""
        heads: dict[str, bytes | None] = {}
        out = []
        for key in keys:
            if wire.kind_of(key) != "leases":
                out.append(key)
                continue
            lease_id, _ = lease_of(key)
            if lease_id not in heads:
                heads[lease_id] = self._head(lease_id)
            head = heads[lease_id]
            if head is None:
                continue
            if owner_of(head) != who.id:
                raise _refuse(who, lease_id, owner_of(head), "drop")
            out.append(key)
        return out
