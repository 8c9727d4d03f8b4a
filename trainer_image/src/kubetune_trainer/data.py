"""Dataset reading, formatting, tokenization, packing and the resumable batch order.

Everything happens up front, before the model is loaded: a bad record fails the run in
seconds with the file, the line and what is wrong, not an hour into training.

Records become `Example`s (token ids plus labels with the prompt masked to -100), then rows:
with packing, examples are laid end to end into rows of exactly `sequence_length` tokens whose
`position_ids` restart at every example, which transformers turns into a block-diagonal
attention mask (or `kubetune_trainer.attention` into document bounds for a variable-length
kernel), so packed examples never attend to each other. Without packing, each example
is a row and a micro-batch is padded to its longest row.

The batch order is a pure function of (seed, epoch, rows consumed in the epoch), so the
checkpoint stores two integers and a resumed run sees exactly the rows it would have seen.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import numpy as np
import torch

from kubetune_trainer.attention import DocumentBounds, document_bounds
from kubetune_trainer.contract import DATA_SUFFIXES
from kubetune_trainer.errors import ConfigError, DataError, TrainerExit
from kubetune_trainer.hub import hub_call

HUB_TOKEN_ENV = "HF_TOKEN"
"""The hub client reads its token from here; a hub dataset is read with it."""

IGNORE_INDEX = -100
MAX_ERRORS_SHOWN = 5

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
# Used when a tokenizer ships no chat template (base models): ChatML, as Qwen and many others.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from, so errors can point at it."""

    where: str  # "train.jsonl:17" or "data.parquet row 3"
    value: Any


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def trainable_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


class Ragged(Sequence["np.ndarray[Any, Any]"]):
    """Rows of different lengths as one flat array and the offsets where each row starts.

    This is how the tokenized-data cache (`kubetune_trainer.datacache`) keeps rows: a few
    arrays that every rank memory-maps, so a node holds the dataset once in its page cache
    instead of once per rank as lists of Python ints. A row is a view into the flat array.
    """

    def __init__(self, flat: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any]) -> None:
        self.flat = flat
        self.offsets = offsets

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], dtype: Any = np.int32) -> Ragged:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        parts = [np.asarray(r, dtype=dtype) for r in rows]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray[Any, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[np.ndarray[Any, Any]]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.flat[int(self.offsets[i]) : int(self.offsets[i + 1])]


@dataclass
class Rows:
    """Training rows: packed (fixed length, with position ids) or one example per row.

    The fields are lists when `prepare_data` builds them and `Ragged` arrays (lengths an
    int64 array) when they come from the tokenized-data cache; consumers index rows and
    never rely on which."""

    input_ids: Sequence[Any]  # list[list[int]] | Ragged
    labels: Sequence[Any]
    lengths: Sequence[int] | np.ndarray[Any, Any]  # tokens before padding
    position_ids: Sequence[Any] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DataStats:
    records: int = 0
    examples: int = 0
    train_examples: int = 0  # examples left for training once validation is split off
    truncated: int = 0
    dropped_no_target: int = 0
    train_rows: int = 0
    validation_rows: int = 0
    train_tokens: int = 0
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading


def _hidden(path: Path, source: Path) -> bool:
    """A dot-file or dot-folder inside the dataset folder (`.git/`, a cache's bookkeeping such
    as the stage-in's `.kubetune-entry.json`): never data."""
    return any(part.startswith(".") for part in path.relative_to(source).parts)


def _files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(
            p
            for p in source.rglob("*")
            if p.is_file() and p.suffix in DATA_SUFFIXES and not _hidden(p, source)
        )
        if not files:
            raise DataError(
                f"{source}: no data files (looked for {', '.join(DATA_SUFFIXES)}); to fix: point "
                "dataset.source at a file or a folder holding them"
            )
        return files
    if not source.exists():
        raise DataError(f"{source}: no such file or directory")
    if source.suffix not in DATA_SUFFIXES:
        raise DataError(f"{source}: unknown file type {source.suffix!r}; expected {DATA_SUFFIXES}")
    return [source]


def _decode(path: Path, raw: bytes, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8-sig" if line in (None, 1) else "utf-8")
    except UnicodeDecodeError as e:
        if line is None:
            line = raw.count(b"\n", 0, e.start) + 1
        where = f"{path}:{line}"
        raise DataError(
            f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); to fix: re-encode the "
            "file as UTF-8"
        ) from None


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            text = _decode(path, raw, lineno).strip()
            if not text:
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                msg = f"{path}:{lineno}: not valid JSON: {e.msg} (column {e.colno})"
                raise DataError(msg) from None
            yield Record(f"{path}:{lineno}", value)


def _read_json(path: Path) -> Iterator[Record]:
    text = _decode(path, path.read_bytes())
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})"
        raise DataError(msg) from None
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"data": [...]} / {"train": [...]}
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(value).__name__}")
    for i, item in enumerate(value, start=1):
        yield Record(f"{path} record {i}", item)


