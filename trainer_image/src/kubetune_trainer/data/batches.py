"""Rows into batches: collation (packed rows with their document bounds, padded rows with a
mask, preference pairs as chosen then rejected rows), the resumable global order of training
batches, and the validation batches."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kubetune_trainer.attention import DocumentBounds, document_bounds
from kubetune_trainer.data.rows import IGNORE_INDEX, PairRows, Rows


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
