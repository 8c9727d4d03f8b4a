"""Dataset formats, loss masking, packing, order and bad-data errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("transformers", reason="trainer tests need the trainer extra")

from kubetune_trainer.data import (
    IGNORE_INDEX,
    DataPosition,
    Record,
    StepBatches,
    eval_batches,
    pack,
    prepare_data,
    read_records,
    record_to_example,
)
from kubetune_trainer.errors import DataError
from kubetune_trainer.tiny import make_records, write_jsonl

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def decode_trained(tok: Any, ex: Any) -> str:
    return str(
        tok.decode(
            [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE_INDEX]
        )
    )


# ------------------------------------------------------------------ formats and masking


def test_alpaca_masks_the_prompt(tokenizer: Any) -> None:
    rec = Record(
        "x:1", {"instruction": "repeat the words red cat", "input": "", "output": "red cat"}
    )
    ex = record_to_example(rec, "alpaca", tokenizer)
    assert decode_trained(tokenizer, ex) == "red cat</s>"
    assert ex.labels[0] == IGNORE_INDEX
    assert tokenizer.decode(ex.input_ids).startswith("<s>Below is an instruction")


def test_alpaca_with_input_uses_the_input_template(tokenizer: Any) -> None:
    rec = Record("x:1", {"instruction": "add", "input": "one two", "output": "three"})
    ex = record_to_example(rec, "alpaca", tokenizer)
    assert "### Input:\none two" in tokenizer.decode(ex.input_ids)
    assert decode_trained(tokenizer, ex) == "three</s>"


def test_instruction_response_trains_only_the_response(tokenizer: Any) -> None:
    rec = Record("x:1", {"instruction": "say blue", "response": "blue"})
    ex = record_to_example(rec, "instruction-response", tokenizer)
    assert decode_trained(tokenizer, ex) == "blue<|im_end|>\n"
    assert "<|im_start|>user\nsay blue" in tokenizer.decode(ex.input_ids)


def test_prompt_completion_aliases(tokenizer: Any) -> None:
    rec = Record("x:1", {"prompt": "say blue", "completion": "blue"})
    ex = record_to_example(rec, "instruction-response", tokenizer)
    assert decode_trained(tokenizer, ex) == "blue<|im_end|>\n"


def test_sharegpt_trains_every_assistant_turn(tokenizer: Any) -> None:
    rec = Record("x:1", make_records("sharegpt", 1)[0])
    ex = record_to_example(rec, "sharegpt", tokenizer)
    answer = rec.value["conversations"][2]["value"]
    assert decode_trained(tokenizer, ex) == f"{answer}<|im_end|>\n{answer}<|im_end|>\n"
    full = tokenizer.decode(ex.input_ids)
    assert full.startswith("<|im_start|>system\nyou copy words")


def test_chat_uses_the_tokenizer_template(tokenizer: Any) -> None:
    rec = Record(
        "x:1",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"}]},
    )
    ex = record_to_example(rec, "chat", tokenizer)
    assert (
        tokenizer.decode(ex.input_ids)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\none<|im_end|>\n"
    )
    assert decode_trained(tokenizer, ex) == "one<|im_end|>\n"


def test_text_trains_every_token(tokenizer: Any) -> None:
    ex = record_to_example(Record("x:1", {"text": "red blue cat"}), "text", tokenizer)
    assert ex.labels == ex.input_ids
    assert ex.input_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "chat", "instruction-response", "text"])
def test_each_format_prepares(tmp_path: Path, tokenizer: Any, fmt: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", make_records(fmt, 40))
    data = prepare_data(
        read_records(str(path)),
        fmt=fmt,
        tokenizer=tokenizer,
        sequence_length=128,
        packing=False,
        validation_split=0.1,
        seed=0,
    )
    assert data.stats.examples == 40
    assert len(data.train) == 36 and data.validation is not None and len(data.validation) == 4
    assert all(any(x != IGNORE_INDEX for x in labels) for labels in data.train.labels)


def test_template_less_tokenizer_gets_chatml(tmp_path: Path) -> None:
    from kubetune_trainer.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok", chat_template=False)
    data = prepare_data(
        [Record("x:1", {"instruction": "a", "response": "b"})],
        fmt="instruction-response",
        tokenizer=tok,
        sequence_length=64,
        packing=False,
        validation_split=0.0,
        seed=0,
    )
    assert any("ChatML" in n for n in data.stats.notes)


# ------------------------------------------------------------------ file types


def test_json_parquet_txt_and_folders(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = make_records("alpaca", 5)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps({"data": recs}))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d" / "b.parquet")
    write_jsonl(tmp_path / "d" / "c.jsonl", recs)
    records = read_records(str(tmp_path / "d"))
    assert len(records) == 15
    assert records[0].where.endswith("a.json record 1")
    assert records[5].where.endswith("b.parquet row 1")
    assert records[10].where.endswith("c.jsonl:1")
    (tmp_path / "t.txt").write_text("first doc\nstill first\n\nsecond doc\n")
    texts = read_records(str(tmp_path / "t.txt"))
    assert [r.value["text"] for r in texts] == ["first doc\nstill first", "second doc"]
    assert texts[1].where.endswith("t.txt:4")


# ------------------------------------------------------------------ bad data


@pytest.mark.parametrize(
    ("content", "fmt", "expected"),
    [
        (
            b'{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n',
            "alpaca",
            r"bad\.jsonl:2: alpaca record needs a string field 'output'",
        ),
        (
            b'{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 3}\n',
            "alpaca",
            r"bad\.jsonl:2: alpaca field 'output' must be a string",
        ),
        (
            b'{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"\n',
            "alpaca",
            r"bad\.jsonl:2: not valid JSON",
        ),
        (
            b'{"instruction": "a", "output": "b"}\n\n{"instruction": "\xff\xfe", "output": "b"}\n',
            "alpaca",
            r"bad\.jsonl:3: not valid UTF-8",
        ),
        (
            b'{"instruction": "  ", "output": "b"}\n',
            "alpaca",
            r"bad\.jsonl:1: alpaca field 'instruction' is empty",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}\n',
            "chat",
            r"bad\.jsonl:1: conversation has no assistant turn",
        ),
        (
            b'{"conversations": [{"from": "robot", "value": "hi"}]}\n',
            "sharegpt",
            r"bad\.jsonl:1: conversations\[0\]\.from 'robot' is not a known role",
        ),
        (b'{"txt": "hi"}\n', "text", r"bad\.jsonl:1: text record needs a string field 'text'"),
        (b"\n\n", "alpaca", r"bad\.jsonl: empty"),
    ],
)
def test_bad_data_names_file_line_and_problem(
    tmp_path: Path, tokenizer: Any, content: bytes, fmt: str, expected: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected):
        prepare_data(
            read_records(str(path)),
            fmt=fmt,
            tokenizer=tokenizer,
            sequence_length=128,
            packing=True,
            validation_split=0.0,
            seed=0,
        )


def test_many_bad_records_are_summarised(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "x"}] * 9)
    with pytest.raises(DataError) as err:
        prepare_data(
            read_records(str(path)),
            fmt="alpaca",
            tokenizer=tokenizer,
            sequence_length=64,
            packing=False,
            validation_split=0.0,
            seed=0,
        )
    assert "9 bad record(s)" in str(err.value) and "and 4 more" in str(err.value)


def test_missing_file_and_prompts_too_long(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_records(str(tmp_path / "nope.jsonl"))
    path = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "red " * 200, "output": "x"}])
    with pytest.raises(DataError, match=r"no usable examples.*raise training\.sequence_length"):
        prepare_data(
            read_records(str(path)),
            fmt="alpaca",
            tokenizer=tokenizer,
            sequence_length=32,
            packing=False,
            validation_split=0.0,
            seed=0,
        )


# ------------------------------------------------------------------ packing and order


def test_packing_rows_are_full_and_positions_restart(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", make_records("alpaca", 60))
    data = prepare_data(
        read_records(str(path)),
        fmt="alpaca",
        tokenizer=tokenizer,
        sequence_length=128,
        packing=True,
        validation_split=0.0,
        seed=0,
    )
    rows = data.train
    assert rows.position_ids is not None
    assert all(len(r) == 128 for r in rows.input_ids)
    assert len(rows) < 60  # several examples per row
    # Every example keeps all its trained tokens except the first one (never a target).
    kept = sum(sum(1 for x in labels if x != IGNORE_INDEX) for labels in rows.labels)
    unpacked = prepare_data(
        read_records(str(path)),
        fmt="alpaca",
        tokenizer=tokenizer,
        sequence_length=128,
        packing=False,
        validation_split=0.0,
        seed=0,
    )
    assert kept == sum(
        sum(1 for x in labels[1:] if x != IGNORE_INDEX) for labels in unpacked.train.labels
    )
    starts = [sum(1 for p in pos if p == 0) for pos in rows.position_ids]
    assert max(starts) >= 3


def test_text_documents_longer_than_a_row_are_split(tokenizer: Any) -> None:
    data = prepare_data(
        [Record("x:1", {"text": "red blue " * 100})],
        fmt="text",
        tokenizer=tokenizer,
        sequence_length=32,
        packing=True,
        validation_split=0.0,
        seed=0,
    )
    assert len(data.train) > 3 and data.stats.truncated == 0


def test_packed_loss_equals_separate_losses(tiny_llama: Path, tokenizer: Any) -> None:
    """Packed examples must not attend to each other: same logits as run one by one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    exs = [
        record_to_example(Record("x", r), "alpaca", tokenizer) for r in make_records("alpaca", 3)
    ]
    rows = pack(exs, 256, tokenizer.pad_token_id)
    assert len(rows) == 1 and rows.position_ids is not None
    with torch.no_grad():
        packed = model(
            input_ids=torch.tensor(rows.input_ids),
            position_ids=torch.tensor(rows.position_ids),
            use_cache=False,  # with a cache, transformers ignores packing (as the recipe knows)
        ).logits[0]
        offset = 0
        for ex in exs:
            alone = model(input_ids=torch.tensor([ex.input_ids])).logits[0]
            torch.testing.assert_close(
                packed[offset : offset + len(ex.input_ids)], alone, atol=1e-5, rtol=1e-4
            )
            offset += len(ex.input_ids)