def _read_parquet(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow ships with the trainer extra
        raise ConfigError(f"{path}: reading Parquet needs pyarrow ({e})") from e
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e
    for i, row in enumerate(table.to_pylist(), start=1):
        yield Record(f"{path} row {i}", row)


def _read_text(path: Path) -> Iterator[Record]:
    """A .txt file: documents separated by blank lines."""
    text = _decode(path, path.read_bytes())
    start = 1
    buf: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not buf:
                start = lineno
            buf.append(line)
        elif buf:
            yield Record(f"{path}:{start}", {"text": "\n".join(buf)})
            buf = []
    if buf:
        yield Record(f"{path}:{start}", {"text": "\n".join(buf)})


def _read_hub(source: str, revision: str | None = None) -> Iterator[Record]:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"dataset {source!r} is a hub id, which needs the `datasets` package; to fix: "
            "install it in the trainer image, or put the data on a volume as JSONL/Parquet"
        ) from e
    try:
        ds = hub_call(
            lambda: datasets.load_dataset(source, split="train", revision=revision),
            what="dataset",
            uri=source,
            field="dataset.uri",
            revision=revision,
            token_env=os.environ.get(HUB_TOKEN_ENV) and HUB_TOKEN_ENV,
        )
    except TrainerExit:
        raise  # refused, missing (config error) or unreachable (restart)
    except Exception as e:
        raise DataError(f"hub dataset {source!r}: {e}") from e
    for i, row in enumerate(ds, start=1):
        yield Record(f"hub:{source} row {i}", row)


def read_records(source: str, kind: str = "path", revision: str | None = None) -> list[Record]:
    """All records of a dataset, in file order (a hub dataset at `revision`); raises
    DataError on unreadable input."""
    if kind == "hub":
        rows = list(_read_hub(source, revision))
        if not rows:
            raise DataError(f"hub dataset {source!r}: empty")
        return rows
    if kind == "s3":
        raise ConfigError(
            f"dataset {source}: s3 sources are not read by the trainer; to fix: copy the data "
            "to a volume (pvc://) and point dataset.uri there"
        )
    records: list[Record] = []
    for path in _files(Path(source)):
        readers = {
            ".jsonl": _read_jsonl,
            ".json": _read_json,
            ".parquet": _read_parquet,
            ".txt": _read_text,
        }
        before = len(records)
        records.extend(readers[path.suffix](path))
        if len(records) == before:
            raise DataError(f"{path}: empty (no records); to fix: remove it or fill it")
    return records


# --------------------------------------------------------------------------- formats


def _str_field(record: Record, name: str, *, required: bool, fmt: str) -> str:
    obj = record.value
    value = obj.get(name) if isinstance(obj, dict) else None
    if value is None:
        if required:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(
                f"{record.where}: {fmt} record needs a string field {name!r} (found {keys})"
            )
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{record.where}: {fmt} field {name!r} must be a string, got {type(value).__name__}"
        )
    if required and not value.strip():
        raise DataError(f"{record.where}: {fmt} field {name!r} is empty")
    return value


