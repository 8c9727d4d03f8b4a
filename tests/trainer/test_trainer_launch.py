"""The launcher's exit-code reduction: no torch needed, so it runs in every environment."""

from __future__ import annotations

import pytest

from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
)
from kubetune_trainer.launch import combine_exit_codes

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([0, 0], EXIT_OK),
        ([EXIT_PREEMPTED, EXIT_PREEMPTED], EXIT_PREEMPTED),
        ([EXIT_PREEMPTED, -9], EXIT_PREEMPTED),  # one rank killed after the checkpoint
        ([EXIT_OOM, -15], EXIT_OOM),
        ([EXIT_PREEMPTED, EXIT_OOM], EXIT_OOM),
        ([EXIT_CONFIG_ERROR, EXIT_PREEMPTED], EXIT_CONFIG_ERROR),
        ([EXIT_OOM, EXIT_CONFIG_ERROR], EXIT_OOM),
        ([EXIT_STOPPED, EXIT_PREEMPTED], EXIT_PREEMPTED),
        ([EXIT_STOPPED, 0], EXIT_STOPPED),
        ([1, EXIT_STOPPED], EXIT_STOPPED),
        ([0, 1], 1),
        ([0, -9], 1),
        ([None, 0], EXIT_OK),
        ([], EXIT_OK),
    ],
)
def test_launcher_exit_code_priority(codes: list[int | None], expected: int) -> None:
    assert combine_exit_codes(codes) == expected