def test_batch_order_is_resumable_and_ranks_are_disjoint(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", make_records("alpaca", 80))
    rows = prepare_data(
        read_records(str(path)),
        fmt="alpaca",
        tokenizer=tokenizer,
        sequence_length=64,
        packing=False,
        validation_split=0.0,
        seed=0,
    ).train

    def loader(rank: int) -> StepBatches:
        return StepBatches(
            rows, micro_batch=2, grad_accum=2, world_size=2, rank=rank, seed=3, pad_id=0
        )

    first = loader(0)
    seen: list[list[list[int]]] = []
    for _ in range(30):  # several epochs
        seen.append([b.input_ids.tolist() for b in first.next_step()])
        first.advance()
    again = loader(0)
    again.position = DataPosition(**first_position_after(loader(0), 17))
    for i in range(17, 30):
        assert [b.input_ids.tolist() for b in again.next_step()] == seen[i]
        again.advance()
    a, b = loader(0), loader(1)
    ids_a = {tuple(r) for m in a.next_step() for r in m.input_ids.tolist()}
    ids_b = {tuple(r) for m in b.next_step() for r in m.input_ids.tolist()}
    assert not ids_a & ids_b


def first_position_after(loader: StepBatches, steps: int) -> dict[str, int]:
    for _ in range(steps):
        loader.next_step()
        loader.advance()
    return loader.position.as_dict()


def test_eval_batches_are_even_across_ranks(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", make_records("alpaca", 7))
    rows = prepare_data(
        read_records(str(path)),
        fmt="alpaca",
        tokenizer=tokenizer,
        sequence_length=64,
        packing=False,
        validation_split=0.0,
        seed=0,
    ).train
    r0 = list(eval_batches(rows, micro_batch=2, world_size=2, rank=0, pad_id=0))
    r1 = list(eval_batches(rows, micro_batch=2, world_size=2, rank=1, pad_id=0))
    assert len(r0) == len(r1) == 2
    assert sum(b.input_ids.size(0) for b in r0 + r1 if b is not None) == 7


def test_hub_kind_goes_through_datasets(tmp_path: Path) -> None:
    """`kind: hub` uses `datasets.load_dataset`; a local folder exercises it offline."""
    pytest.importorskip("datasets", reason="hub datasets need the `datasets` package")
    write_jsonl(tmp_path / "ds" / "train.jsonl", make_records("alpaca", 6))
    records = read_records(str(tmp_path / "ds"), kind="hub")
    assert len(records) == 6
    assert records[0].where == f"hub:{tmp_path / 'ds'} row 1"
    assert set(records[0].value) >= {"instruction", "output"}
