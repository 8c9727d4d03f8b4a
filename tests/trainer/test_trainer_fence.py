"""The checkpoint folder's writer epoch (kubetune_trainer.fence): a stale attempt of a job,
still running beside the later one on a shared volume, deletes and renames nothing there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch
from torch import nn

import kubetune_trainer.checkpoint as checkpoint
from kubetune_trainer.__main__ import main
from kubetune_trainer.checkpoint import Checkpointer
from kubetune_trainer.contract import EXIT_SUPERSEDED
from kubetune_trainer.distributed import DistEnv
from kubetune_trainer.errors import Superseded
from kubetune_trainer.fence import WRITER_FILE, Writer, WriterFence, read_writer
from support.trainer import trainer_config, write_config

pytestmark = pytest.mark.trainer

ONE = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def attempt(root: Path, n: int, uid: str = "u1") -> Checkpointer:
    fence = WriterFence(root, Writer(job_uid=uid, attempt=n), ONE)
    return Checkpointer(root, keep=1, env=ONE, adapter_only=False, fence=fence)


def small_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return model, opt


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def save(ck: Checkpointer, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    return ck.save(step, model, opt, {"step": step, "seed": 0}, checkpoint.capture_rng())[0]


def test_a_stale_attempt_saves_and_prunes_nothing_once_a_later_one_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = small_state()
    old, new = attempt(tmp_path, 1), attempt(tmp_path, 2)
    old.claim()
    save(old, 4, model, opt)
    new.claim()  # attempt 2 starts (attempt 1 is cut off from the control plane, not the volume)
    save(new, 5, model, opt)
    # keep=1: attempt 1's next save would prune step-5, the folder attempt 2 resumes from.
    with pytest.raises(Superseded, match="written by attempt 2 of job uid u1"):
        save(old, 6, model, opt)
    assert steps(tmp_path) == ["step-5"]
    assert read_writer(tmp_path) == Writer("u1", 2)

    # A save already under way when the later attempt claims: it is not published, and its
    # temp folder is its own (two attempts at one step never share one).
    later = attempt(tmp_path, 3)
    original = Checkpointer._write_state

    def claimed_meanwhile(self: Checkpointer, tmp: Path, state: dict[str, Any]) -> None:
        original(self, tmp, state)
        later.claim()

    monkeypatch.setattr(Checkpointer, "_write_state", claimed_meanwhile)
    with pytest.raises(Superseded, match="publishing checkpoint step-7"):
        save(new, 7, model, opt)
    assert steps(tmp_path) == ["step-5"]
    assert (tmp_path / ".tmp-step-7.a2").is_dir()
    monkeypatch.undo()
    save(later, 7, model, opt)  # the writer's own prune clears the stale temp folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-7", WRITER_FILE]


def test_another_job_claims_over_a_higher_attempt(tmp_path: Path) -> None:
    """The folder outlives the job: a same-name job (another uid) starts at attempt 1."""
    attempt(tmp_path, 9, uid="u0").claim()
    attempt(tmp_path, 1, uid="u1").claim()
    assert read_writer(tmp_path) == Writer("u1", 1)
    (tmp_path / WRITER_FILE).write_text("{not json")  # an interrupted write: claimed over
    attempt(tmp_path, 1, uid="u1").claim()
    assert read_writer(tmp_path) == Writer("u1", 1)


def test_a_stale_attempt_starting_late_leaves_the_later_ones_save_alone(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 2's pod starts after attempt 3 claimed the folder: it exits 46 before its
    start-up removes unfinished saves, so attempt 3's save in flight survives."""
    ckpt = tmp_path / "ckpt"
    in_flight = ckpt / ".tmp-step-5.a3"
    in_flight.mkdir(parents=True)
    (in_flight / "__0_0.distcp").write_bytes(b"being written")
    (ckpt / WRITER_FILE).write_text(json.dumps({"job_uid": "u1", "attempt": 3}))
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", training={"max_steps": 2})
    cfg["checkpoint"]["attempt"] = 2
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(tmp_path / "termination-log"))
    assert main(["--config", str(write_config(tmp_path, cfg))]) == EXIT_SUPERSEDED
    assert (in_flight / "__0_0.distcp").read_bytes() == b"being written"
    assert steps(ckpt) == []
    message = (tmp_path / "termination-log").read_text()
    assert "written by attempt 3 of job uid u1, not by this attempt 2" in message
    assert "delete writer.json" in message