def _messages(record: Record, fmt: str) -> list[dict[str, str]]:
    obj = record.value
    if not isinstance(obj, dict):
        raise DataError(f"{record.where}: {fmt} record must be an object")
    if fmt == "sharegpt":
        turns = obj.get("conversations")
        key, role_key, content_key = "conversations", "from", "value"
        if turns is None and "messages" in obj:  # many "sharegpt" files use chat keys
            turns, key, role_key, content_key = obj["messages"], "messages", "role", "content"
    else:
        turns = obj.get("messages")
        key, role_key, content_key = "messages", "role", "content"
        if turns is None and "conversations" in obj:
            turns, key, role_key, content_key = (
                obj["conversations"],
                "conversations",
                "from",
                "value",
            )
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f"{record.where}: {fmt} record needs a non-empty list {key!r} (found {sorted(obj)})"
        )
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{record.where}: {key}[{i}] must be an object")
        role = turn.get(role_key)
        content = turn.get(content_key)
        mapped = SHAREGPT_ROLES.get(str(role)) if role_key == "from" else role
        if mapped not in CHAT_ROLES:
            raise DataError(f"{record.where}: {key}[{i}].{role_key} {role!r} is not a known role")
        if not isinstance(content, str):
            raise DataError(f"{record.where}: {key}[{i}].{content_key} must be a string")
        out.append({"role": str(mapped), "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{record.where}: conversation has no assistant turn to learn from")
    return out


def _chat_segments(
    tokenizer: Any, messages: list[dict[str, str]], where: str
) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, trainable) pieces; assistant turns train."""

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

    full = render(messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        end = len(render(messages[: i + 1], False))
        prefix = render(messages[: i + 1], False)
        if not full.startswith(prefix) or start < pos or end < start:
            raise DataError(
                f"{where}: the tokenizer's chat template does not render conversations "
                "incrementally, so assistant turns cannot be located for loss masking"
            )
        segments.append((full[pos:start], False))
        segments.append((full[start:end], True))
        pos = end
    segments.append((full[pos:], False))
    return [(t, trainable) for t, trainable in segments if t]


def _tokenize_pair(tokenizer: Any, prompt: str, response: str) -> Example:
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        r = [*r, tokenizer.eos_token_id]
    return Example(input_ids=[*p, *r], labels=[IGNORE_INDEX] * len(p) + list(r))


def record_to_example(record: Record, fmt: str, tokenizer: Any) -> Example:
    if fmt == "alpaca":
        instruction = _str_field(record, "instruction", required=True, fmt=fmt)
        inp = _str_field(record, "input", required=False, fmt=fmt)
        output = _str_field(record, "output", required=True, fmt=fmt)
        template = ALPACA_PROMPT_WITH_INPUT if inp.strip() else ALPACA_PROMPT
        return _tokenize_pair(
            tokenizer, template.format(instruction=instruction, input=inp), output
        )
    if fmt == "instruction-response":
        obj = record.value if isinstance(record.value, dict) else {}
        ikey = "instruction" if "instruction" in obj or "prompt" not in obj else "prompt"
        rkey = "response" if "response" in obj or "completion" not in obj else "completion"
        instruction = _str_field(record, ikey, required=True, fmt=fmt)
        response = _str_field(record, rkey, required=True, fmt=fmt)
        system = _str_field(record, "system", required=False, fmt=fmt)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": response},
        ]
        return _chat_example(tokenizer, messages, record.where)
    if fmt in ("sharegpt", "chat"):
        return _chat_example(tokenizer, _messages(record, fmt), record.where)
    if fmt == "text":
        text = _str_field(record, "text", required=True, fmt=fmt)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
        return Example(input_ids=list(ids), labels=list(ids))
    raise ConfigError(f"unknown dataset format {fmt!r}")


def _chat_example(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    for text, trainable in _chat_segments(tokenizer, messages, where):
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(seg)
        labels.extend(seg if trainable else [IGNORE_INDEX] * len(seg))
    return Example(input_ids=ids, labels=labels)


def renders_chat(fmt: str) -> bool:
    """Whether records of `fmt` go through the tokenizer's chat template."""
    return fmt in ("sharegpt", "chat", "instruction-response")


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give template-less tokenizers ChatML; returns True when it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return True


# --------------------------------------------------------------------------- rows


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


