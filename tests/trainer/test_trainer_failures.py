"""How a run that fails ends: the exit code the operator acts on and the termination message a
user reads. Out of GPU memory in any phase (43, naming the phase), hub refusals and missing
repositories (2, naming the URI and the fix), transient hub errors (retried, then 1), and any
other crash (1, with the error in the message)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import huggingface_hub.errors as hf_errors
import torch

from kubetune_trainer import hub
from kubetune_trainer.__main__ import TERMINATION_LINE_CHARS, main, result_line
from kubetune_trainer.checkpoint import Checkpointer
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    OutOfMemoryResult,
    TrainerResult,
)
from kubetune_trainer.data import read_records
from kubetune_trainer.errors import ConfigError, HubUnavailable
from kubetune_trainer.recipe import FineTuneRecipe, SftRecipe, faults, is_out_of_memory, loop
from support.trainer import read_log, trainer_config, trainer_results, write_config

pytestmark = pytest.mark.trainer

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"


def run_main(tmp: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(tmp / "termination-log"))
    return main(["--config", str(write_config(tmp, cfg))])


def termination_message(tmp: Path) -> str:
    return (tmp / "termination-log").read_text()


def raises(error: BaseException) -> Any:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise error

    return fail


def http_error(cls: type[Exception], status: int, url: str, message: str = "") -> Exception:
    """A hub client error as huggingface_hub raises it, with an HTTP response."""
    # The hub client's HTTP library (httpx or its successor), found through its errors module.
    http = importlib.import_module(hf_errors.Response.__module__.split(".")[0])
    response = http.Response(status, request=http.Request("GET", url))
    error: Exception = cls(message or f"{status} Client Error for url: {url}", response=response)
    return error


@pytest.fixture(autouse=True)
def _no_hub_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))


# ------------------------------------------------------------------ out of GPU memory


@pytest.mark.parametrize(
    ("phase", "words"),
    [
        ("load", "loading the model"),
        ("eval", "evaluating"),
        ("save", "saving a checkpoint"),
        ("export", "exporting the model"),
    ],
)
def test_out_of_memory_in_any_phase_exits_43_naming_it(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
    words: str,
) -> None:
    oom = torch.OutOfMemoryError(CUDA_OOM)
    if phase == "load":
        monkeypatch.setattr(loop, "build_model", raises(oom))
    elif phase == "eval":
        monkeypatch.setattr(SftRecipe, "_eval_sums", raises(oom))
    elif phase == "save":
        # As torch reports some allocator failures: a RuntimeError that says so.
        monkeypatch.setattr(Checkpointer, "save", raises(RuntimeError("CUDA error: out of memory")))
    else:
        monkeypatch.setattr(FineTuneRecipe, "_save_output", raises(oom))
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 2, "total_steps": 2},
        dataset={"validation_split": 0.2},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OOM
    (result,) = trainer_results(tmp_path / "termination-log")
    oom = result.out_of_memory
    assert result.outcome == "out_of_memory" and oom is not None
    assert oom.phase == phase and oom.peak_gib > 0 and oom.rank == 0
    assert f"out of GPU memory while {words}" in oom.message
    if phase != "load":  # metrics start after the model is built
        (event,) = read_log(tmp_path / "metrics.jsonl", "oom")
        assert event["phase"] == phase


@pytest.mark.parametrize("phase", ["load", "eval", "save", "export"])
def test_the_phase_fault_runs_out_of_memory_where_it_says(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    """`faults.oom_in_phase` (the e2e tier's fault matrix) fails as a real OOM there would."""
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 2, "total_steps": 2},
        dataset={"validation_split": 0.2},
        faults={"oom_in_phase": phase},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OOM
    (result,) = trainer_results(tmp_path / "termination-log")
    oom = result.out_of_memory
    assert oom is not None and oom.phase == phase
    assert f"faults.oom_in_phase={phase}" in oom.message


def test_the_disk_full_fault_fails_that_save_and_keeps_the_one_before(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 4, "total_steps": 4},
        checkpoint={"interval_steps": 2, "keep": 2},
        faults={"disk_full_at_step": 4},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CHECKPOINT_FAILED
    assert "not enough space for checkpoint step-4" in termination_message(tmp_path)
    folders = sorted(p.name for p in Path(cfg["checkpoint"]["dir"]).iterdir() if p.is_dir())
    assert "step-2" in folders and "step-4" not in folders


