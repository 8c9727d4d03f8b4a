"""Checkpoints under pressure: no room on the volume, a failing save, leftovers of interrupted
saves, damaged checkpoints (quarantined, resumed from the next older one), the manifest."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import traceback
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import kubetune_trainer.checkpoint as checkpoint
from kubetune_trainer.__main__ import main
from kubetune_trainer.checkpoint import (
    MANIFEST_FILE,
    QUARANTINE_MARK,
    SPACE_MARGIN,
    Checkpointer,
    is_no_space,
    state_bytes,
)
from kubetune_trainer.contract import EXIT_CHECKPOINT_FAILED, EXIT_OK, EXIT_PREEMPTED
from kubetune_trainer.distributed import DistEnv
from kubetune_trainer.errors import CheckpointFailed, StorageUnavailable
from kubetune_trainer.recipe import SftRecipe
from support import faultyfs
from support.trainer import checkpoint_names, read_log, step_losses, trainer_config, write_config

pytestmark = pytest.mark.trainer

RESUME_TOLERANCE = 1e-6  # as in test_trainer_recipe: fp32 on CPU, same process count
FIX = "To fix: raise spec.checkpoint.storage.size or lower spec.checkpoint.keep"
ONE = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
Usage = namedtuple("Usage", "total used free")


def run_main(tmp: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(tmp / "termination-log"))
    return main(["--config", str(write_config(tmp, cfg))])


def signal_at_forward(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """SIGTERM to this process during the n-th training micro-batch forward."""
    original = SftRecipe._forward_loss
    calls = {"n": 0}

    def forward(self: SftRecipe, batch: Any) -> torch.Tensor:
        if self.model.training:
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batch)

    monkeypatch.setattr(SftRecipe, "_forward_loss", forward)


def names(folder: Path) -> list[str]:
    return checkpoint_names(folder)


def termination(tmp: Path) -> str:
    return (tmp / "termination-log").read_text()


def small_checkpointer(root: Path) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return Checkpointer(root, keep=2, env=ONE, adapter_only=False), model, opt


def save(ck: Checkpointer, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    state = {"step": step, "seed": 0}
    return ck.save(step, model, opt, state, checkpoint.capture_rng())[0]


# ------------------------------------------------------------------ the manifest


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    ck, model, opt = small_checkpointer(tmp_path)
    path = save(ck, 3, model, opt)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    on_disk = sorted(
        str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != MANIFEST_FILE
    )
    assert sorted(manifest["files"]) == on_disk
    assert {".metadata", "trainer_state.json", "rng/rank-0.pt", "__0_0.distcp"} <= set(on_disk)
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["total_bytes"] == sum(e["size"] for e in manifest["files"].values())
    assert manifest["step"] == 3 and manifest["algorithm"] == "sha256"
    assert json.loads((path / "trainer_state.json").read_text())["format_version"] == 2
    assert ck.verify(path) is None
    # The first save's estimate: parameter + optimizer bytes (fp32 AdamW: 3 × params).
    params = sum(p.numel() * 4 for p in model.parameters())
    assert 0 <= state_bytes(model, opt, adapter_only=False) - 3 * params <= 32  # + step counters


def test_verify_finds_damage_and_accepts_older_checkpoints(tmp_path: Path) -> None:
    ck, model, opt = small_checkpointer(tmp_path)
    path = save(ck, 1, model, opt)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ck.verify(path) == "__0_0.distcp does not match its sha256"
    shard.write_bytes(bytes(data[:-10]))
    assert "__0_0.distcp has" in (ck.verify(path) or "")
    shard.unlink()
    assert ck.verify(path) == "__0_0.distcp is missing"
    (path / MANIFEST_FILE).unlink()
    assert ck.verify(path) == "manifest.json is missing"  # written by this trainer: must have one
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "format_version": 1}))
    assert ck.verify(path) is None  # an older trainer's checkpoint: left to the load to judge


def test_is_no_space_sees_through_dcp_errors() -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save", {1: (enospc, traceback.StackSummary())})
    assert is_no_space(wrapped) and is_no_space(enospc)
    assert not is_no_space(RuntimeError("boom")) and not is_no_space(None)


# ------------------------------------------------------------------ no room, failing saves


def test_no_room_for_the_next_checkpoint_exits_45_and_keeps_the_previous(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once step-2 exists the volume reports 1 MiB free: the save of step-4 is not started,
    exit 45 with what was needed and what was free; step-2 still resumes."""
    ckpt = tmp_path / "ckpt"
    real = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        got = real(path)
        if (ckpt / "step-2").is_dir():
            return Usage(got.total, got.total - 2**20, 2**20)
        return got

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    cfg = trainer_config(
        tmp_path, tiny_llama, alpaca_data, "lora", checkpoint={"interval_steps": 2, "keep": 1}
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CHECKPOINT_FAILED
    message = termination(tmp_path)
    assert message.startswith("checkpoint_failed not enough space for checkpoint step-4")
    assert "(the size of step-2)" in message and "0.00 GiB free" in message
    assert "step-2 is kept" in message and FIX in message
    assert names(ckpt) == ["step-2"]
    size = json.loads((ckpt / "step-2" / MANIFEST_FILE).read_text())["total_bytes"]
    needed = float(message.split("needs about ")[1].split(" GiB")[0])
    assert needed == pytest.approx((size * SPACE_MARGIN + 16 * 2**20) / 2**30, abs=0.01)

    monkeypatch.undo()
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert read_log(tmp_path / "metrics.jsonl", "start")[-1]["resumed_from"].endswith("step-2")


@pytest.mark.parametrize("failure", ["checkpoint-exception", "oserror", "other"])
def test_failed_save_removes_its_temp_folder_and_exits_45(
    failure: str,
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer fails half-way through step-4 (after writing part of a shard): the temp
    folder goes, step-2 stays, exit 45 with the cause; never a crash (exit 1)."""
    real_save = checkpoint.dcp_save
    calls = {"n": 0}

    def dcp_save(state: Any, *, checkpoint_id: str) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_save(state, checkpoint_id=checkpoint_id)
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"x" * 1000)
        enospc = OSError(errno.ENOSPC, "No space left on device")
        if failure == "checkpoint-exception":
            raise CheckpointException("write", {0: (enospc, traceback.StackSummary())})
        if failure == "oserror":
            raise enospc
        raise RuntimeError("the storage went away")

    monkeypatch.setattr(checkpoint, "dcp_save", dcp_save)
    cfg = trainer_config(
        tmp_path, tiny_llama, alpaca_data, "lora", checkpoint={"interval_steps": 2, "keep": 1}
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CHECKPOINT_FAILED
    ckpt = tmp_path / "ckpt"
    assert names(ckpt) == ["step-2"]
    assert Checkpointer(ckpt, keep=1, env=ONE, adapter_only=True).verify(ckpt / "step-2") is None
    message = termination(tmp_path)
    assert message.startswith("checkpoint_failed checkpoint step-4 could not be written")
    assert "the temp folder was removed and step-2 is kept" in message
    if failure == "other":
        assert "RuntimeError: the storage went away" in message
        assert "check the checkpoint volume" in message
    else:
        assert FIX in message


# ------------------------------------------------------------------ start-up and resume


def test_leftover_temp_folders_are_removed_at_start(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ckpt = tmp_path / "ckpt"
    for n in (3, 5):
        (ckpt / f".tmp-step-{n}").mkdir(parents=True)
        (ckpt / f".tmp-step-{n}" / "__0_0.distcp").write_bytes(b"half")
    seen: list[list[str]] = []
    original = Checkpointer.verify

    def verify(self: Checkpointer, path: Path) -> str | None:
        seen.append(names(self.root))
        return original(self, path)

    monkeypatch.setattr(Checkpointer, "verify", verify)
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", training={"max_steps": 1})
    with caplog.at_level(logging.INFO, logger="kubetune_trainer.checkpoint"):
        assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert "2 unfinished checkpoint folder(s)" in caplog.text
    assert names(ckpt) == ["step-1"]
    assert seen == []  # nothing to resume: removed before resuming, not by a later prune


def test_damaged_newest_checkpoint_is_quarantined_and_the_older_one_resumes_step_exact(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step-6 gets a flipped byte after the run was preempted at step 7: the relaunch
    quarantines it, resumes from step-4 and reproduces the uninterrupted loss curve; step-6
    is written again and step-4 (the last loadable) is never pruned before that."""
    base = {"training": {"max_steps": 8}, "checkpoint": {"interval_steps": 2, "keep": 2}}
    a = trainer_config(tmp_path / "a", tiny_llama, alpaca_data, "lora", **base)
    assert run_main(tmp_path / "a", a, monkeypatch) == EXIT_OK

    b = trainer_config(tmp_path / "b", tiny_llama, alpaca_data, "lora", **base)
    signal_at_forward(monkeypatch, 2 * 6 + 1)  # 1st micro-batch of step 7
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_PREEMPTED
    monkeypatch.undo()
    ckpt = tmp_path / "b" / "ckpt"
    assert names(ckpt) == ["step-4", "step-6"]
    shard = ckpt / "step-6" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))

    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_OK
    log = tmp_path / "b" / "metrics.jsonl"
    assert read_log(log, "start")[-1]["resumed_from"].endswith("step-4")
    (event,) = read_log(log, "checkpoint_quarantined")
    assert event["checkpoint"] == "step-6" and "does not match its sha256" in event["reason"]
    quarantined = [n for n in names(ckpt) if QUARANTINE_MARK in n]
    assert quarantined == [event["moved_to"]] and quarantined[0].startswith("step-6.corrupt-")
    assert [n for n in names(ckpt) if n not in quarantined] == ["step-6", "step-8"]

    want = step_losses(tmp_path / "a" / "metrics.jsonl")
    got = step_losses(log)
    assert sorted(got) == list(range(1, 9))
    diff = max(abs(want[s] - got[s]) for s in want)
    print(f"resume after quarantine: max |loss diff| = {diff:.3g}")
    assert diff <= RESUME_TOLERANCE