@dataclass
class PreparedData:
    train: Rows | PairRows
    validation: Rows | PairRows | None
    stats: DataStats


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


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    tokens: int  # non-padding input tokens
    ref_logps: torch.Tensor | None = None
    """DPO: the reference model's log-probabilities of the rows (fp32), when precomputed."""
    documents: DocumentBounds | None = None
    """Packed rows: where each example starts (`kubetune_trainer.attention`)."""

    def to(self, device: torch.device) -> Batch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            attention_mask=mv(self.attention_mask),
            position_ids=mv(self.position_ids),
            tokens=self.tokens,
            ref_logps=mv(self.ref_logps),
            documents=None if self.documents is None else self.documents.to(device),
        )


def _row(values: Sequence[int] | np.ndarray[Any, Any]) -> torch.Tensor:
    """One row as int64 (a copy: a memory-mapped cache row is read-only and int32)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def _stack(rows: Sequence[Any]) -> torch.Tensor:
    return torch.from_numpy(np.array([np.asarray(r, dtype=np.int64) for r in rows]))


def collate(rows: Rows | PairRows, indices: Sequence[int], pad_id: int) -> Batch:
    if isinstance(rows, PairRows):
        return collate_pairs(rows, indices, pad_id)
    if rows.position_ids is not None:
        ids = _stack([rows.input_ids[i] for i in indices])
        labels = _stack([rows.labels[i] for i in indices])
        pos = _stack([rows.position_ids[i] for i in indices])
        real = int(sum(int(rows.lengths[i]) for i in indices))
        return Batch(ids, labels, None, pos, tokens=real, documents=document_bounds(pos.numpy()))
    width = max(len(rows.input_ids[i]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(indices), width), dtype=torch.long)
    for b, i in enumerate(indices):
        n = len(rows.input_ids[i])
        ids[b, :n] = _row(rows.input_ids[i])
        labels[b, :n] = _row(rows.labels[i])
        mask[b, :n] = 1
    return Batch(ids, labels, mask, None, tokens=int(mask.sum()))


@dataclass
class DataPosition:
    """Where the run is in the data: all a checkpoint needs to resume the exact order."""

    epoch: int = 0
    rows_consumed: int = 0  # rows of this epoch already trained on, over all ranks

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "rows_consumed": self.rows_consumed}


class StepBatches:
    """Deterministic global order: rows are shuffled per epoch by (seed, epoch).

    A step takes `micro_batch * grad_accum * world` consecutive rows of the epoch's
    permutation; rank r, micro-batch j gets the j-th slice of r. Datasets smaller than one
    global batch wrap around, so tiny runs still work.
    """

    def __init__(
        self,
        rows: Rows | PairRows,
        *,
        micro_batch: int,
        grad_accum: int,
        world_size: int,
        rank: int,
        seed: int,
        pad_id: int,
    ) -> None:
        self.rows = rows
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.pad_id = pad_id
        self.position = DataPosition()
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.rows) // self.global_batch)

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.rows), generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step (position not advanced)."""
        if self.position.rows_consumed >= self.steps_per_epoch * self.global_batch:
            self.position = DataPosition(epoch=self.position.epoch + 1, rows_consumed=0)
        perm = self._permutation(self.position.epoch)
        base = self.position.rows_consumed
        out = []
        for j in range(self.grad_accum):
            start = base + (j * self.world_size + self.rank) * self.micro_batch
            idx = [perm[(start + k) % len(perm)] for k in range(self.micro_batch)]
            out.append(collate(self.rows, idx, self.pad_id))
        return out

    def advance(self) -> None:
        self.position.rows_consumed += self.global_batch

    @property
    def epoch_progress(self) -> float:
        """Fractional epochs done (what `epoch` metrics report)."""
        return self.position.epoch + self.position.rows_consumed / (
            self.steps_per_epoch * self.global_batch
        )


def eval_batches(
    rows: Rows | PairRows, *, micro_batch: int, world_size: int, rank: int, pad_id: int
) -> Iterator[Batch | None]:
    """This rank's validation micro-batches; every rank yields the same count (None = idle)."""
    per_round = micro_batch * world_size
    rounds = math.ceil(len(rows) / per_round)
    for r in range(rounds):
        start = r * per_round + rank * micro_batch
        idx = [i for i in range(start, start + micro_batch) if i < len(rows)]
        yield collate(rows, idx, pad_id) if idx else None


