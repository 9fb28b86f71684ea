"""The answer of a batched read (`POST /v1/batch`, docs/service.md "Batched reads"): one frame per
key, in the order asked (`http_wire.frame_head`), each the object or the error a single GET of it
would answer.

When the page cache of a local store holds every item (and they make at most `WHOLE` bytes), the
items are read in the event loop and sent with a Content-Length. Otherwise items are read `AHEAD`
at a time (a page-cache hit in the loop, anything else in a worker thread, so a batch in front of
S3 reads its objects in parallel) and sent in order as soon as the next one is ready, in a chunked
answer whose status is sent before the items are read: an item's failure is that item's frame,
and a failure of the connection or the service mid-answer is a cut answer the client sees as a
broken stream (and retries)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response

from layerstore.backends import http_wire as wire

AHEAD = 4
WHOLE = 64 << 20  # a batch the page cache answers up to this size is sent with its length
Item = tuple[int, bytes | memoryview]  # (status, body): the object (200) or the error's JSON
Fetch = Callable[[str], Awaitable[Item]]
Quick = Callable[[str], "Item | None"]  # the item if the page cache has it (no waiting), else None


class BatchResponse(Response):
    media_type = wire.BATCH_TYPE

    def __init__(self, keys: list[str], fetch: Fetch, quick: Quick | None = None) -> None:
        super().__init__(status_code=200, media_type=self.media_type, headers={"Cache-Control": "no-store"})
        del self.headers["content-length"]
        self.keys = keys
        self.fetch = fetch
        self.quick = quick

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        n = len(self.keys)
        items: list[Item | None] = [None] * n
        if self.quick is not None and await self.whole(items, send):
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ready = [anyio.Event() for _ in range(n)]
        room = anyio.Semaphore(AHEAD)

        async def one(i: int) -> None:
            if items[i] is None:
                items[i] = await self.fetch(self.keys[i])  # answers every failure as a frame
            ready[i].set()

        async def feed(tg: anyio.abc.TaskGroup) -> None:
            for i in range(n):
                await room.acquire()
                tg.start_soon(one, i)

        async with anyio.create_task_group() as tg:
            tg.start_soon(feed, tg)
            for i, key in enumerate(self.keys):
                await ready[i].wait()
                item = items[i]
                assert item is not None
                items[i] = None
                status, body = item
                await send({"type": "http.response.body", "body": wire.frame_head(status, len(body), key),
                            "more_body": True})
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                room.release()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def whole(self, items: list[Item | None], send: Any) -> bool:
        """When the page cache holds every item (a local store's usual case) and they are at most
        `WHOLE` bytes: send them with a Content-Length (no chunked framing, whose every chunk the
        server copies once more) and True. Else False, with `items` holding what was read."""
        assert self.quick is not None
        total = 0
        for i, key in enumerate(self.keys):
            item = self.quick(key)
            if item is None:
                return False
            items[i] = item
            total += len(wire.frame_head(item[0], len(item[1]), key)) + len(item[1])
            if total > WHOLE:
                return False
        headers = [*self.raw_headers, (b"content-length", b"%d" % total)]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        for i, key in enumerate(self.keys):
            item = items[i]
            assert item is not None
            items[i] = None
            status, body = item
            last = i == len(self.keys) - 1
            await send({"type": "http.response.body", "body": wire.frame_head(status, len(body), key),
                        "more_body": bool(body) or not last})
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": not last})
        return True
