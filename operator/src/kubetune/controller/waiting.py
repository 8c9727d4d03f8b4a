"""How a loop waits between looks: until it is woken, stopped, or its delay has passed; and
how long after failures in a row."""

from __future__ import annotations

import asyncio
import random
from typing import Any, Protocol

from kubetune.controller.backoff import RANDOM, Backoff

LOOK_RETRY = Backoff(first=2.0, cap=60.0)
"""Waits after failed looks in a row: at most 2, 4, … 60 s, each at least half that, so that
loops that failed together (an API-server blip) do not try again together."""


class Stopped(Protocol):
    """A loop's stop flag: controller/loops.py's for a job, kopf's for a pool's daemon."""

    def __bool__(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> Any: ...


async def wait(wake: asyncio.Event, stopped: Stopped, delay: float | None) -> None:
    """Until `wake` is set, the loop is stopped, or `delay` seconds pass (None: no limit)."""
    woken = asyncio.ensure_future(wake.wait())
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({woken, stop}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        stop.cancel()


def backoff(failures: int, rng: random.Random = RANDOM) -> float:
    """Seconds before the next try after `failures` failed looks in a row (`LOOK_RETRY`)."""
    return LOOK_RETRY.delay(failures, rng)
