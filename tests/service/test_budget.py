"""The service's decode budget (service/budget.py): what it lets run at once, in what order."""

from __future__ import annotations

import anyio
import pytest

from layerstore.errors import ConfigError
from service.budget import BUDGET_ENV, DEFAULT_BUDGET, ByteBudget, budget_from_env


def test_holds_at_most_the_budget_in_arrival_order() -> None:
    order: list[str] = []

    async def main() -> ByteBudget:
        b = ByteBudget(100)
        gate = anyio.Event()

        async def one(name: str, cost: int) -> None:
            async with b.hold(cost):
                order.append(name)
                assert b.held <= b.total
                await gate.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", 60)
            await anyio.sleep(0.01)
            tg.start_soon(one, "big", 1000)  # more than the whole budget: holds all of it, alone
            await anyio.sleep(0.01)
            tg.start_soon(one, "c", 10)  # fits, but waits its turn behind "big"
            await anyio.sleep(0.01)
            assert order == ["a"] and b.waiting == 2
            gate.set()
        return b

    b = anyio.run(main)
    assert order == ["a", "big", "c"] and b.free == b.total and b.peak == 100


def test_a_cancelled_waiter_gives_its_turn_back() -> None:
    async def main() -> ByteBudget:
        b = ByteBudget(100)
        async with b.hold(80):
            with anyio.move_on_after(0.02):
                async with b.hold(50):
                    raise AssertionError("granted beyond the budget")
            assert b.waiting == 0
        async with b.hold(100):
            pass
        return b

    assert anyio.run(main).free == 100


def test_budget_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert budget_from_env() == DEFAULT_BUDGET == 256 << 20
    monkeypatch.setenv(BUDGET_ENV, "64M")
    assert budget_from_env() == 64 << 20
    monkeypatch.setenv(BUDGET_ENV, "0")
    with pytest.raises(ConfigError):
        budget_from_env()
