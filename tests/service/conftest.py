"""A store service for the tests of this package: one per module on a local store, with a token
of every scope (the service is a subprocess, `testkit.store_service`, stopped at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from testkit.store_service import Service, make_tokens, start_service

from layerstore.store import Store

# id -> scopes; "secret/" names are private
SCOPES = {"read": ["read"], "readsecret": ["read:secret/"], "pushteam": ["push:team/"], "pushall": ["push:*"],
          "gc": ["gc"], "admin": ["admin"], "node": ["read", "lease"], "nothing": []}
PRIVATE = ["secret/"]


@dataclass
class Served:
    service: Service
    tokens: dict[str, str]
    tokens_file: Path
    store_dir: Path

    @property
    def url(self) -> str:
        return self.service.url

    def auth(self, who: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def local(self) -> Store:
        """The store behind the service, opened directly."""
        return Store.open(str(self.store_dir))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("service")
    store_dir = work / "store"
    with Store.open(str(store_dir)) as s:
        s.init()
    tokens_file = work / "tokens.json"
    tokens = make_tokens(tokens_file, SCOPES, private=PRIVATE)
    svc = start_service(str(store_dir), work, tokens=tokens_file, workers=2, body_timeout=3.0)
    try:
        yield Served(svc, tokens, tokens_file, store_dir)
    finally:
        svc.stop()
