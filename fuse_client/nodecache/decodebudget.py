"""The node's budget for the memory that fetched chunks take while they are verified and
decompressed (issue 27): a chunk's payload can be 64 MiB from an object of a few KiB, and the
fetcher has up to `concurrency` store requests in flight. Each decode holds its cost (`cost`)
while its worker thread runs, in a `layerstore.budget.ByteBudget` on the trio loop.

A decode abandoned by a cancelled flight (`abandon_on_cancel`) gives its share back when the
flight ends, while its thread may still finish in the background: such threads are bounded by
the fetcher's thread limiter, not by this budget."""

from __future__ import annotations

from collections.abc import Iterable

from layerstore.budget import ByteBudget, size_from_env

__all__ = ["BUDGET_ENV", "DEFAULT_BUDGET", "ByteBudget", "budget_from_env", "cost"]

BUDGET_ENV = "LAYERSTORE_DECODE_BUDGET"
DEFAULT_BUDGET = 128 << 20


def budget_from_env() -> int:
    """`LAYERSTORE_DECODE_BUDGET` in bytes (or with a K/M/G suffix), else 128 MiB."""
    return size_from_env(BUDGET_ENV, DEFAULT_BUDGET)


def cost(lengths: Iterable[int]) -> int:
    """What decoding chunks of these lengths (from their verified chunk map) holds at once, one
    request's worth: one chunk's payload and its object (a raw object is as long as its payload;
    a payload is copied or decompressed out of it), plus the objects of the others (a batched
    read may have them all in before they are decoded one by one)."""
    ls = list(lengths)
    return sum(ls) + max(ls, default=0)
