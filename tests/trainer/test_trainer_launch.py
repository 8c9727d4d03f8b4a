"""The launcher's exit-code reduction and its reading of torchrun's arguments: no torch
needed, so these run in every environment."""

from __future__ import annotations

import pytest

from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
)
from kubetune_trainer.launch import combine_exit_codes, one_local_worker

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


@pytest.mark.parametrize(
    ("argv", "trainer_args"),
    [
        # What the operator gives a single-GPU pod.
        (
            "--standalone --nnodes=1 --nproc-per-node=1 --max-restarts=0 "
            "-m kubetune_trainer --config /etc/kubetune/config.json",
            ["--config", "/etc/kubetune/config.json"],
        ),
        ("--nproc_per_node 1 --nnodes 1:1 -m kubetune_trainer", []),
        ("-m kubetune_trainer --config c.json", ["--config", "c.json"]),
        # Anything torchrun must do itself.
        ("--standalone --nproc-per-node=2 -m kubetune_trainer", None),
        ("--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d -m kubetune_trainer", None),
        ("--nnodes=1 --rdzv-endpoint=h:29400 -m kubetune_trainer", None),
        ("--standalone --max-restarts=3 -m kubetune_trainer", None),
        ("--standalone --shutdown-timeout=30 -m kubetune_trainer", None),
        ("--standalone -m other_module", None),
        ("--standalone script.py", None),
        ("--nproc-per-node", None),
    ],
)
def test_one_local_worker_is_recognised(argv: str, trainer_args: list[str] | None) -> None:
    assert one_local_worker(argv.split()) == trainer_args
