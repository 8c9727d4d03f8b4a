"""An SFT dataset made ready to train: every record validated and tokenized, examples cut to
the sequence length, a seeded validation split held out, the rest packed into rows (or one
example per row). The bad-record report and the split serve the preference pairs too."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, TypeVar

from kubetune_trainer.data.formats import ensure_chat_template, record_to_example, renders_chat
from kubetune_trainer.data.records import Record
from kubetune_trainer.data.rows import IGNORE_INDEX, DataStats, Example, PreparedData, Rows
from kubetune_trainer.errors import ConfigError, DataError

MAX_ERRORS_SHOWN = 5


def _fit(example: Example, seq_len: int, fmt: str, stats: DataStats) -> list[Example]:
    """Cut an example to the sequence length: plain text is split, instructions truncated."""
    if len(example.input_ids) <= seq_len:
        return [example]
    if fmt == "text":
        # Chunks overlap by one token so every token but the first is predicted once.
        out = []
        for start in range(0, len(example.input_ids) - 1, seq_len - 1):
            ids = example.input_ids[start : start + seq_len]
            if len(ids) > 1:
                out.append(Example(ids, example.labels[start : start + seq_len]))
        return out
    stats.truncated += 1
    return [Example(example.input_ids[:seq_len], example.labels[:seq_len])]


def pack(examples: Sequence[Example], seq_len: int, pad_id: int) -> Rows:
    """Greedy first-fit in order: each row is exactly seq_len tokens; examples never split."""
    out_ids: list[list[int]] = []
    out_labels: list[list[int]] = []
    out_lengths: list[int] = []
    out_pos: list[list[int]] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []

    def flush() -> None:
        if not ids:
            return
        pad = seq_len - len(ids)
        out_ids.append(ids + [pad_id] * pad)
        out_labels.append(labels + [IGNORE_INDEX] * pad)
        out_lengths.append(len(ids))
        # The padding is its own "document" (positions restart), so it attends only to itself.
        out_pos.append(pos + list(range(pad)))

    for ex in examples:
        if len(ids) + len(ex.input_ids) > seq_len:
            flush()
            ids, labels, pos = [], [], []
        ids.extend(ex.input_ids)
        # The first token of an example is never a target (as without packing, where the
        # shift drops it), so no example learns to predict its neighbour's first token.
        labels.extend([IGNORE_INDEX, *ex.labels[1:]])
        pos.extend(range(len(ex.input_ids)))
    flush()
    return Rows(input_ids=out_ids, labels=out_labels, lengths=out_lengths, position_ids=out_pos)


def _rows(examples: Sequence[Example], packing: bool, seq_len: int, pad_id: int) -> Rows:
    if packing:
        return pack(examples, seq_len, pad_id)
    return Rows(
        input_ids=[e.input_ids for e in examples],
        labels=[e.labels for e in examples],
        lengths=[len(e.input_ids) for e in examples],
    )


class _BadRecords:
    """Records that did not parse: how many, and the first MAX_ERRORS_SHOWN messages."""

    def __init__(self) -> None:
        self.count = 0
        self.shown: list[str] = []

    def add(self, error: DataError) -> None:
        self.count += 1
        if len(self.shown) < MAX_ERRORS_SHOWN:
            self.shown.append(str(error))

    def raise_if_any(self, dataset: str) -> None:
        if not self.count:
            return
        hidden = self.count - len(self.shown)
        more = f"\n  ... and {hidden} more" if hidden else ""
        raise DataError(
            f"{self.count} bad record(s) in {dataset}:\n  " + "\n  ".join(self.shown) + more
        )


_Item = TypeVar("_Item")


def _split(
    items: Sequence[_Item], validation_split: float, seed: int, noun: str
) -> tuple[list[_Item], list[_Item]]:
    """(train, validation): a seeded shuffle, the first `validation_split` of it held out."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = math.ceil(len(items) * validation_split) if validation_split > 0 else 0
    if n_val >= len(items):
        raise DataError(
            f"validation_split {validation_split} leaves no training {noun} out of {len(items)}"
        )
    return [items[i] for i in order[n_val:]], [items[i] for i in order[:n_val]]


def prepare_data(
    records: Sequence[Record],
    *,
    fmt: str,
    tokenizer: Any,
    sequence_length: int,
    packing: bool,
    validation_split: float,
    seed: int,
) -> PreparedData:
    """Validate every record, tokenize, mask, split off validation, and pack."""
    if not 0.0 <= validation_split < 1.0:
        raise ConfigError(f"dataset.validation_split {validation_split} must be in [0, 1)")
    if sequence_length < 2:
        raise ConfigError(f"training.sequence_length {sequence_length} must be at least 2")
    stats = DataStats(records=len(records))
    if renders_chat(fmt) and ensure_chat_template(tokenizer):
        stats.notes.append("tokenizer has no chat template; using ChatML")
    examples: list[Example] = []
    bad = _BadRecords()
    for record in records:
        try:
            example = record_to_example(record, fmt, tokenizer)
        except DataError as e:
            bad.add(e)
            continue
        for piece in _fit(example, sequence_length, fmt, stats):
            if piece.trainable_tokens == 0:
                stats.dropped_no_target += 1
                continue
            examples.append(piece)
    bad.raise_if_any(f"the {fmt} dataset")
    if not examples:
        raise DataError(
            f"no usable examples: {len(records)} record(s), {stats.dropped_no_target} left with "
            f"no response tokens within sequence_length {sequence_length}; to fix: raise "
            "training.sequence_length or shorten the prompts"
        )
    stats.examples = len(examples)
    train, val = _split(examples, validation_split, seed, "examples")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    train_rows = _rows(train, packing, sequence_length, pad_id)
    val_rows = _rows(val, packing, sequence_length, pad_id) if val else None
    stats.train_examples = len(train)
    stats.train_rows = len(train_rows)
    stats.validation_rows = len(val_rows) if val_rows else 0
    stats.train_tokens = sum(len(e.input_ids) for e in train)
    return PreparedData(train=train_rows, validation=val_rows, stats=stats)
