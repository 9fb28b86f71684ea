"""Bounded work from hostile objects on the store service (issue 27): a chunk map over its
blob's bound is refused from its header, before the rest of its body is read or anything is
decoded; chunks that decompress to the largest legal size, many at once, are checked within the
service's decode budget (service/budget.py). Memory is the worker's own, from /proc/PID/status
(one worker: `layerctl serve --workers 1` serves in its own process)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import zstandard
from testkit.hostile_maps import one_byte_map
from testkit.procmem import MiB, peak_rss, reset_peak, rss
from testkit.store_service import Service, make_tokens, start_service

from layerstore import chunkmap, chunkobj, keys
from layerstore import digest as digestmod
from layerstore.store import Store
from service.budget import DEFAULT_BUDGET

pytestmark = [pytest.mark.hostile, pytest.mark.slow]  # a real service bombed: `make test`, not `make check`

DEADLINE = 20.0  # a liveness bound: any answer (the body timeout is 10 s)
BOMBS = 32


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    work = tmp_path_factory.mktemp("bounded")
    store_dir = work / "store"
    with Store.open(str(store_dir)) as s:
        s.init()
    tokens_file = work / "tokens.json"
    tokens = make_tokens(tokens_file, {"admin": ["admin"]})
    service = start_service(str(store_dir), work, tokens=tokens_file, workers=1, body_timeout=10.0)
    try:
        yield service, tokens["admin"]
    finally:
        service.stop()


def test_a_map_over_the_bound_is_refused_from_its_header(svc: tuple[Service, str]) -> None:
    """The issue's map: 4,194,304 entries of one 1-byte chunk (192 MiB). The service answers 422
    once it has the header, having read 1 MiB of the body. Old code waited for the whole body
    (here: the body timeout, 408), then decoded it (26 s, the worker at 1.2 GiB)."""
    service, token = svc
    blob, data = one_byte_map(chunkmap.MAX_ENTRIES)
    path = "/v1/objects/" + keys.object_key("blobs", blob)
    head = (f"PUT {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    before = rss(service.proc.pid)
    u = urlsplit(service.url)
    with socket.create_connection((u.hostname, u.port), timeout=DEADLINE) as s:
        s.sendall(head + data[: 1 << 20])  # and no more
        answer = b""
        while b"more than 4096" not in answer:  # the JSON error says why
            part = s.recv(65536)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 422 "), answer[:300]
    assert b"more than 4096" in answer, answer
    assert rss(service.proc.pid) - before < 64 * MiB
    with httpx.Client(base_url=service.url, timeout=DEADLINE) as c:
        assert c.get("/healthz").status_code == 200


def test_the_whole_hostile_map_is_refused_too(svc: tuple[Service, str]) -> None:
    """A client that sends it all (httpx): a 422, or the connection closed under the upload once
    the service has answered; never a stored map, and the worker does not keep the memory."""
    service, token = svc
    blob, data = one_byte_map(chunkmap.MAX_ENTRIES)
    before = rss(service.proc.pid)
    with httpx.Client(base_url=service.url, timeout=DEADLINE, headers={"Authorization": f"Bearer {token}"}) as c:
        try:
            r = c.put("/v1/objects/" + keys.object_key("blobs", blob), content=data)
            assert r.status_code == 422, r.text[:300]
        except httpx.TransportError:
            pass  # the service answered and closed before the client finished sending
        del data
        assert c.get("/healthz").status_code == 200
        assert c.head("/v1/objects/" + keys.object_key("blobs", blob)).status_code == 404
    assert rss(service.proc.pid) - before < 64 * MiB


def _bomb(i: int) -> tuple[str, bytes]:
    """A chunk of the largest legal size (64 MiB) that compresses to a few KiB: a legal chunk,
    its digest right, and each PUT of it decompresses it to check it."""
    payload = bytes([i]) * chunkobj.MAX_CHUNK
    body = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(payload)
    obj = chunkobj.HEADER.pack(chunkobj.MAGIC, chunkobj.VERSION, chunkobj.COMP_ZSTD, 0, len(payload)) + body
    return digestmod.of(payload), obj


def test_parallel_zstd_bombs_stay_within_the_decode_budget(svc: tuple[Service, str], tmp_path: Path) -> None:
    """32 at once, each decompressed to 64 MiB while it is checked. Old code checked them all at
    once (anyio's 40 threads): the issue measured a worker going from 130 to 1,206 MiB. Now at
    most the budget (256 MiB) is decompressed at once: the worker's peak grows by at most the
    budget and what the bodies and Python's allocator keep."""
    service, token = svc
    bombs = [_bomb(i) for i in range(BOMBS)]
    pid = service.proc.pid
    if not reset_peak(pid):
        pytest.skip("cannot reset the service's VmHWM")
    before = rss(pid)
    with httpx.Client(base_url=service.url, timeout=120.0, headers={"Authorization": f"Bearer {token}"},
                      limits=httpx.Limits(max_connections=BOMBS)) as c:
        def put(item: tuple[str, bytes]) -> int:
            return c.put("/v1/objects/" + keys.object_key("chunks", item[0]), content=item[1]).status_code

        with ThreadPoolExecutor(BOMBS) as pool:
            statuses = list(pool.map(put, bombs))
        assert statuses == [201] * BOMBS
        assert c.get("/healthz").status_code == 200
    growth = peak_rss(pid) - before
    print(f"worker RSS {before / MiB:.0f} MiB, peak +{growth / MiB:.0f} MiB during {BOMBS} bombs")
    assert growth <= DEFAULT_BUDGET + 128 * MiB, f"peak grew by {growth / MiB:.0f} MiB"
