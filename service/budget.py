"""The service's budget for the memory that checking PUT bodies takes (issue 27): decompressing a
chunk and decoding a chunk map, each holding its cost (`checks.decode_cost`) while it runs. One
budget per worker process, on its event loop (`layerstore.budget.ByteBudget`)."""

from __future__ import annotations

from layerstore.budget import ByteBudget, size_from_env

__all__ = ["BUDGET_ENV", "DEFAULT_BUDGET", "ByteBudget", "budget_from_env"]

BUDGET_ENV = "LAYERSTORE_SERVE_DECODE_BUDGET"
DEFAULT_BUDGET = 256 << 20


def budget_from_env() -> int:
    """The budget in bytes: `LAYERSTORE_SERVE_DECODE_BUDGET` (bytes, or with a K/M/G suffix)."""
    return size_from_env(BUDGET_ENV, DEFAULT_BUDGET)
