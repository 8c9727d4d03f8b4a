"""The tokenized-data cache (`kubetune_trainer.datacache`): rows written once, memory-mapped.

The cached rows must be the rows the uncached path builds, down to every collated batch, so
the step-exact resume and loss-equality tests hold with the cache on (it is on by default).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("transformers", reason="trainer tests need the trainer extra")

import numpy as np
import torch

from kubetune_trainer.contract import EXIT_OK
from kubetune_trainer.data import (
    DEFAULT_CHAT_TEMPLATE,
    PairRows,
    PreparedData,
    Ragged,
    Rows,
    StepBatches,
    eval_batches,
    prepare_data,
    prepare_preference_data,
    read_records,
)
from kubetune_trainer.datacache import (
    CACHE_ENV,
    CACHE_FOLDER,
    MANIFEST,
    CacheOutcome,
    cache_identity,
    cache_key,
    tokenized_data,
    write_cache,
)
from kubetune_trainer.distributed import DistEnv
from kubetune_trainer.errors import DataError
from kubetune_trainer.tiny import make_preference_records, make_records, write_jsonl
from support.trainer import load_config, read_log, trainer_config, write_config

pytestmark = pytest.mark.trainer

Runner = Callable[..., subprocess.CompletedProcess[str]]
ONE_RANK = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture
def tiny_tokenizer_without_template(tiny_llama: Path) -> Callable[[], Any]:
    from transformers import AutoTokenizer

    def load() -> Any:
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        tok.chat_template = None
        return tok

    return load


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    records = make_preference_records(60, seed=1) + make_preference_records(60, seed=2, chat=True)
    return write_jsonl(tmp_path_factory.mktemp("data") / "pref.jsonl", records)


def config(tmp: Path, model: Path, data: Path, **training: Any) -> Any:
    cfg = trainer_config(tmp, model, data, "lora", training=training)
    cfg["dataset"]["validation_split"] = 0.1
    return load_config(cfg)


def preparer(cfg: Any, tokenizer: Any, calls: list[int]) -> Callable[[], PreparedData]:
    """What the recipe passes: the uncached path, counting how often it runs."""

    def prepare() -> PreparedData:
        calls.append(1)
        records = read_records(cfg.dataset.source, cfg.dataset.kind, cfg.dataset.revision)
        t = cfg.training
        if t.objective == "dpo":
            return prepare_preference_data(
                records,
                tokenizer=tokenizer,
                sequence_length=t.sequence_length,
                validation_split=cfg.dataset.validation_split,
                seed=t.seed,
            )
        return prepare_data(
            records,
            fmt=cfg.dataset.format,
            tokenizer=tokenizer,
            sequence_length=t.sequence_length,
            packing=t.packing,
            validation_split=cfg.dataset.validation_split,
            seed=t.seed,
        )

    return prepare


def cached(cfg: Any, tokenizer: Any) -> tuple[PreparedData, CacheOutcome, int]:
    calls: list[int] = []
    data, outcome = tokenized_data(cfg, ONE_RANK, tokenizer, preparer(cfg, tokenizer, calls))
    return data, outcome, len(calls)


def plain_rows(rows: Rows) -> dict[str, Any]:
    def lists(seq: Any) -> list[list[int]] | None:
        return None if seq is None else [[int(x) for x in r] for r in seq]

    return {
        "input_ids": lists(rows.input_ids),
        "labels": lists(rows.labels),
        "position_ids": lists(rows.position_ids),
        "lengths": [int(x) for x in rows.lengths],
    }


def assert_same_batches(want: Rows | PairRows, got: Rows | PairRows, pad_id: int) -> None:
    """Every training step and every evaluation batch, tensor for tensor."""

    def steps(rows: Rows | PairRows) -> list[Any]:
        sb = StepBatches(
            rows, micro_batch=3, grad_accum=2, world_size=2, rank=1, seed=7, pad_id=pad_id
        )
        out: list[Any] = []
        for _ in range(2 * sb.steps_per_epoch + 1):
            out.extend(sb.next_step())
            sb.advance()
        out.extend(eval_batches(rows, micro_batch=3, world_size=2, rank=0, pad_id=pad_id))
        return out

    for a, b in zip(steps(want), steps(got), strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        for name in ("input_ids", "labels", "attention_mask", "position_ids"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None), name
            if ta is not None:
                assert ta.dtype == tb.dtype == torch.long
                assert torch.equal(ta, tb), name
        assert a.tokens == b.tokens and isinstance(b.tokens, int)


def assert_same_data(want: PreparedData, got: PreparedData, pad_id: int) -> None:
    assert got.stats == want.stats
    for split in ("train", "validation"):
        a, b = getattr(want, split), getattr(got, split)
        assert (a is None) == (b is None)
        if a is None:
            continue
        if isinstance(a, PairRows):
            assert isinstance(b, PairRows)
            assert plain_rows(a.chosen) == plain_rows(b.chosen)
            assert plain_rows(a.rejected) == plain_rows(b.rejected)
            assert isinstance(b.chosen.input_ids, Ragged)
        else:
            assert isinstance(b, Rows)
            assert plain_rows(a) == plain_rows(b)
            assert isinstance(b.input_ids, Ragged)
            assert isinstance(b.input_ids.flat, np.memmap)
        assert_same_batches(a, b, pad_id)


@pytest.mark.parametrize("packing", [True, False])
def test_sft_rows_from_the_cache_equal_the_uncached_rows(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, tokenizer: Any, packing: bool
) -> None:
    cfg = config(tmp_path, tiny_llama, alpaca_data, packing=packing)
    want = preparer(cfg, tokenizer, [])()
    got, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "built" and calls == 1
    assert outcome.folder is not None and outcome.folder.parent == tmp_path / "ckpt" / CACHE_FOLDER
    assert_same_data(want, got, tokenizer.pad_token_id)
    # A later start (a resume) reads it and tokenizes nothing.
    again, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "read" and calls == 0
    assert_same_data(want, again, tokenizer.pad_token_id)


def test_dpo_pairs_from_the_cache_equal_the_uncached_pairs(
    tmp_path: Path, tiny_llama: Path, pref_data: Path, tokenizer: Any
) -> None:
    cfg = config(tmp_path, tiny_llama, pref_data, objective="dpo", packing=False)
    want = preparer(cfg, tokenizer, [])()
    got, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "built" and calls == 1
    assert_same_data(want, got, tokenizer.pad_token_id)
    # The recipe attaches the precomputed reference to the rows it got from the cache.
    assert isinstance(got.train, PairRows)
    n = len(got.train)
    got.train.ref_chosen, got.train.ref_rejected = [0.5] * n, [-0.5] * n
    batch = next(iter(eval_batches(got.train, micro_batch=2, world_size=1, rank=0, pad_id=0)))
    assert batch is not None and batch.ref_logps is not None
    assert batch.ref_logps.tolist() == [0.5, 0.5, -0.5, -0.5]
    _, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "read" and calls == 0


def test_a_rank_that_reads_the_cache_gets_the_tokenizer_preparing_would_leave(
    tmp_path: Path, tiny_llama: Path, tiny_tokenizer_without_template: Callable[[], Any]
) -> None:
    """Preparing chat data gives a template-less tokenizer ChatML (saved with the output);
    a rank that only read the cache must end with the same tokenizer."""
    data = write_jsonl(tmp_path / "chat.jsonl", make_records("chat", 40))
    cfg = trainer_config(tmp_path, tiny_llama, data, "lora")
    cfg["dataset"]["format"] = "chat"
    cfg = load_config(cfg)
    writer, reader = tiny_tokenizer_without_template(), tiny_tokenizer_without_template()
    built, first, _ = cached(cfg, writer)
    got, outcome, calls = cached(cfg, reader)
    assert (first.source, outcome.source, calls) == ("built", "read", 0)
    assert reader.chat_template == writer.chat_template == DEFAULT_CHAT_TEMPLATE
    assert got.stats.notes == built.stats.notes != []


def test_a_changed_key_builds_a_new_cache_and_drops_the_old(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, tokenizer: Any
) -> None:
    _, first, _ = cached(config(tmp_path, tiny_llama, alpaca_data), tokenizer)
    cfg = config(tmp_path, tiny_llama, alpaca_data, sequence_length=64)
    data, second, calls = cached(cfg, tokenizer)
    assert second.source == "built" and calls == 1
    assert first.folder != second.folder
    assert second.folder is not None and second.folder.is_dir()
    assert first.folder is not None and not first.folder.exists(), "one cache per volume"
    assert isinstance(data.train, Rows)
    assert {len(r) for r in data.train.input_ids} == {64}
    assert_same_data(preparer(cfg, tokenizer, [])(), data, tokenizer.pad_token_id)


def _truncate(folder: Path) -> None:
    path = folder / "train.rows.input_ids.npy"
    path.write_bytes(path.read_bytes()[:-8])


def _flip_a_byte(folder: Path) -> None:
    path = folder / "train.rows.labels.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def _no_manifest(folder: Path) -> None:
    (folder / MANIFEST).unlink()


def _garbled_manifest(folder: Path) -> None:
    (folder / MANIFEST).write_text('{"key": ')


def _missing_file(folder: Path) -> None:
    (folder / "train.rows.offsets.npy").unlink()


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_a_byte, _no_manifest, _garbled_manifest, _missing_file]
)
def test_a_damaged_cache_is_rebuilt(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    tokenizer: Any,
    damage: Callable[[Path], None],
) -> None:
    cfg = config(tmp_path, tiny_llama, alpaca_data)
    _, first, _ = cached(cfg, tokenizer)
    assert first.folder is not None
    damage(first.folder)
    got, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "built" and calls == 1
    assert_same_data(preparer(cfg, tokenizer, [])(), got, tokenizer.pad_token_id)
    _, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "read" and calls == 0


def test_a_cache_another_node_wrote_meanwhile_is_kept(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, tokenizer: Any
) -> None:
    """Nodes sharing the volume may build at once: whoever finds a complete folder once it
    has tokenized keeps it (ranks of the other node may be mapping it)."""
    cfg = config(tmp_path, tiny_llama, alpaca_data)
    identity = cache_identity(cfg, tokenizer)
    root = tmp_path / "ckpt" / CACHE_FOLDER
    theirs: list[int] = []

    def prepare_while_another_node_writes() -> PreparedData:
        data = preparer(cfg, tokenizer, [])()
        folder = write_cache(root, cache_key(identity), identity, data)
        theirs.append((folder / MANIFEST).stat().st_ino)
        return data

    data, outcome = tokenized_data(cfg, ONE_RANK, tokenizer, prepare_while_another_node_writes)
    assert outcome.source == "built" and outcome.folder is not None
    assert (outcome.folder / MANIFEST).stat().st_ino == theirs[0]
    assert [p.name for p in root.iterdir()] == [outcome.folder.name], "no temporary left"
    assert_same_data(preparer(cfg, tokenizer, [])(), data, tokenizer.pad_token_id)


def test_a_bad_dataset_fails_as_without_the_cache(
    tmp_path: Path, tiny_llama: Path, tokenizer: Any
) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "x"}])
    cfg = config(tmp_path, tiny_llama, data)
    with pytest.raises(DataError, match="output"):
        cached(cfg, tokenizer)
    assert not any((tmp_path / "ckpt" / CACHE_FOLDER).glob("[!.]*")), "nothing cached"


def test_an_unwritable_volume_falls_back_to_memory(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, tokenizer: Any
) -> None:
    cfg = config(tmp_path, tiny_llama, alpaca_data)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / CACHE_FOLDER).write_text("a file where the folder goes")
    got, outcome, calls = cached(cfg, tokenizer)
    assert outcome.source == "off" and calls == 1
    assert plain_rows(got.train) == plain_rows(preparer(cfg, tokenizer, [])().train)  # type: ignore[arg-type]


def test_the_cache_can_be_turned_off(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    _, outcome, calls = cached(config(tmp_path, tiny_llama, alpaca_data), tokenizer)
    assert outcome.source == "off" and calls == 1
    assert not (tmp_path / "ckpt" / CACHE_FOLDER).exists()


def test_two_processes_tokenize_once_and_a_resume_tokenizes_nothing(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1},
        checkpoint={"interval_steps": 2},
    )
    path = write_config(tmp_path, cfg)
    proc = run_launcher(path, nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    start = read_log(tmp_path / "metrics.jsonl", "start")[0]
    assert start["data_cache"] == "built" and start["world_size"] == 2
    assert start["data_tokenized_ranks"] == 1, "rank 1 maps what rank 0 wrote"
    caches = [p for p in (tmp_path / "ckpt" / CACHE_FOLDER).iterdir()]
    assert len(caches) == 1 and (caches[0] / MANIFEST).is_file()
    manifest = json.loads((caches[0] / MANIFEST).read_text())
    assert manifest["stats"]["train_rows"] == start["train_rows"]

    proc = run_launcher(path, nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    start = read_log(tmp_path / "metrics.jsonl", "start")[-1]
    assert start["resumed_from"] is not None
    assert start["data_cache"] == "read" and start["data_tokenized_ranks"] == 0
    assert "(cache: read " in proc.stderr
