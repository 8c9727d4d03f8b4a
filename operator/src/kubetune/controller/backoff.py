"""How long the operator waits before trying again: exponential back-off with jitter.

Fixed delays make every job that failed at the same moment (an API-server blip, a restart of
the operator) try again at the same moment, and fail together again. Each delay here is
drawn at random from the upper half of its exponential step ("equal jitter"): the n-th wait
lies between half and all of `min(cap, first·2ⁿ⁻¹)`, so waits still grow, stay below the
fixed ones they replace, and differ from job to job. A wait that only repeats (the queue
retry) is spread around its period instead (`spread`).

The random source is a parameter everywhere, so that tests can seed it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tenacity.wait import wait_base

RANDOM = random.Random()
"""The operator's own random source for waits (tests give theirs)."""


@dataclass(frozen=True)
class Backoff:
    """Waits that double from `first` up to `cap`, each drawn from the upper half of its step."""

    first: float
    cap: float

    def ceiling(self, n: int) -> float:
        """The longest the n-th wait (n ≥ 1) may be: `min(cap, first·2ⁿ⁻¹)`."""
        return min(self.cap, self.first * 2.0 ** min(max(n, 1) - 1, 60))

    def delay(self, n: int, rng: random.Random = RANDOM) -> float:
        """The n-th wait (n ≥ 1): between half and all of its ceiling."""
        ceiling = self.ceiling(n)
        return ceiling - 0.5 * ceiling * rng.random()


def spread(period: float, fraction: float, rng: random.Random = RANDOM) -> float:
    """`period`, give or take `fraction` of it: a repeated wait that does not repeat in step
    with every other one of the same period, and keeps that period on average."""
    return period * (1.0 + fraction * (2.0 * rng.random() - 1.0))


class BackoffWait(wait_base):
    """A `Backoff` as a tenacity wait strategy: the wait after the n-th failed attempt is
    its n-th wait."""

    def __init__(self, backoff: Backoff, rng: random.Random = RANDOM) -> None:
        self.backoff = backoff
        self.rng = rng

    def __call__(self, retry_state: Any) -> float:
        return self.backoff.delay(retry_state.attempt_number, self.rng)