def test_out_of_memory_is_found_inside_other_errors() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    oom = torch.OutOfMemoryError(CUDA_OOM)
    assert is_out_of_memory(oom)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    try:
        raise OSError("checkpoint save failed") from oom
    except OSError as wrapped:
        assert is_out_of_memory(wrapped)
    assert is_out_of_memory(CheckpointException("save failed", {1: (oom, None)}))
    assert not is_out_of_memory(RuntimeError("expected scalar type Float"))
    assert not is_out_of_memory(MemoryError())  # host memory: the kernel's business
    assert not is_out_of_memory(CheckpointException("save failed", {0: (OSError(28), None)}))


# ------------------------------------------------------------------ the hub


def hub_model_config(tmp: Path, data: Path, **model: Any) -> dict[str, Any]:
    cfg = trainer_config(tmp, tmp / "unused", data, "lora")
    cfg["model"] = {"source": "meta-llama/Llama-3.1-8B", "kind": "hub", **model}
    return cfg


def test_a_gated_model_without_access_is_a_config_error(
    tmp_path: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    url = "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B/revision/main"
    calls: list[str] = []

    def gated(repo_id: str, **_kwargs: Any) -> str:
        calls.append(repo_id)
        raise http_error(hf_errors.GatedRepoError, 401, url, "Access to model is restricted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    cfg = hub_model_config(tmp_path, alpaca_data)
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    assert calls == ["meta-llama/Llama-3.1-8B"]  # refused: not retried
    message = termination_message(tmp_path)
    assert message.startswith("config_error model meta-llama/Llama-3.1-8B: the hub refused")
    assert "HTTP 401" in message
    assert "To fix: put a hub token" in message and "model.tokenSecretRef" in message

    monkeypatch.setenv("HF_TOKEN_TEST", "hf_wrong")
    cfg = hub_model_config(tmp_path, alpaca_data, token_env="HF_TOKEN_TEST")
    (tmp_path / "termination-log").unlink()
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    assert "the token in the Secret of model.tokenSecretRef" in termination_message(tmp_path)


def test_a_missing_repository_or_revision_is_a_config_error(
    tmp_path: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    url = "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B"
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        raises(http_error(hf_errors.RepositoryNotFoundError, 404, url)),
    )
    assert run_main(tmp_path, hub_model_config(tmp_path, alpaca_data), monkeypatch) == 2
    message = termination_message(tmp_path)
    assert "model meta-llama/Llama-3.1-8B: no such repository on the hub" in message
    assert "HTTP 404" in message and "To fix: check model.uri" in message

    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        raises(http_error(hf_errors.RevisionNotFoundError, 404, url)),
    )
    (tmp_path / "termination-log").unlink()
    cfg = hub_model_config(tmp_path, alpaca_data, revision="v9")
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    message = termination_message(tmp_path)
    assert "revision 'v9' does not exist" in message
    assert "To fix: set model.revision" in message


def test_a_hub_dataset_refused_or_missing_is_a_config_error(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    url = "https://huggingface.co/api/datasets/org/private-set"
    try:
        raise DatasetNotFoundError(
            "Dataset 'org/private-set' is a gated dataset on the Hub."
        ) from (http_error(hf_errors.GatedRepoError, 403, url))
    except DatasetNotFoundError as e:
        refused = e
    monkeypatch.setattr(datasets, "load_dataset", raises(refused))
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        dataset={"source": "org/private-set", "kind": "hub"},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    message = termination_message(tmp_path)
    assert "dataset org/private-set: the hub refused access (HTTP 403" in message
    assert "To fix:" in message

    monkeypatch.setattr(
        datasets, "load_dataset", raises(http_error(hf_errors.RepositoryNotFoundError, 404, url))
    )
    with pytest.raises(ConfigError, match=r"org/private-set: no such repository.*dataset\.uri"):
        read_records("org/private-set", kind="hub")


def test_transient_hub_errors_are_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    url = "https://huggingface.co/api/datasets/org/set"
    failures = [
        http_error(hf_errors.HfHubHTTPError, 503, url, "503 Service Unavailable"),
        TimeoutError("The read operation timed out"),
    ]
    calls = {"n": 0}

    def flaky(*_args: Any, **_kwargs: Any) -> list[dict[str, str]]:
        calls["n"] += 1
        if failures:
            raise failures.pop(0)
        return [{"instruction": "a", "output": "b"}]

    monkeypatch.setattr(datasets, "load_dataset", flaky)
    records = read_records("org/set", kind="hub")
    assert calls["n"] == 3 and len(records) == 1


def test_a_hub_that_stays_down_is_a_restartable_failure(
    tmp_path: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    url = "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B"
    calls = {"n": 0}

    def down(*_args: Any, **_kwargs: Any) -> str:
        calls["n"] += 1
        raise http_error(hf_errors.HfHubHTTPError, 502, url, "502 Bad Gateway")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", down)
    assert run_main(tmp_path, hub_model_config(tmp_path, alpaca_data), monkeypatch) == 1
    assert calls["n"] == len(hub.RETRY_DELAYS_S) + 1
    message = termination_message(tmp_path)
    assert "model meta-llama/Llama-3.1-8B: the hub could not be reached after 4 tries" in message
    assert "HfHubHTTPError: 502 Bad Gateway" in message


def test_hub_call_leaves_other_errors_alone() -> None:
    with pytest.raises(ValueError, match="not the hub"):
        hub.hub_call(raises(ValueError("not the hub")), what="model", uri="x", field="model.uri")
    with pytest.raises(HubUnavailable):
        hub.hub_call(
            raises(ConnectionResetError("reset")), what="model", uri="x", field="model.uri"
        )


# ------------------------------------------------------------------ any other crash


def test_a_crash_writes_its_error_into_the_termination_message(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = "x" * 5000
    monkeypatch.setattr(loop, "build_model", raises(KeyError(f"model.layers.0.mlp.up_proj {long}")))
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora")
    assert run_main(tmp_path, cfg, monkeypatch) == 1
    message = termination_message(tmp_path)
    assert message.startswith("crash rank=0 KeyError: 'model.layers.0.mlp.up_proj xxx")
    assert message.rstrip().endswith("...") and len(message) < 400


def test_the_host_memory_fault_never_allocates_without_a_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`faults.host_memory_at_step` must not take a shared machine's memory: without a cgroup
    limit to reach (the local pod runner, this test) it does nothing, and it fires once."""
    memory_max, v1_limit = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(faults, "CGROUP_MEMORY_LIMITS", (memory_max, v1_limit))
    for path, unlimited in ((memory_max, "max"), (v1_limit, str(2**63 - 4096))):
        path.write_text(f"{unlimited}\n")
        faults._exhaust_host_memory_once(tmp_path, 5)
        assert not (tmp_path / ".faults").exists()
        path.unlink()
    faults._exhaust_host_memory_once(tmp_path, 5)  # no cgroup files at all
    assert not (tmp_path / ".faults").exists()
    memory_max.write_text(f"{64 << 20}\n")  # small: twice that is allocated, then let go
    faults._exhaust_host_memory_once(tmp_path, 5)
    assert (tmp_path / ".faults" / "host-memory-before-step-5").exists()
    faults._exhaust_host_memory_once(tmp_path, 5)  # fired already: returns at once


def test_an_out_of_memory_result_is_cut_to_one_whole_line() -> None:
    """However long (and full of characters JSON escapes) the error, the termination
    message gets the result whole: its message is shortened, not the JSON."""
    oom = OutOfMemoryResult(peak_gib=71.25, step=3, rank=0, phase="eval", message='"\\' * 900)
    result = TrainerResult(outcome="out_of_memory", step=2, out_of_memory=oom)
    line = result_line(result)
    assert len(line) <= TERMINATION_LINE_CHARS
    back = TrainerResult.model_validate_json(line)
    assert back.out_of_memory is not None and back.out_of_memory.peak_gib == 71.25
    assert back.out_of_memory.message and oom.message.startswith(back.out_of_memory.message)
