"""Waiting for a condition the test can observe, instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    """`wait_for` ran out of time."""


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5
) -> Any:
    """Poll `probe` until it returns something truthy, and return that.

    Fails with `WaitTimeout` naming `what` and the last value seen when `timeout` seconds
    pass. A probe that raises (say, an AssertionError because a process it watches died)
    ends the wait at once.
    """
    end = time.monotonic() + timeout
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= end:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)
