"""The shapes data takes on its way to a batch: examples, rows (lists or the cache's ragged
arrays), preference pairs and their rows, and what preparing a dataset returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

IGNORE_INDEX = -100


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


@dataclass
class PreparedData:
    train: Rows | PairRows
    validation: Rows | PairRows | None
    stats: DataStats


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
