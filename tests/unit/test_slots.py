"""Planning threads handed out first looks first (kubetune.controller.slots)."""

from __future__ import annotations

import asyncio

import pytest

from kubetune.controller.slots import LookPriority, PrioritySlots

pytestmark = pytest.mark.unit


async def _run(slots: PrioritySlots, order: list[str], name: str, priority: int) -> None:
    async with slots.hold(priority):
        order.append(name)
        await asyncio.sleep(0)  # hold the slot across a switch, as a look does


async def test_waiters_enter_by_priority_then_arrival() -> None:
    slots = PrioritySlots(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def holder() -> None:
        async with slots.hold(LookPriority.LATER):
            order.append("holder")
            await gate.wait()

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    tasks = [
        asyncio.create_task(_run(slots, order, name, priority))
        for name, priority in [
            ("later-1", LookPriority.LATER),
            ("first-1", LookPriority.FIRST),
            ("later-2", LookPriority.LATER),
            ("first-2", LookPriority.FIRST),
        ]
    ]
    await asyncio.sleep(0)
    assert slots.waiting == 4
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order == ["holder", "first-1", "first-2", "later-1", "later-2"]
    assert slots.waiting == 0


async def test_never_more_holders_than_slots() -> None:
    slots = PrioritySlots(2)
    inside = 0
    most = 0

    async def look(priority: int) -> None:
        nonlocal inside, most
        async with slots.hold(priority):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.001)
            inside -= 1

    await asyncio.gather(*(look(i % 2) for i in range(40)))
    assert most == 2 and inside == 0
    # every slot came back: two holders enter at once again
    both = asyncio.Event()
    entered = 0

    async def pair() -> None:
        nonlocal entered
        async with slots.hold(LookPriority.FIRST):
            entered += 1
            if entered == 2:
                both.set()
            await asyncio.wait_for(both.wait(), 1)

    await asyncio.gather(pair(), pair())


async def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    slots = PrioritySlots(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def holder() -> None:
        async with slots.hold(LookPriority.LATER):
            await gate.wait()

    held = asyncio.create_task(holder())
    await asyncio.sleep(0)
    doomed = asyncio.create_task(_run(slots, order, "doomed", LookPriority.FIRST))
    after = asyncio.create_task(_run(slots, order, "after", LookPriority.LATER))
    await asyncio.sleep(0)
    doomed.cancel()
    gate.set()
    await asyncio.gather(held, after)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert order == ["after"]
    # and the slot is free again
    await asyncio.wait_for(_run(slots, order, "last", LookPriority.LATER), 1)


def test_a_slot_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PrioritySlots(0)
