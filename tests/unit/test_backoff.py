"""Waits before trying again (controller/backoff.py): they grow, stay within their bounds, and
differ from one loop to the next, so that what failed together does not retry together."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest

from kubetune.controller.backoff import Backoff, BackoffWait, spread
from kubetune.controller.status_writes import REJECTED_RETRY_SECONDS
from kubetune.controller.waiting import LOOK_RETRY, backoff

pytestmark = pytest.mark.unit


def test_ceilings_double_up_to_the_cap() -> None:
    waits = Backoff(first=2.0, cap=60.0)
    assert [waits.ceiling(n) for n in range(1, 9)] == [2, 4, 8, 16, 32, 60, 60, 60]
    assert waits.ceiling(0) == 2.0  # no failure yet counts as the first
    assert waits.ceiling(10_000) == 60.0  # no overflow however long it fails


@pytest.mark.parametrize("seed", range(5))
def test_each_wait_lies_in_the_upper_half_of_its_step_and_they_grow(seed: int) -> None:
    rng = random.Random(seed)
    waits = [LOOK_RETRY.delay(n, rng) for n in range(1, 12)]
    for n, wait in enumerate(waits, start=1):
        assert LOOK_RETRY.ceiling(n) / 2 <= wait <= LOOK_RETRY.ceiling(n)
    # Each step's lower bound is the last one's upper bound, until the cap.
    assert waits[:6] == sorted(waits[:6])
    assert all(30.0 <= wait <= 60.0 for wait in waits[6:])


def test_two_loops_that_failed_together_wait_different_times() -> None:
    rng = random.Random(20260101)
    first = [backoff(n, rng) for n in range(1, 6)]
    second = [backoff(n, rng) for n in range(1, 6)]
    assert all(a != b for a, b in zip(first, second, strict=True))


def test_a_seeded_source_draws_the_same_waits() -> None:
    draw = [LOOK_RETRY.delay(n, random.Random(7)) for n in range(1, 6)]
    assert draw == [LOOK_RETRY.delay(n, random.Random(7)) for n in range(1, 6)]


def test_waits_after_rejected_status_writes_reach_at_most_the_resync_period() -> None:
    rng = random.Random(3)
    waits = Backoff(REJECTED_RETRY_SECONDS, 120.0)
    assert [waits.ceiling(n) for n in range(1, 7)] == [5, 10, 20, 40, 80, 120]
    assert all(60.0 <= waits.delay(30, rng) <= 120.0 for _ in range(100))


def test_a_repeated_wait_is_spread_around_its_period() -> None:
    rng = random.Random(11)
    waits = [spread(15.0, 0.1, rng) for _ in range(2000)]
    assert all(13.5 <= wait <= 16.5 for wait in waits)
    assert len(set(waits)) == len(waits)
    # On average the period itself: queued jobs are re-planned as often as before.
    assert statistics.fmean(waits) == pytest.approx(15.0, rel=0.01)


def test_as_a_tenacity_wait_the_nth_failed_attempt_takes_the_nth_wait() -> None:
    waits = Backoff(first=0.3, cap=5.0)
    strategy = BackoffWait(waits, random.Random(5))
    expected = random.Random(5)
    for attempt in range(1, 6):
        state = SimpleNamespace(attempt_number=attempt)
        assert strategy(state) == waits.delay(attempt, expected)
