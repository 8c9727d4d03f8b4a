"""The stage-in step (`python -m kubetune_trainer.stagein`): a tiny model and an alpaca dataset
fetched from a volume path, from a real S3 server (versitygw, support/s3server.py) and from
the hub stand-in (support/hubserver.py) into the cache, checked, and measured.

What is pinned: the staged files and a StageInResult whose counts equal what data.py computes
for the same data and tokenizer; a second stage-in downloads nothing; two at once download
once; permanent failures (wrong S3 keys, a missing object, a malformed line, another
architecture than planned) exit 2 with the URI and "To fix" in the termination message; a
transient hub failure is retried; a path is read in place. The progress gauges, scraped over
HTTP mid-run and at the end, count every staged file and byte (fetched or found in the
cache); eviction removes the least recently used entries down to the cap, never one a job
reads, one this stage-in hands out, or one whose lock is held.

The S3 tests need versitygw, built from Go modules on first use (about 2 minutes, then cached);
they are skipped, with the reason, where it cannot be built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("boto3", reason="the stage-in needs boto3 (the trainer extra)")
pytest.importorskip("huggingface_hub", reason="trainer tests need the trainer extra")

from huggingface_hub import HfApi

from kubetune_trainer import hub as hub_module
from kubetune_trainer.contract import (
    CONTRACT_VERSION,
    EXIT_CONFIG_ERROR,
    STAGE_IN_METRICS,
    StageInConfig,
    StageInResult,
    TrainingConfig,
)
from kubetune_trainer.data import prepare_data, read_records
from kubetune_trainer.stagein import cache_entries, cache_key, stage_in
from kubetune_trainer.stagein.__main__ import main
from kubetune_trainer.stagein.cache import ENTRY_FILE, locked, source_origin
from kubetune_trainer.stagein.fetch import Progress
from kubetune_trainer.stagein.progress import StageProgress
from kubetune_trainer.tiny import make_records, write_jsonl
from support.hubserver import HubServer, hub_server
from support.s3server import S3Server, s3_server
from support.trainer import worker_env

pytestmark = pytest.mark.trainer

SEQUENCE_LENGTH = 128
VALIDATION_SPLIT = 0.1
RECORDS = 160
MODEL_REPO = "org/tiny-llama"
DATASET_REPO = "org/alpaca"
PRODUCTION_DELAYS_S = hub_module.RETRY_DELAYS_S


# ------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _short_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_module, "RETRY_DELAYS_S", (0.05, 0.05, 0.05))


def stagein_config(
    tmp: Path, model: dict[str, Any], dataset: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "job": {"name": "tune", "namespace": "default", "uid": "u1"},
        "model": model,
        "dataset": {"format": "alpaca", "validation_split": VALIDATION_SPLIT, **dataset},
        "cache_dir": str(tmp / "cache"),
        "result_path": str(tmp / "out" / "result.json"),
        "method": "lora",
        "sequence_length": SEQUENCE_LENGTH,
        "packing": True,
        "model_type": "llama",
    }
    cfg.update(extra)
    return cfg


def run_stagein(tmp: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """`main` in this process: (exit code, termination message)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "stagein.json"
    config.write_text(json.dumps(cfg))
    log = tmp / "termination-log"
    log.unlink(missing_ok=True)
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(log))
    code = main(["--config", str(config)])
    return code, log.read_text() if log.exists() else ""


