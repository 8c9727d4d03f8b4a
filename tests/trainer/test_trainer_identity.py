"""Whose checkpoints: a new job under an old job's name finds the old job's checkpoints on the
retained volume. They are moved aside (the run starts at step 0) unless the job names the old
one in `checkpoint.resume_from_uid` (adopted); a re-plan of the same job and checkpoints of an
older trainer (no identity) resume as before."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import subprocess
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch
from torch import nn

import kubetune_trainer.checkpoint as checkpoint
from kubetune_trainer.__main__ import main
from kubetune_trainer.checkpoint import MANIFEST_FILE, STATE_FILE, Checkpointer
from kubetune_trainer.contract import EXIT_OK, EXIT_OOM
from kubetune_trainer.distributed import DistEnv
from kubetune_trainer.errors import CheckpointFailed
from kubetune_trainer.identity import identity
from kubetune_trainer.recipe import warmup_cosine
from support.trainer import checkpoint_names, load_config, read_log, trainer_config, write_config

pytestmark = pytest.mark.trainer

HINT = "To resume them instead, set spec.checkpoint.resumeFromUID: uid-a on this job"
Usage = namedtuple("Usage", "total used free")
Runner = Callable[..., subprocess.CompletedProcess[str]]


def run(tmp: Path, cfg: dict[str, Any]) -> int:
    return main(["--config", str(write_config(tmp, cfg))])


def job(tmp: Path, model: Path, data: Path, vol: Path, uid: str, **over: Any) -> dict[str, Any]:
    """A LoRA job `test` with uid `uid` whose checkpoints (and output, as the operator puts it)
    are on the volume `vol`; its metrics log is its own (tmp/metrics.jsonl)."""
    over["job"] = {"uid": uid, **over.get("job", {})}
    over["checkpoint"] = {"dir": str(vol), "interval_steps": 2, **over.get("checkpoint", {})}
    over["output"] = {"dir": str(vol / "output")}
    over["training"] = {"max_steps": 4, **over.get("training", {})}
    return trainer_config(tmp, model, data, "lora", **over)


def files(folder: Path) -> dict[str, str]:
    """Every file under folder: relative path → sha256. The tokenized-data cache (`.data`)
    is left out: it belongs to the volume, not to a job, and is never moved aside."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.relative_to(folder).parts[0] != ".data"
    }


def steps(tmp: Path) -> list[int]:
    return [int(e["step"]) for e in read_log(tmp / "metrics.jsonl", "step")]


def saved_identity(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / STATE_FILE).read_text())["identity"])


def recipe_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("kubetune_trainer.recipe")]