# --------------------------------------------------------------------------- preference pairs
#
# DPO (`training.objective: dpo`) reads preference records instead of the SFT formats: the
# record's shape decides, as TRL reads them, and `dataset.format` is not consulted.
#
# * standard: `prompt`, `chosen`, `rejected` strings. The prompt is tokenized with the
#   tokenizer's special tokens (BOS), each response after it with EOS appended.
# * chat: `chosen` and `rejected` message lists sharing a prefix (the conversation so far),
#   or a `prompt` message list with `chosen`/`rejected` holding the answer turns. The prompt
#   is the shared prefix rendered with the chat template and its generation prompt; a response
#   is what the template renders after it for that side (end-of-turn token included).
#
# Pairs are never packed: the loss compares a chosen row with its rejected row, both after the
# same prompt, so the two must stay side by side, and a row's log-probability is summed over
# one response only. A micro-batch of B pairs is 2B padded rows: chosen 0..B-1, then rejected.


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass
class PairRows:
    """Preference pairs as rows: `chosen[i]` and `rejected[i]` share their prompt."""

    chosen: Rows
    rejected: Rows
    ref_chosen: list[float] | None = None
    ref_rejected: list[float] | None = None
    """Reference log-probabilities, when precomputed (full fine-tuning: docs/dpo.md)."""

    def __len__(self) -> int:
        return len(self.chosen)


PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def _conversation(record: Record, key: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{record.where}: preference field {key!r} must be a non-empty list")
    out = []
    for i, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise DataError(
                f"{record.where}: {key}[{i}] must be {{role, content}} with role in "
                f"{sorted(CHAT_ROLES)} and string content"
            )
        out.append({"role": str(role), "content": content})
    return out


def record_to_pair(record: Record, tokenizer: Any) -> Pair:
    """One preference record as token ids (see the section comment for the two shapes)."""
    obj = record.value
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(
            f"{record.where}: preference record needs 'chosen' and 'rejected' (and 'prompt' "
            f"unless they are conversations sharing a prefix) (found {found})"
        )
    if isinstance(obj["chosen"], str) or isinstance(obj["rejected"], str):
        prompt = _str_field(record, "prompt", required=True, fmt="preference")
        chosen = _str_field(record, "chosen", required=True, fmt="preference")
        rejected = _str_field(record, "rejected", required=True, fmt="preference")
        p = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        c = [*tokenizer(chosen, add_special_tokens=False)["input_ids"], *eos]
        r = [*tokenizer(rejected, add_special_tokens=False)["input_ids"], *eos]
        return Pair(p, c, r)
    chosen_msgs = _conversation(record, "chosen", obj["chosen"])
    rejected_msgs = _conversation(record, "rejected", obj["rejected"])
    if "prompt" in obj:
        prefix = _conversation(record, "prompt", obj["prompt"])
        chosen_msgs, rejected_msgs = prefix + chosen_msgs, prefix + rejected_msgs
    else:
        n = 0
        while n < min(len(chosen_msgs), len(rejected_msgs)) and chosen_msgs[n] == rejected_msgs[n]:
            n += 1
        prefix = chosen_msgs[:n]
    if not prefix or len(chosen_msgs) == len(prefix) or len(rejected_msgs) == len(prefix):
        raise DataError(
            f"{record.where}: chosen and rejected must share a non-empty prompt and each add "
            "at least one turn after it"
        )

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

    prompt_text = render(prefix, True)
    pieces = []
    for side, msgs in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
        text = render(msgs, False)
        if not text.startswith(prompt_text):
            raise DataError(
                f"{record.where}: the chat template does not render the {side} conversation "
                "as its prompt followed by the response, so the response cannot be located"
            )
        pieces.append(text[len(prompt_text) :])
    p = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    c = list(tokenizer(pieces[0], add_special_tokens=False)["input_ids"])
    r = list(tokenizer(pieces[1], add_special_tokens=False)["input_ids"])
    return Pair(p, c, r)


def truncate_pair(pair: Pair, seq_len: int) -> tuple[Pair, bool]:
    """Fit prompt + longer response into `seq_len`: the prompt keeps its last
    max(seq_len - longest response, seq_len // 2) tokens (a long prompt never squeezes the
    responses below half the row), then each response keeps its first tokens up to the room
    left. Returns the pair and whether anything was cut."""
    longest = max(len(pair.chosen), len(pair.rejected))
    if len(pair.prompt) + longest <= seq_len:
        return pair, False
    keep_prompt = min(len(pair.prompt), max(seq_len - longest, seq_len // 2))
    prompt = pair.prompt[len(pair.prompt) - keep_prompt :]
    room = seq_len - len(prompt)
    return Pair(prompt, pair.chosen[:room], pair.rejected[:room]), True


def _side_rows(pairs: Sequence[Pair], side: str) -> Rows:
    ids, labels = [], []
    for pair in pairs:
        response: list[int] = getattr(pair, side)
        ids.append([*pair.prompt, *response])
        labels.append([IGNORE_INDEX] * len(pair.prompt) + response)
    return Rows(input_ids=ids, labels=labels, lengths=[len(x) for x in ids])


def pair_rows(pairs: Sequence[Pair]) -> PairRows:
    return PairRows(chosen=_side_rows(pairs, "chosen"), rejected=_side_rows(pairs, "rejected"))


def prepare_preference_data(
    records: Sequence[Record],
    *,
    tokenizer: Any,
    sequence_length: int,
    validation_split: float,
    seed: int,
) -> PreparedData:
    """`prepare_data` for DPO: validate and tokenize every pair, truncate, split, no packing."""
    if not 0.0 <= validation_split < 1.0:
        raise ConfigError(f"dataset.validation_split {validation_split} must be in [0, 1)")
    if sequence_length < 4:
        raise ConfigError(f"training.sequence_length {sequence_length} must be at least 4")
    stats = DataStats(records=len(records))
    if ensure_chat_template(tokenizer):
        stats.notes.append("tokenizer has no chat template; using ChatML for chat pairs")
    pairs: list[Pair] = []
    bad = _BadRecords()
    for record in records:
        try:
            pair = record_to_pair(record, tokenizer)
        except DataError as e:
            bad.add(e)
            continue
        pair, cut = truncate_pair(pair, sequence_length)
        stats.truncated += int(cut)
        if not pair.chosen or not pair.rejected or pair.chosen == pair.rejected:
            stats.dropped_no_target += 1  # nothing to prefer: the loss would be constant
            continue
        pairs.append(pair)
    bad.raise_if_any("the preference dataset")
    if not pairs:
        raise DataError(
            f"no usable preference pairs: {len(records)} record(s), {stats.dropped_no_target} "
            "with identical or empty responses within sequence_length"
        )
    stats.examples = len(pairs)
    train, val = _split(pairs, validation_split, seed, "pairs")
    stats.train_examples = len(train)
    stats.train_rows = len(train)
    stats.validation_rows = len(val)
    stats.train_tokens = sum(len(p.prompt) * 2 + len(p.chosen) + len(p.rejected) for p in train)
    return PreparedData(
        train=pair_rows(train), validation=pair_rows(val) if val else None, stats=stats
    )


def collate_pairs(rows: PairRows, indices: Sequence[int], pad_id: int) -> Batch:
    """B pairs as 2B right-padded rows, chosen first; reference log-probs if precomputed."""
    sides = (rows.chosen, rows.rejected)
    both = Rows(
        input_ids=[side.input_ids[i] for side in sides for i in indices],
        labels=[side.labels[i] for side in sides for i in indices],
        lengths=[side.lengths[i] for side in sides for i in indices],
    )
    batch = collate(both, range(2 * len(indices)), pad_id)
    if rows.ref_chosen is not None and rows.ref_rejected is not None:
        ref = [rows.ref_chosen[i] for i in indices] + [rows.ref_rejected[i] for i in indices]
        batch.ref_logps = torch.tensor(ref, dtype=torch.float32)
    return batch