def result_of(cfg: dict[str, Any], message: str) -> StageInResult:
    """The result file, checked against the termination message (the same, compact)."""
    result = StageInResult.model_validate_json(Path(cfg["result_path"]).read_text())
    assert len(message.encode()) <= 4096
    assert StageInResult.model_validate_json(message) == result
    return result


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(
        tmp_path_factory.mktemp("stagein-data") / "alpaca.jsonl", make_records("alpaca", RECORDS)
    )


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, alpaca: Path) -> dict[str, int]:
    """What data.py makes of the dataset with the model's tokenizer: training-split examples
    and their tokens (unpacked rows), and the rows one epoch packs into."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    records = read_records(str(alpaca))
    seed = TrainingConfig.model_fields["seed"].default

    def rows(packing: bool) -> Any:
        return prepare_data(
            records,
            fmt="alpaca",
            tokenizer=tokenizer,
            sequence_length=SEQUENCE_LENGTH,
            packing=packing,
            validation_split=VALIDATION_SPLIT,
            seed=seed,
        ).train

    unpacked = rows(False)
    return {
        "examples": len(unpacked),
        "tokens": sum(unpacked.lengths),
        "packed_sequences": len(rows(True)),
    }


def counts(result: StageInResult) -> dict[str, int]:
    return {
        "examples": result.examples,
        "tokens": result.tokens,
        "packed_sequences": result.packed_sequences,
    }


def files_of(folder: Path) -> set[str]:
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != ENTRY_FILE
    }


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


# ------------------------------------------------------------------ a path: read in place


def test_path_kind_is_read_in_place(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca: Path,
    expected: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = stagein_config(
        tmp_path,
        {"source": str(tiny_llama), "kind": "path"},
        {"source": str(alpaca), "kind": "path"},
    )
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == 0, message
    result = result_of(cfg, message)
    assert result.model_path == str(tiny_llama)
    assert result.dataset_path == str(alpaca)
    assert counts(result) == expected
    assert result.model_config_json["model_type"] == "llama"
    assert (result.downloaded_bytes, result.reused_bytes) == (0, 0)
    cache = tmp_path / "cache"
    assert not (cache / "models").exists() and not (cache / "datasets").exists()


def test_preference_pairs_are_checked_and_measured_as_pairs(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DPO job's dataset holds {prompt, chosen, rejected} pairs, which the SFT reader
    refuses: the stage-in measures pairs as training will, and names a broken pair's line."""
    from transformers import AutoTokenizer

    from kubetune_trainer.data import prepare_preference_data
    from kubetune_trainer.tiny import make_preference_records

    records = make_preference_records(60)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", records)
    cfg = stagein_config(
        tmp_path / "good",
        {"source": str(tiny_llama), "kind": "path"},
        {"source": str(pairs), "kind": "path"},
        objective="dpo",
    )
    code, message = run_stagein(tmp_path / "good", cfg, monkeypatch)
    assert code == 0, message
    prepared = prepare_preference_data(
        read_records(str(pairs)),
        tokenizer=AutoTokenizer.from_pretrained(str(tiny_llama)),
        sequence_length=SEQUENCE_LENGTH,
        validation_split=VALIDATION_SPLIT,
        seed=TrainingConfig.model_fields["seed"].default,
    )
    assert counts(result_of(cfg, message)) == {
        "examples": prepared.stats.train_examples,
        "tokens": prepared.stats.train_tokens,
        "packed_sequences": prepared.stats.train_examples,
    }
    assert 0 < prepared.stats.train_examples < 60  # the validation pairs are held out

    broken = [dict(r) for r in records]
    del broken[4]["rejected"]
    cfg["dataset"]["source"] = str(write_jsonl(tmp_path / "broken.jsonl", broken))
    code, message = run_stagein(tmp_path / "broken", cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "broken.jsonl:5" in message and "rejected" in message and "To fix" in message


# ------------------------------------------------------------------ the hub


@pytest.fixture
def hub(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, alpaca: Path, tmp_path: Path
) -> Iterator[HubServer]:
    """The hub stand-in with the tiny model (and files training does not read) and the
    dataset (a train and a test split), this process's client pointed at it."""
    with hub_server() as server:
        server.patch(monkeypatch, cache_dir=tmp_path / "hf-cache")
        files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
        files["pytorch_model.bin"] = b"\0" * 4096  # safetensors exist: never fetched
        files["original/consolidated.00.pth"] = b"\0" * 4096
        files["onnx/model.onnx"] = b"\0" * 4096
        files["README.md"] = b"# tiny\n"
        server.add_model(MODEL_REPO, files)
        lines = alpaca.read_bytes()
        server.add_dataset(
            DATASET_REPO,
            {
                "data/train.jsonl": lines,
                "data/test.jsonl": b"".join(lines.splitlines(keepends=True)[:5]),
                "README.md": b"# alpaca\n",
            },
        )
        yield server


def hub_config(tmp: Path, **extra: Any) -> dict[str, Any]:
    return stagein_config(
        tmp,
        {"source": MODEL_REPO, "kind": "hub"},
        {"source": DATASET_REPO, "kind": "hub"},
        **extra,
    )


def test_hub_model_and_dataset_staged_then_reused(
    tmp_path: Path,
    hub: HubServer,
    tiny_llama: Path,
    expected: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = hub_config(tmp_path)
    code, message = run_stagein(tmp_path / "first", cfg, monkeypatch)
    assert code == 0, message
    first = result_of(cfg, message)
    model_dir = Path(first.model_path)
    assert model_dir.parent == tmp_path / "cache" / "models"
    # Only what training reads: no .bin beside safetensors, no original/ or onnx/, no README.
    assert files_of(model_dir) == {p.name for p in tiny_llama.iterdir() if p.is_file()}
    assert files_of(Path(first.dataset_path)) == {"data/train.jsonl"}  # the train split
    assert counts(first) == expected
    assert first.model_config_json == json.loads((tiny_llama / "config.json").read_text())
    downloads = hub.downloads()
    assert downloads == len(files_of(model_dir)) + 1
    assert first.downloaded_bytes > 500_000 and first.reused_bytes == 0

    entry = json.loads((model_dir / ENTRY_FILE).read_text())
    assert entry["source"] == MODEL_REPO and entry["kind"] == "hub"
    assert entry["commit"] == HfApi().model_info(MODEL_REPO).sha
    assert {f["path"] for f in entry["files"]} == files_of(model_dir)
    assert entry["bytes"] == sum(f["bytes"] for f in entry["files"])

    time.sleep(0.01)
    cfg2 = hub_config(tmp_path, result_path=str(tmp_path / "out2" / "result.json"))
    code, message = run_stagein(tmp_path / "second", cfg2, monkeypatch)
    assert code == 0, message
    second = result_of(cfg2, message)
    assert hub.downloads() == downloads  # nothing fetched again
    assert second.downloaded_bytes == 0
    assert second.reused_bytes == first.downloaded_bytes
    assert (second.model_path, second.dataset_path) == (first.model_path, first.dataset_path)
    assert counts(second) == expected
    again = json.loads((model_dir / ENTRY_FILE).read_text())
    assert again["last_used"] > entry["last_used"] and again["fetched_at"] == entry["fetched_at"]

    listed = cache_entries(tmp_path / "cache")
    assert {(e.category, e.source) for e in listed} == {
        ("models", MODEL_REPO),
        ("datasets", DATASET_REPO),
    }
    assert sum(e.bytes for e in listed) == second.reused_bytes


def test_a_cache_entry_changed_on_the_volume_is_fetched_again(
    tmp_path: Path, hub: HubServer, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit is checked against the sha256 of every file its entry records: a file changed
    in place (same size), or one added beside them, sends the source to be fetched again."""
    cfg = hub_config(tmp_path)
    code, message = run_stagein(tmp_path / "first", cfg, monkeypatch)
    assert code == 0, message
    model_dir = Path(result_of(cfg, message).model_path)
    entry = json.loads((model_dir / ENTRY_FILE).read_text())
    config = next(f for f in entry["files"] if f["path"] == "config.json")
    assert config["sha256"] == hashlib.sha256((tiny_llama / "config.json").read_bytes()).hexdigest()
    fetched = hub.downloads()

    for change in ("changed", "added"):
        if change == "changed":
            data = bytearray((model_dir / "config.json").read_bytes())
            data[data.index(b"{") + 1 : data.index(b"{") + 2] = b" "  # same size
            (model_dir / "config.json").write_bytes(bytes(data))
        else:
            (model_dir / "modeling_planted.py").write_text("import os\n")
        code, message = run_stagein(tmp_path / change, cfg, monkeypatch)
        assert code == 0, message
        again = result_of(cfg, message)
        assert again.downloaded_bytes > 0, change
        assert hub.downloads() > fetched
        fetched = hub.downloads()
        assert files_of(model_dir) == {p.name for p in tiny_llama.iterdir() if p.is_file()}
        same = (model_dir / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
        assert same, change
    # Unchanged, it is a hit again.
    code, message = run_stagein(tmp_path / "last", cfg, monkeypatch)
    assert code == 0 and result_of(cfg, message).downloaded_bytes == 0
    assert hub.downloads() == fetched


def test_a_branch_that_moved_on_the_hub_is_fetched_again(
    tmp_path: Path, hub: HubServer, alpaca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit on an unpinned revision is checked against the commit the branch names now
    (one call): a dataset pushed again is what the next job trains on."""
    first_commit = hub.add_dataset("org/moving", {"train.jsonl": alpaca.read_bytes()})
    cfg = hub_config(tmp_path)
    cfg["dataset"]["source"] = "org/moving"
    code, message = run_stagein(tmp_path / "first", cfg, monkeypatch)
    assert code == 0, message
    staged = Path(result_of(cfg, message).dataset_path)
    newer = b"".join(reversed(alpaca.read_bytes().splitlines(keepends=True)))
    assert hub.add_dataset("org/moving", {"train.jsonl": newer}) != first_commit
    code, message = run_stagein(tmp_path / "second", cfg, monkeypatch)
    assert code == 0, message
    again = result_of(cfg, message)
    assert Path(again.dataset_path) == staged
    assert (staged / "train.jsonl").read_bytes() == newer
    assert again.downloaded_bytes >= len(newer)
    code, message = run_stagein(tmp_path / "third", cfg, monkeypatch)  # unmoved: a hit
    assert code == 0 and result_of(cfg, message).downloaded_bytes == 0


def test_a_hub_datasets_revision_is_the_one_staged(
    tmp_path: Path, hub: HubServer, alpaca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Branch "v1" holds the first 7 records only; main holds them all.
    head = b"".join(alpaca.read_bytes().splitlines(keepends=True)[:7])
    hub.add_dataset(DATASET_REPO, {"data/train.jsonl": head}, revision="v1")
    dataset = {"source": DATASET_REPO, "kind": "hub", "revision": "v1", "validation_split": 0.0}
    cfg = stagein_config(tmp_path, {"source": MODEL_REPO, "kind": "hub"}, dataset)
    code, message = run_stagein(tmp_path / "v1", cfg, monkeypatch)
    assert code == 0, message
    staged = result_of(cfg, message)
    assert staged.examples == 7
    assert (Path(staged.dataset_path) / "data" / "train.jsonl").read_bytes() == head


def test_cached_private_model_needs_its_token(
    tmp_path: Path,
    hub: HubServer,
    tiny_llama: Path,
    expected: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A private repository fetched for one job is not served from the cache to a job without
    a token that may read it."""
    hub.add_model("org/private-llama", tiny_llama, token="hf_private_token")
    monkeypatch.setenv("MODEL_TOKEN", "hf_private_token")
    cfg = hub_config(tmp_path)
    cfg["model"] = {"source": "org/private-llama", "kind": "hub", "token_env": "MODEL_TOKEN"}
    code, message = run_stagein(tmp_path / "with-token", cfg, monkeypatch)
    assert code == 0, message
    assert counts(result_of(cfg, message)) == expected
    downloads = hub.downloads()

    cfg["model"] = {"source": "org/private-llama", "kind": "hub"}
    code, message = run_stagein(tmp_path / "without", cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert message.startswith("config_error model org/private-llama: no such repository")
    assert "To fix" in message
    assert hub.downloads() == downloads


def test_two_stage_ins_at_once_download_once(
    tmp_path: Path, hub: HubServer, expected: dict[str, int]
) -> None:
    results: dict[int, StageInResult] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def one(i: int) -> None:
        cfg = StageInConfig.model_validate(
            hub_config(tmp_path, result_path=str(tmp_path / f"r{i}.json"))
        )
        try:
            start.wait()
            results[i] = stage_in(cfg)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert hub.downloads() == len(files_of(Path(results[0].model_path))) + 1  # once
    # Each source was fetched by one of them (whichever took its lock first) and found in
    # the cache by the other.
    total = results[0].downloaded_bytes + results[0].reused_bytes
    assert total == results[1].downloaded_bytes + results[1].reused_bytes
    assert sum(r.downloaded_bytes for r in results.values()) == total
    assert all(counts(r) == expected for r in results.values())
    assert not list((tmp_path / "cache" / "models").glob(".tmp-*"))


def test_transient_hub_errors_are_retried(
    tmp_path: Path, hub: HubServer, expected: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.fail_next(2, 503)
    cfg = hub_config(tmp_path)
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == 0, message
    assert counts(result_of(cfg, message)) == expected
    assert [r.status for r in hub.requests()[:2]] == [503, 503]


def test_hub_that_stays_down_is_transient(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.fail_next(100, 503)
    code, message = run_stagein(tmp_path, hub_config(tmp_path), monkeypatch)
    assert code == 1
    assert message.startswith("transient dataset org/alpaca: the hub could not be reached")


def test_another_architecture_fails_before_the_weights(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, message = run_stagein(tmp_path, hub_config(tmp_path, model_type="qwen2"), monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert message.startswith(f"config_error model {MODEL_REPO}: ")
    assert "model_type 'llama'" in message and "'qwen2'" in message and "To fix" in message
    assert not any(r.path.endswith("model.safetensors") for r in hub.requests())  # no weights


def test_missing_hub_repository_is_permanent(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = hub_config(tmp_path)
    cfg["model"]["source"] = "org/no-such-model"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "org/no-such-model: no such repository" in message and "To fix" in message
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing left behind


def test_malformed_line_names_the_file_and_line(
    tmp_path: Path, hub: HubServer, alpaca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = alpaca.read_bytes().splitlines(keepends=True)
    lines[6] = b'{"instruction": "repeat", "output": \n'
    hub.add_dataset("org/broken", {"train.jsonl": b"".join(lines)})
    cfg = hub_config(tmp_path)
    cfg["dataset"]["source"] = "org/broken"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "hf://datasets/org/broken/train.jsonl:7: not valid JSON" in message
    assert "To fix" in message
    assert hub.downloads(MODEL_REPO) == 0  # the dataset fails before the model is fetched


# ------------------------------------------------------------------ S3


@pytest.fixture(scope="module")
def s3(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, alpaca: Path
) -> Iterator[S3Server]:
    """versitygw with the model under s3://models/tiny-llama/ and the dataset as one object,
    s3://data/alpaca.jsonl (skipped where versitygw cannot be built)."""
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        server.make_bucket("models")
        server.put_tree("models", "tiny-llama", tiny_llama)
        server.make_bucket("data")
        server.client().upload_file(str(alpaca), "data", "alpaca.jsonl")
        yield server


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def use(**keys: str) -> None:
        for key, value in s3.env(**keys).items():
            monkeypatch.setenv(key, value)

    use()
    return use


def s3_config(tmp: Path, **extra: Any) -> dict[str, Any]:
    return stagein_config(
        tmp,
        {"source": "s3://models/tiny-llama", "kind": "s3"},
        {"source": "s3://data/alpaca.jsonl", "kind": "s3"},
        **extra,
    )


def test_s3_model_and_dataset_staged_then_reused(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    tiny_llama: Path,
    alpaca: Path,
    expected: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_gets, data_gets = s3.gets("models", "tiny-llama/"), s3.gets("data", "alpaca.jsonl")
    cfg = s3_config(tmp_path)
    code, message = run_stagein(tmp_path / "first", cfg, monkeypatch)
    assert code == 0, message
    first = result_of(cfg, message)
    model_dir = Path(first.model_path)
    assert tree_bytes(tiny_llama) == {
        k: v for k, v in tree_bytes(model_dir).items() if k != ENTRY_FILE
    }
    assert Path(first.dataset_path).read_bytes() == alpaca.read_bytes()
    assert Path(first.dataset_path).name == "alpaca.jsonl"
    assert counts(first) == expected
    assert s3.gets("models", "tiny-llama/") - model_gets >= len(files_of(model_dir))
    assert s3.gets("data", "alpaca.jsonl") - data_gets == 1
    fetched = s3.gets()

    cfg2 = s3_config(tmp_path, result_path=str(tmp_path / "out2" / "result.json"))
    code, message = run_stagein(tmp_path / "second", cfg2, monkeypatch)
    assert code == 0, message
    second = result_of(cfg2, message)
    assert s3.gets() == fetched  # not one object fetched again
    assert second.downloaded_bytes == 0 and second.reused_bytes == first.downloaded_bytes > 0
    assert counts(second) == expected

    # The cache is shared, access is not: keys that cannot read the bucket get nothing from it.
    s3_env(secret_key="not-the-secret-key")
    code, message = run_stagein(tmp_path / "third", cfg2, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert message.startswith("config_error dataset s3://data/alpaca.jsonl: S3 refused access")
    assert s3.gets() == fetched


def test_an_object_changed_at_the_source_is_fetched_again(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    alpaca: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hit is checked against the source's ETags (one LIST): data uploaded again under
    the same key is what the next job trains on, not the copy cached before."""
    s3.client().upload_file(str(alpaca), "data", "changing.jsonl")
    cfg = s3_config(tmp_path)
    cfg["dataset"]["source"] = "s3://data/changing.jsonl"
    code, message = run_stagein(tmp_path / "first", cfg, monkeypatch)
    assert code == 0, message
    staged = Path(result_of(cfg, message).dataset_path)
    lines = alpaca.read_bytes().splitlines(keepends=True)
    newer = tmp_path / "newer.jsonl"
    newer.write_bytes(b"".join(reversed(lines)))  # same size, another order
    s3.client().upload_file(str(newer), "data", "changing.jsonl")
    code, message = run_stagein(tmp_path / "second", cfg, monkeypatch)
    assert code == 0, message
    again = result_of(cfg, message)
    assert Path(again.dataset_path) == staged and staged.read_bytes() == newer.read_bytes()
    assert again.downloaded_bytes >= newer.stat().st_size
    code, message = run_stagein(tmp_path / "third", cfg, monkeypatch)  # unchanged: a hit
    assert code == 0 and result_of(cfg, message).downloaded_bytes == 0


def test_a_bucket_of_the_same_name_on_another_endpoint_is_another_source(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    tiny_llama: Path,
    alpaca: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tenant stages s3://data/alpaca.jsonl from a store of its own; another tenant's job
    names the same URI on the real store: the shared cache must not serve it the first
    one's file (the key holds the endpoint)."""
    poisoned = alpaca.read_text().splitlines()[:40]
    with s3_server(tmp_path / "other-store") as theirs:
        theirs.make_bucket("models")
        theirs.put_tree("models", "tiny-llama", tiny_llama)
        theirs.make_bucket("data")
        theirs.client().put_object(
            Bucket="data", Key="alpaca.jsonl", Body="\n".join(poisoned).encode() + b"\n"
        )
        for key, value in theirs.env().items():
            monkeypatch.setenv(key, value)
        cfg = s3_config(tmp_path)
        code, message = run_stagein(tmp_path / "theirs", cfg, monkeypatch)
        assert code == 0, message
        assert len(Path(result_of(cfg, message).dataset_path).read_text().splitlines()) == 40

    s3_env()  # the real store, same URIs, same cache volume
    gets = s3.gets("data", "alpaca.jsonl")
    cfg = s3_config(tmp_path, result_path=str(tmp_path / "out2" / "result.json"))
    code, message = run_stagein(tmp_path / "ours", cfg, monkeypatch)
    assert code == 0, message
    assert Path(result_of(cfg, message).dataset_path).read_bytes() == alpaca.read_bytes()
    assert s3.gets("data", "alpaca.jsonl") == gets + 1


def test_s3_two_processes_at_once_fetch_once(
    tmp_path: Path, s3: S3Server, s3_env: Callable[..., None], tiny_llama: Path
) -> None:
    """Two stage-in processes (the real entry point) on one cache volume: the file lock makes
    one fetch each source while the other waits, then finds it in the cache."""
    model_gets, data_gets = s3.gets("models", "tiny-llama/"), s3.gets("data", "alpaca.jsonl")
    procs, configs = [], []
    for i in range(2):
        cfg = s3_config(tmp_path, result_path=str(tmp_path / f"out{i}" / "result.json"))
        config = tmp_path / f"stagein-{i}.json"
        config.write_text(json.dumps(cfg))
        configs.append(cfg)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "kubetune_trainer.stagein", "--config", str(config)],
                env=worker_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
    results = [
        StageInResult.model_validate_json(Path(c["result_path"]).read_text()) for c in configs
    ]
    n_files = sum(1 for p in tiny_llama.iterdir() if p.is_file())
    assert s3.gets("models", "tiny-llama/") - model_gets == n_files  # each object once
    assert s3.gets("data", "alpaca.jsonl") - data_gets == 1
    total = results[0].downloaded_bytes + results[0].reused_bytes
    assert sum(r.downloaded_bytes for r in results) == total > 0


def test_s3_wrong_credentials_fail_fast_with_the_uri(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong secret key is refused at once: with the production retry delays (5, 15, 45 s)
    in place, a refusal that were retried could not end within a minute."""
    monkeypatch.setattr(hub_module, "RETRY_DELAYS_S", PRODUCTION_DELAYS_S)
    s3_env(secret_key="not-the-secret-key")
    cfg = s3_config(tmp_path)
    t0 = time.monotonic()
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert time.monotonic() - t0 < 60
    assert message.startswith("config_error dataset s3://data/alpaca.jsonl: S3 refused access")
    assert "SignatureDoesNotMatch" in message and "To fix" in message
    assert not Path(cfg["result_path"]).exists()


def test_s3_missing_object_is_permanent(
    tmp_path: Path, s3: S3Server, s3_env: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = s3_config(tmp_path)
    cfg["dataset"]["source"] = "s3://data/nothing-here.jsonl"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "dataset s3://data/nothing-here.jsonl: no objects under it" in message
    assert "To fix" in message

    cfg["dataset"]["source"] = "s3://no-such-bucket/alpaca.jsonl"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "there is no bucket 'no-such-bucket'" in message and "To fix" in message


def test_s3_malformed_record_names_the_object_and_line(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    alpaca: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = alpaca.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"instruction": "copy"}\n'  # valid JSON, no output
    broken = tmp_path / "broken"
    write = broken / "part-0.jsonl"
    write.parent.mkdir()
    write.write_bytes(b"".join(lines))
    s3.put_tree("data", "broken", broken)
    cfg = s3_config(tmp_path)
    cfg["dataset"]["source"] = "s3://data/broken/"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert "s3://data/broken/part-0.jsonl:3: alpaca record needs a string field 'output'" in (
        message
    )
    assert "To fix" in message


# ------------------------------------------------------------------ https


@pytest.fixture
def web(alpaca: Path) -> Iterator[tuple[str, list[int]]]:
    """A plain HTTP server on loopback serving /data/alpaca.jsonl, whose first answer is a
    503; (base URL, the statuses it answered)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    statuses: list[int] = []
    body = alpaca.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 503 if not statuses else 200 if self.path == "/data/alpaca.jsonl" else 404
            statuses.append(status)
            data = body if status == 200 else b"no"
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    finally:
        server.shutdown()
        server.server_close()


def test_https_dataset_is_streamed_with_retries(
    tmp_path: Path,
    web: tuple[str, list[int]],
    tiny_llama: Path,
    alpaca: Path,
    expected: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base, statuses = web
    cfg = stagein_config(
        tmp_path,
        {"source": str(tiny_llama), "kind": "path"},
        {"source": f"{base}/data/alpaca.jsonl", "kind": "https"},
    )
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == 0, message
    result = result_of(cfg, message)
    assert statuses == [503, 200]
    assert Path(result.dataset_path).read_bytes() == alpaca.read_bytes()
    assert counts(result) == expected

    cfg["dataset"]["source"] = f"{base}/data/missing.jsonl"
    code, message = run_stagein(tmp_path, cfg, monkeypatch)
    assert code == EXIT_CONFIG_ERROR
    assert f"dataset {base}/data/missing.jsonl: the server answered HTTP 404" in message
    assert "To fix" in message


# ------------------------------------------------------------------ progress gauges


def scrape(port: int) -> dict[str, float]:
    """The stage-in's gauges, read over HTTP as the operator reads them."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = {v: k for k, v in STAGE_IN_METRICS.items()}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] = float(value)
    assert set(values) == set(STAGE_IN_METRICS), text
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def entry_bytes(path: str) -> tuple[int, int]:
    """(files, bytes) of the cache entry a result path is, or is inside."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    meta = json.loads((folder / ENTRY_FILE).read_text())
    return len(meta["files"]), int(meta["bytes"])


def test_progress_is_served_while_a_stage_in_runs(
    tmp_path: Path, hub: HubServer, alpaca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scraped mid-run on `metrics_port`: with the model's lock held elsewhere the stage-in
    waits after the dataset, whose file is counted whole; then the model is fetched."""
    monkeypatch.setenv("KUBETUNE_METRICS_ADDR", "127.0.0.1")
    port = free_port()
    cfg = StageInConfig.model_validate(hub_config(tmp_path, metrics_port=port))
    cache = tmp_path / "cache"
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = stage_in(cfg)
        except BaseException as e:
            outcome["error"] = e

    with locked(cache, cache_key("hub", MODEL_REPO, None, source_origin("hub")), "the test"):
        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                seen = scrape(port)
            except OSError:
                seen = {}
            if seen and seen["files_total"] > 0 and seen["files_done"] == seen["files_total"]:
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        assert thread.is_alive()  # waiting for the model's lock
    thread.join(60)
    assert "error" not in outcome, outcome
    dataset = len(alpaca.read_bytes())
    assert seen == {
        "bytes_done": dataset,
        "bytes_total": dataset,
        "files_done": 1,
        "files_total": 1,
    }
    with pytest.raises(OSError):  # the endpoint lives as long as the stage-in
        scrape(port)


def test_progress_totals_are_the_files_staged(
    tmp_path: Path,
    hub: HubServer,
    web: tuple[str, list[int]],
    tiny_llama: Path,
    alpaca: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the end the totals are the staged files and everything is done: fetched from the
    hub, found in the cache by a second stage-in, streamed over https."""
    monkeypatch.setenv("KUBETUNE_METRICS_ADDR", "127.0.0.1")
    samples: list[dict[str, int]] = []
    progress = StageProgress()
    progress.serve(0)
    stop = threading.Event()

    def sample() -> None:  # never more done than known to do
        while not stop.wait(0.005):
            samples.append(progress.values())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = stage_in(StageInConfig.model_validate(hub_config(tmp_path)), progress=progress)
        stop.set()
        sampler.join()
        end = scrape(progress.port or 0)
    finally:
        stop.set()
        progress.close()
    model_files, model_bytes = entry_bytes(result.model_path)
    data_files, data_bytes = entry_bytes(result.dataset_path)
    assert model_files == sum(1 for p in tiny_llama.iterdir() if p.is_file())
    assert end["bytes_total"] == model_bytes + data_bytes == result.downloaded_bytes
    assert end["files_total"] == model_files + data_files
    assert (end["bytes_done"], end["files_done"]) == (end["bytes_total"], end["files_total"])
    assert samples and all(s["bytes_done"] <= s["bytes_total"] for s in samples)
    assert all(s["files_done"] <= s["files_total"] for s in samples)

    again = StageProgress()
    second = stage_in(
        StageInConfig.model_validate(
            hub_config(tmp_path / "again", cache_dir=str(tmp_path / "cache"))
        ),
        progress=again,
    )
    assert second.downloaded_bytes == 0
    assert again.values() == {k: int(v) for k, v in end.items()}  # found: done at once

    base, _ = web
    https = StageProgress()
    stage_in(
        StageInConfig.model_validate(
            stagein_config(
                tmp_path / "https",
                {"source": str(tiny_llama), "kind": "path"},
                {"source": f"{base}/data/alpaca.jsonl", "kind": "https"},
            )
        ),
        progress=https,
    )
    size = len(alpaca.read_bytes())
    assert https.values() == {
        "bytes_done": size,
        "bytes_total": size,  # Content-Length
        "files_done": 1,
        "files_total": 1,
    }


def test_s3_progress_counts_bytes_as_they_arrive(
    tmp_path: Path,
    s3: S3Server,
    s3_env: Callable[..., None],
    tiny_llama: Path,
    alpaca: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transfer's callback reports a file's bytes before it is done; the totals come from
    the listing."""
    arriving: dict[str, int] = {}
    moving = Progress.moving

    def record(self: Progress, name: str, nbytes: int) -> None:
        arriving[name] = max(arriving.get(name, 0), nbytes)
        moving(self, name, nbytes)

    monkeypatch.setattr(Progress, "moving", record)
    progress = StageProgress()
    result = stage_in(StageInConfig.model_validate(s3_config(tmp_path)), progress=progress)
    sizes = {p.name: p.stat().st_size for p in tiny_llama.iterdir() if p.is_file()}
    size = len(alpaca.read_bytes())
    assert progress.values() == {
        "bytes_done": sum(sizes.values()) + size,
        "bytes_total": sum(sizes.values()) + size,
        "files_done": len(sizes) + 1,
        "files_total": len(sizes) + 1,
    }
    assert result.downloaded_bytes == sum(sizes.values()) + size
    assert arriving["model.safetensors"] == sizes["model.safetensors"]
    assert arriving["alpaca.jsonl"] == size


# ------------------------------------------------------------------ eviction

EVICTION_REPOS = ("org/data-a", "org/data-b", "org/data-c")


@pytest.fixture
def three_entries(
    tmp_path: Path, hub: HubServer, tiny_llama: Path, alpaca: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], tuple[Path, dict[str, Path]]]:
    """A cache holding three dataset entries of the same size, used in the order a, b, c;
    each call gives a copy of it (the cache, the entry of each letter)."""
    staged = tmp_path / "staged"
    paths: dict[str, Path] = {}
    for letter, repo in zip("abc", EVICTION_REPOS, strict=True):
        hub.add_dataset(repo, {"data/train.jsonl": alpaca.read_bytes()})
        cfg = stagein_config(
            staged / letter,
            {"source": str(tiny_llama), "kind": "path"},
            {"source": repo, "kind": "hub"},
            cache_dir=str(staged / "cache"),
        )
        code, message = run_stagein(staged / letter, cfg, monkeypatch)  # cache_max_bytes None
        assert code == 0, message
        paths[letter] = Path(result_of(cfg, message).dataset_path)
    assert len(cache_entries(staged / "cache")) == 3  # no cap: nothing evicted
    for day, folder in enumerate(paths.values(), start=1):  # a oldest, c newest
        meta = json.loads((folder / ENTRY_FILE).read_text())
        meta["last_used"] = f"2026-01-0{day}T00:00:00.000000Z"
        (folder / ENTRY_FILE).write_text(json.dumps(meta))

    def copy(name: str) -> tuple[Path, dict[str, Path]]:
        cache = tmp_path / name / "cache"
        shutil.copytree(staged / "cache", cache)
        return cache, {k: cache / "datasets" / p.name for k, p in paths.items()}

    return copy


def stage_c(
    tmp: Path,
    cache: Path,
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    **extra: Any,
) -> dict[str, Any]:
    """A stage-in of dataset c with `extra` settings; its eviction line."""
    cfg = stagein_config(
        tmp,
        {"source": str(tiny_llama), "kind": "path"},
        {"source": EVICTION_REPOS[2], "kind": "hub"},
        cache_dir=str(cache),
        **extra,
    )
    capsys.readouterr()
    code, message = run_stagein(tmp, cfg, monkeypatch)
    assert code == 0, message
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    evictions = [x for x in lines if "evicted" in x]
    assert len(evictions) == (0 if extra.get("cache_max_bytes") is None else 1), lines
    return evictions[0] if evictions else {}


def left(cache: Path) -> set[str]:
    """The entries in the cache, by letter; and no half-deleted folder."""
    assert not [p for p in (cache / "datasets").iterdir() if p.name.startswith(".")]
    names = {e.path.name for e in cache_entries(cache)}
    return {
        c
        for c, repo in zip("abc", EVICTION_REPOS, strict=True)
        if cache_key("hub", repo, None, source_origin("hub")) in names
    }


def test_eviction_removes_the_least_recently_used_down_to_the_cap(
    tmp_path: Path,
    three_entries: Callable[[str], tuple[Path, dict[str, Path]]],
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache, entries = three_entries("lru")
    size = entry_bytes(str(entries["a"]))[1]
    assert stage_c(tmp_path / "none", cache, tiny_llama, monkeypatch, capsys) == {}
    assert left(cache) == {"a", "b", "c"}  # no cap: nothing evicted

    line = stage_c(
        tmp_path / "lru", cache, tiny_llama, monkeypatch, capsys, cache_max_bytes=2 * size
    )
    assert left(cache) == {"b", "c"}  # a was used longest ago; two fit
    assert [e["path"] for e in line["evicted"]] == [str(entries["a"])]
    assert line["bytes"] == size and line["evicted"][0]["source"] == EVICTION_REPOS[0]

    line = stage_c(
        tmp_path / "fits", cache, tiny_llama, monkeypatch, capsys, cache_max_bytes=2 * size
    )
    assert line == {"event": "stagein_evicted", "evicted": [], "bytes": 0}
    assert left(cache) == {"b", "c"}


def test_eviction_spares_kept_and_locked_entries(
    tmp_path: Path,
    three_entries: Callable[[str], tuple[Path, dict[str, Path]]],
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a, the oldest, is read by a running job (named by a file inside it): b goes instead.
    cache, entries = three_entries("kept")
    size = entry_bytes(str(entries["a"]))[1]
    kept = [str(entries["a"] / "data" / "train.jsonl")]
    line = stage_c(
        tmp_path / "kept",
        cache,
        tiny_llama,
        monkeypatch,
        capsys,
        cache_max_bytes=2 * size,
        keep_paths=kept,
    )
    assert left(cache) == {"a", "c"}
    assert [e["path"] for e in line["evicted"]] == [str(entries["b"])]

    # a's lock is held (a fetch or a use in progress): b goes instead.
    cache, entries = three_entries("locked")
    with locked(cache, entries["a"].name, "the test"):
        line = stage_c(
            tmp_path / "locked", cache, tiny_llama, monkeypatch, capsys, cache_max_bytes=2 * size
        )
    assert left(cache) == {"a", "c"}
    assert [e["path"] for e in line["evicted"]] == [str(entries["b"])]

    # Everything but c is kept, and c is what this stage-in hands out: over the cap, warned.
    cache, entries = three_entries("all-kept")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubetune_trainer.stagein.evict"):
        line = stage_c(
            tmp_path / "all-kept",
            cache,
            tiny_llama,
            monkeypatch,
            capsys,
            cache_max_bytes=0,
            keep_paths=[str(entries["a"]), str(entries["b"]) + "/"],
        )
    assert line["evicted"] == [] and left(cache) == {"a", "b", "c"}
    warnings = [r for r in caplog.records if r.name == "kubetune_trainer.stagein.evict"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "over its cap" in warnings[0].getMessage()