def strip_identity(path: Path) -> None:
    """Make a checkpoint an older trainer's: no identity (its manifest kept true to it)."""
    state_file = path / STATE_FILE
    state = json.loads(state_file.read_text())
    del state["identity"]
    state_file.write_text(json.dumps(state))
    data = state_file.read_bytes()
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][STATE_FILE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


# ------------------------------------------------------------------ the fingerprint


def with_value(cfg: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(cfg))
    *parents, last = dotted.split(".")
    inner = out
    for name in parents:
        inner = inner.setdefault(name, {})
    inner[last] = value
    return out


def test_the_fingerprint_covers_what_shapes_the_run_and_not_what_a_replan_changes(
    tmp_path: Path,
) -> None:
    base = trainer_config(tmp_path, Path("/m"), Path("/d.jsonl"), "lora")
    mine = identity(load_config(base))
    assert mine["job_uid"] == "u1" and mine["job_name"] == "test"
    assert mine["job_namespace"] == "default"
    assert len(mine["fingerprint"]) == 64
    replans = {
        "training.micro_batch_size": 1,
        "training.gradient_accumulation": 4,
        "training.total_steps": 9,
        "training.gradient_checkpointing": False,
        "training.precision": "bf16",
        "training.optimizer": "paged-adamw-8bit",
        "training.chunked_cross_entropy": True,
        "training.activation_offloading": True,
        "parallel.gpus_per_node": 4,
        "parallel.sharding": "grad-op",
        "parallel.cpu_offload": True,
        "checkpoint.keep": 5,
        "checkpoint.resume_from_uid": "uid-x",
        "job.uid": "u2",
    }
    for dotted, value in replans.items():
        other = identity(load_config(with_value(base, dotted, value)))
        assert other["fingerprint"] == mine["fingerprint"], dotted
    shaping = {
        "model.source": "/other",
        "model.revision": "abc",
        "dataset.source": "/other.jsonl",
        "dataset.format": "sharegpt",
        "dataset.validation_split": 0.1,
        "method": "qlora",
        "lora.rank": 8,
        "lora.alpha": 16,
        "lora.dropout": 0.0,
        "lora.target_modules": ["q_proj"],
        "training.learning_rate": 1e-4,
        "training.warmup_ratio": 0.0,
        "training.weight_decay": 0.1,
        "training.epochs": 2.0,
        "training.max_steps": 9,
        "training.global_batch_size": 8,
        "training.sequence_length": 256,
        "training.packing": False,
        "training.seed": 8,
        "training.objective": "dpo",
        "training.dpo.beta": 0.5,
        "training.dpo.label_smoothing": 0.1,
    }
    for dotted, value in shaping.items():
        other = identity(load_config(with_value(base, dotted, value)))
        assert other["fingerprint"] != mine["fingerprint"], dotted
        assert {k for k, v in other["fields"].items() if mine["fields"][k] != v} == {dotted}
    full = identity(load_config(trainer_config(tmp_path, Path("/m"), Path("/d.jsonl"), "full")))
    assert full["fields"]["lora.rank"] is None


# ------------------------------------------------------------------ another job's checkpoints


def test_another_jobs_checkpoints_are_moved_aside_and_the_new_job_starts_at_step_0(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Job v1 (uid-a) ran to the end; v2 of the same name (uid-b, a new learning rate) finds its
    checkpoints and output on the volume: they move, unchanged, to foreign/uid-a-<time>/, and
    v2 trains all its steps from step 0 and exports its own adapter."""
    vol = tmp_path / "vol"
    a = job(tmp_path / "a", tiny_llama, alpaca_data, vol, "uid-a")
    assert run(tmp_path / "a", a) == EXIT_OK
    before = files(vol)
    assert {
        "step-2/manifest.json",
        "step-4/.metadata",
        "output/adapter/adapter_config.json",
    } <= set(before)

    over = {"training": {"learning_rate": 1e-3}, "checkpoint": {"keep": 1}}
    b = job(tmp_path / "b", tiny_llama, alpaca_data, vol, "uid-b", **over)
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path / "b", b) == EXIT_OK

    assert steps(tmp_path / "b") == [1, 2, 3, 4]
    assert read_log(tmp_path / "b" / "metrics.jsonl", "start")[0]["resumed_from"] is None
    (aside,) = (vol / "foreign").iterdir()
    assert aside.name.startswith("uid-a-")
    assert files(aside) == before  # every file, unchanged; keep: 1 pruned none of them
    (event,) = read_log(tmp_path / "b" / "metrics.jsonl", "checkpoints_moved_aside")
    assert event["old_uid"] == "uid-a" and event["old_job"] == "test"
    assert event["moved_to"] == str(aside) and event["count"] == 3  # step-2, step-4, output
    assert HINT in caplog.text and str(aside) in caplog.text

    assert checkpoint_names(vol) == ["foreign", "output", "step-4"]
    assert saved_identity(vol / "step-4")["job_uid"] == "uid-b"
    adapter = "output/adapter/adapter_model.safetensors"
    assert files(vol)[adapter] != before[adapter]
    summary = json.loads((vol / "output" / "trainer_summary.json").read_text())
    assert summary["step"] == 4 and summary["tokens_seen"] > 0

    # A restart of v2 resumes its own checkpoint; foreign/ stays as it is.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path / "b", b) == EXIT_OK
    assert read_log(tmp_path / "b" / "metrics.jsonl", "start")[-1]["resumed_from"] == str(
        vol / "step-4"
    )
    assert len(read_log(tmp_path / "b" / "metrics.jsonl", "checkpoints_moved_aside")) == 1
    assert [p.name for p in (vol / "foreign").iterdir()] == [aside.name]
    assert recipe_warnings(caplog) == []


def test_resume_from_uid_adopts_the_named_jobs_checkpoints(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """uid-b names uid-a: it resumes uid-a's step-4 (no step trained again) with its own,
    lower learning rate and more steps, reports both changes, writes its checkpoints as
    uid-b, and a restart then resumes them as its own."""
    vol = tmp_path / "vol"
    a = job(tmp_path / "a", tiny_llama, alpaca_data, vol, "uid-a")
    assert run(tmp_path / "a", a) == EXIT_OK
    assert saved_identity(vol / "step-4")["job_uid"] == "uid-a"

    over = {
        "training": {"learning_rate": 1e-3, "max_steps": 8},
        "checkpoint": {"resume_from_uid": "uid-a"},
    }
    b = job(tmp_path / "b", tiny_llama, alpaca_data, vol, "uid-b", **over)
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path / "b", b) == EXIT_OK
    log = tmp_path / "b" / "metrics.jsonl"
    assert steps(tmp_path / "b") == [5, 6, 7, 8]
    assert read_log(log, "start")[0]["resumed_from"] == str(vol / "step-4")
    (event,) = read_log(log, "checkpoint_adopted")
    assert event["old_uid"] == "uid-a" and event["old_job"] == "test"
    assert event["changed"] == {
        "training.learning_rate": {"old": 2e-3, "new": 1e-3},
        "training.max_steps": {"old": 4, "new": 8},
    }
    assert "training.learning_rate 0.002 → 0.001" in caplog.text
    # The adopted run trains with its own learning rate, from where uid-a's schedule was.
    factor = warmup_cosine(math.ceil(0.1 * 8), 8)
    for e in read_log(log, "step"):
        assert e["learning_rate"] == pytest.approx(1e-3 * factor(e["step"] - 1), rel=1e-9)
    assert not (vol / "foreign").exists()
    assert checkpoint_names(vol) == ["output", "step-6", "step-8"]
    for name in ("step-6", "step-8"):
        assert saved_identity(vol / name)["job_uid"] == "uid-b"
        assert saved_identity(vol / name)["fields"]["training.learning_rate"] == 1e-3

    assert run(tmp_path / "b", b) == EXIT_OK  # a restart of uid-b: its own checkpoints
    assert read_log(log, "start")[-1]["resumed_from"] == str(vol / "step-8")
    assert len(read_log(log, "checkpoint_adopted")) == 1
    assert steps(tmp_path / "b") == [5, 6, 7, 8]
    assert not (vol / "foreign").exists()


def test_a_replan_of_the_same_job_resumes_its_own_checkpoints(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory at step 3, re-planned to micro-batch 1 × accumulation 4 without gradient
    checkpointing: the same job resumes step-2 (no step trained twice), nothing moved aside."""
    vol = tmp_path / "vol"
    cfg = job(tmp_path, tiny_llama, alpaca_data, vol, "uid-a", faults={"oom_at_step": 3})
    assert run(tmp_path, cfg) == EXIT_OOM
    assert saved_identity(vol / "step-2")["job_uid"] == "uid-a"

    replan = {**cfg, "faults": {}}
    replan["training"] = {**cfg["training"], "micro_batch_size": 1, "gradient_accumulation": 4}
    replan["training"]["gradient_checkpointing"] = False
    replan["training"]["total_steps"] = 5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path, replan) == EXIT_OK
    assert steps(tmp_path) == [1, 2, 3, 4]
    assert read_log(tmp_path / "metrics.jsonl", "start")[-1]["resumed_from"] == str(vol / "step-2")
    assert not (vol / "foreign").exists() and recipe_warnings(caplog) == []


def test_a_checkpoint_without_identity_still_resumes(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints of a trainer that recorded no identity: an upgrade must not lose the run,
    so even a job with another uid resumes them, with a warning."""
    vol = tmp_path / "vol"
    a = job(tmp_path / "a", tiny_llama, alpaca_data, vol, "uid-a")
    assert run(tmp_path / "a", a) == EXIT_OK
    for name in ("step-2", "step-4"):
        strip_identity(vol / name)

    b = job(tmp_path / "b", tiny_llama, alpaca_data, vol, "uid-b", training={"max_steps": 6})
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path / "b", b) == EXIT_OK
    assert steps(tmp_path / "b") == [5, 6]
    assert "step-4 records no job uid" in caplog.text
    assert not (vol / "foreign").exists()
    assert saved_identity(vol / "step-6")["job_uid"] == "uid-b"


def test_resume_from_uid_that_is_not_there_starts_at_step_0_with_a_warning(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The named job's checkpoints are not on the volume (another job's are, or none): no
    failure, step 0, and a warning naming the uid."""
    vol = tmp_path / "vol"
    a = job(tmp_path / "a", tiny_llama, alpaca_data, vol, "uid-a", training={"max_steps": 2})
    assert run(tmp_path / "a", a) == EXIT_OK

    over: dict[str, Any] = {
        "training": {"max_steps": 2},
        "checkpoint": {"resume_from_uid": "uid-x"},
    }
    b = job(tmp_path / "b", tiny_llama, alpaca_data, vol, "uid-b", **over)
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.recipe"):
        assert run(tmp_path / "b", b) == EXIT_OK
    assert steps(tmp_path / "b") == [1, 2]
    log = tmp_path / "b" / "metrics.jsonl"
    (event,) = read_log(log, "resume_from_uid_not_found")
    assert event["resume_from_uid"] == "uid-x" and event["found_uid"] == "uid-a"
    assert read_log(log, "checkpoints_moved_aside")[0]["old_uid"] == "uid-a"
    assert "spec.checkpoint.resumeFromUID is uid-x but" in caplog.text

    c = job(tmp_path / "c", tiny_llama, alpaca_data, tmp_path / "empty", "uid-c", **over)
    assert run(tmp_path / "c", c) == EXIT_OK
    assert steps(tmp_path / "c") == [1, 2]
    (event,) = read_log(tmp_path / "c" / "metrics.jsonl", "resume_from_uid_not_found")
    assert event["resume_from_uid"] == "uid-x" and event["found_uid"] is None


def test_foreign_is_never_removed_to_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room for a save: quarantined checkpoints go, moved-aside ones stay, and the message
    points at them."""
    aside = tmp_path / "foreign" / "uid-a-20250101T000000Z" / "step-4"
    aside.mkdir(parents=True)
    (aside / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / "step-2.corrupt-20250101T000000Z").mkdir()
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: Usage(2**30, 2**30, 1))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ck = Checkpointer(tmp_path, keep=1, env=env, adapter_only=False)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointFailed) as failed:
        ck.save(1, model, opt, {"step": 1}, checkpoint.capture_rng())
    assert f"delete what is no longer wanted in {tmp_path / 'foreign'}" in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign"]
    assert (aside / "__0_0.distcp").read_bytes() == b"x" * 1000
    assert ck.newest_identity() is None


def test_two_processes_move_another_jobs_checkpoints_aside_once(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    """With two ranks, rank 0 alone moves the checkpoints and both start at step 0."""
    vol = tmp_path / "vol"
    a = job(tmp_path / "a", tiny_llama, alpaca_data, vol, "uid-a", training={"max_steps": 2})
    assert run(tmp_path / "a", a) == EXIT_OK
    before = files(vol)

    over = {"training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1}}
    b = job(tmp_path / "b", tiny_llama, alpaca_data, vol, "uid-b", **over)
    proc = run_launcher(write_config(tmp_path / "b", b), nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "[fsdp]" in proc.stderr and proc.stderr.count(HINT) == 1
    assert steps(tmp_path / "b") == [1, 2]
    (aside,) = (vol / "foreign").iterdir()
    assert files(aside) == before
    (event,) = read_log(tmp_path / "b" / "metrics.jsonl", "checkpoints_moved_aside")
    assert event["count"] == 2 and event["moved_to"] == str(aside)
    assert saved_identity(vol / "step-2")["job_uid"] == "uid-b"