def test_keep_one_with_its_only_checkpoint_damaged_fails_clearly(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep: 1 and the one checkpoint truncated: exit 45 with the reason, every time (not a
    crash loop, and not a silent start from step 0)."""
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 2},
        checkpoint={"interval_steps": 2, "keep": 1},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    ckpt = tmp_path / "ckpt"
    shard = ckpt / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])
    steps = len(read_log(tmp_path / "metrics.jsonl", "step"))

    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CHECKPOINT_FAILED
    message = termination(tmp_path).splitlines()[-1]
    assert message.startswith(f"checkpoint_failed no checkpoint in {ckpt} can be loaded")
    assert "step-2: __0_0.distcp has" in message and "To fix: delete the quarantined" in message
    (moved,) = names(ckpt)
    assert moved.startswith("step-2.corrupt-")

    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CHECKPOINT_FAILED
    assert "could not be loaded earlier and was quarantined" in termination(tmp_path)
    assert len(read_log(tmp_path / "metrics.jsonl", "step")) == steps  # never trained again


# ------------------------------------------------------------------ a storage in trouble


def faulty_mount() -> None:
    why = faultyfs.unavailable()
    if why is not None:
        pytest.skip(f"no FUSE file system to inject a real EIO with: {why}")


def test_a_read_error_proves_no_damage_and_quarantines_nothing(tmp_path: Path) -> None:
    """verify() meets a real EIO (from a FUSE file system, below Python): it raises
    StorageUnavailable; the checkpoint keeps its name, and verifies once reads work again."""
    faulty_mount()
    ck, model, opt = small_checkpointer(tmp_path / "src")
    save(ck, 1, model, opt)
    control, mnt = tmp_path / "eio", tmp_path / "mnt"
    with faultyfs.mounted(tmp_path / "src", mnt, control):
        seen = Checkpointer(mnt, keep=2, env=ONE, adapter_only=False)
        control.write_text("__0_0.distcp\n")
        with pytest.raises(StorageUnavailable, match=r"step-1: .*Input/output error.*To fix"):
            seen.verify(mnt / "step-1")
        control.unlink()
        assert names(mnt) == ["step-1"] and seen.verify(mnt / "step-1") is None


def test_a_resume_the_storage_fails_ends_the_attempt_restartably_and_the_next_resumes(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint volume answers EIO while the relaunched trainer resumes: exit 1 (the
    Job restarts it), nothing quarantined; once it reads again the run resumes from step 2."""
    faulty_mount()
    cfg = trainer_config(
        tmp_path, tiny_llama, alpaca_data, "lora",
        training={"max_steps": 2}, checkpoint={"interval_steps": 2, "keep": 1},
    )  # fmt: skip
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    ckpt = tmp_path / "ckpt"
    ckpt.rename(tmp_path / "volume")
    control = tmp_path / "eio"
    with faultyfs.mounted(tmp_path / "volume", ckpt, control):
        control.write_text("trainer_state.json\n")
        assert run_main(tmp_path, cfg, monkeypatch) == 1
        assert "could not be read" in termination(tmp_path)
        assert names(ckpt) == ["step-2"]  # nothing quarantined, nothing pruned
        control.unlink()
        assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert read_log(tmp_path / "metrics.jsonl", "start")[-1]["resumed_from"].endswith("step-2")


def test_making_room_removes_only_quarantined_checkpoints_proven_damaged(tmp_path: Path) -> None:
    """A really full file system (a 24 MiB tmpfs): the save that cannot fit removes the
    quarantined folder that fails its manifest and keeps the one that still matches it (a
    transient error may have put it there)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(volume)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {mount.stderr.strip()}")
    try:
        ck, model, opt = small_checkpointer(volume)
        sound = save(ck, 1, model, opt).rename(volume / f"step-1{QUARANTINE_MARK}20261201T000000Z")
        damaged = save(ck, 2, model, opt)
        shard = damaged / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-8])
        damaged = damaged.rename(volume / f"step-2{QUARANTINE_MARK}20261201T000001Z")
        free = shutil.disk_usage(volume).free
        (volume / "filler").write_bytes(b"\0" * (free - 2 * 2**20))  # 2 MiB left: too little
        with pytest.raises(CheckpointFailed, match="not enough space"):
            save(ck, 3, model, opt)
        assert sound.is_dir() and not damaged.exists()
    finally:
        subprocess.run(["umount", str(volume)], check=False)


class _Payload:
    """Unpickled, it would create the file `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_planted_rng_file_runs_no_code_when_loaded(tmp_path: Path) -> None:
    """The RNG state is loaded with weights_only: a pickle planted in a checkpoint folder by
    anyone who can write the volume fails to load (and the resume quarantines it) instead
    of running."""
    ck, model, opt = small_checkpointer(tmp_path / "ckpt")
    path = save(ck, 1, model, opt)
    ran = tmp_path / "ran"
    torch.save({"python": _Payload(ran), "torch": torch.get_rng_state()}, path / "rng/rank-0.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        ck.load(path, model, opt)
    assert not ran.exists()
