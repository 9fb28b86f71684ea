"""What the service's routes depend on, read from `app.state`: the service's state (`Service`:
the store and what serves it, built once by `create_app`) and who asks (`principal`: the bearer
token looked up in the app's `TokenTable`).

Both dependencies are `async def`: FastAPI runs a plain `def` dependency in a worker thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from layerstore.backends import Backend
from layerstore.store import Store

from .auth import Principal
from .budget import ByteBudget, budget_from_env
from .cached_reads import CachedReader
from .leaseowner import LeaseGuard

DEFAULT_BODY_TIMEOUT = 120.0

bearer = HTTPBearer(auto_error=False, description="A token of `layerctl serve token add`")


@dataclass(frozen=True, slots=True)
class Service:
    """The state every request of one app shares; nothing in it is the store's own state."""

    store: Store
    backend: Backend
    cached: CachedReader | None  # the page cache of a local store, read in the loop (cached_reads.py)
    lease_guard: LeaseGuard  # leases belong to their writer's token (leaseowner.py)
    budget: ByteBudget  # bytes that checking bodies may decode at once (budget.py)
    body_timeout: float  # seconds for a request's body to arrive

    @classmethod
    def build(cls, store: Store, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> Service:
        backend = store.backend
        return cls(store, backend, CachedReader.for_backend(backend), LeaseGuard(backend),
                   ByteBudget(budget_from_env()), body_timeout)


async def principal(request: Request,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """Who is asking: the bearer token looked up in the app's token table (the status page's
    cookie counts on the status page only: `signin.reader`)."""
    return request.app.state.tokens.authenticate(request.headers.get("authorization"))


async def service(request: Request) -> Service:
    """The app's `Service`."""
    return request.app.state.service


Who = Annotated[Principal, Depends(principal)]
Svc = Annotated[Service, Depends(service)]
