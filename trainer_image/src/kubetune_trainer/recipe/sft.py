"""Supervised fine-tuning: next-token cross-entropy on the responses (`objective: sft`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kubetune_trainer.data import (
    IGNORE_INDEX,
    Batch,
    PreparedData,
    Record,
    eval_batches,
    prepare_data,
)
from kubetune_trainer.distributed import all_reduce_sum
from kubetune_trainer.loss import loss_sum
from kubetune_trainer.recipe.loop import FineTuneRecipe

log = logging.getLogger(__name__)


class SftRecipe(FineTuneRecipe):
    def _prepare(self, records: list[Record]) -> PreparedData:
        cfg = self.cfg
        return prepare_data(
            records,
            fmt=cfg.dataset.format,
            tokenizer=self.tokenizer,
            sequence_length=cfg.training.sequence_length,
            packing=cfg.training.packing,
            validation_split=cfg.dataset.validation_split,
            seed=cfg.training.seed,
        )

    def _forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy over the batch's trained tokens (`kubetune_trainer.loss`)."""
        b = batch.to(self.env.device)
        return loss_sum(
            self.model,
            input_ids=b.input_ids,
            labels=b.labels,
            attention_mask=b.attention_mask,
            position_ids=b.position_ids,
            autocast_dtype=self.built.autocast_dtype,
            chunked=self.built.chunked_loss,
            offload=self.built.offload if self.model.training else None,
            documents=b.documents if self.built.varlen_attention else None,
        )

    def _train_step(self, rng_at_start: dict[str, Any]) -> tuple[float, float, float]:
        env = self.env
        micro = self.batches.next_step()
        local_targets = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in micro)
        (targets,) = all_reduce_sum([float(local_targets)], env)
        scale = env.world_size / max(targets, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for j, batch in enumerate(micro):
            if j > 0:
                self._check_flags(at_step_start=False, rng=rng_at_start)
            last = j == len(micro) - 1
            with self._grad_sync(last):
                loss = self._forward_loss(batch)
                scaled: Any = loss * scale
                scaled.backward()
            loss_sum += loss.detach()  # no host sync per micro-batch
        self._optimizer_step()
        tokens = sum(b.tokens for b in micro)
        rows = sum(int(b.input_ids.size(0)) for b in micro)
        total_loss, total_tokens, total_rows = all_reduce_sum(
            [float(loss_sum), float(tokens), float(rows)], env
        )
        return total_loss / max(targets, 1.0), total_tokens, total_rows

    def _evaluate(self, rows: Any) -> float:
        self.model.eval()
        with torch.no_grad():
            loss_sum, targets = self._eval_sums(rows)
        self.model.train()
        total, n = all_reduce_sum([loss_sum, targets], self.env)
        self.last_eval_loss = total / max(n, 1.0)
        self.eval_values = {"eval_loss": self.last_eval_loss}
        self.metrics.set(eval_loss=self.last_eval_loss)
        self.metrics.event("eval")
        log.info("step %d eval_loss %.4f", self.step, self.last_eval_loss)
        return self.last_eval_loss

    def _eval_sums(self, rows: Any) -> tuple[float, float]:
        loss_sum, targets = 0.0, 0.0
        dummy = Batch(
            input_ids=torch.full((1, 2), self.pad_id, dtype=torch.long),
            labels=torch.full((1, 2), IGNORE_INDEX, dtype=torch.long),
            attention_mask=None,
            position_ids=None,
            tokens=0,
        )
        for batch in eval_batches(
            rows,
            micro_batch=self.cfg.training.micro_batch_size,
            world_size=self.env.world_size,
            rank=self.env.rank,
            pad_id=self.pad_id,
        ):
            # An idle rank still runs a forward: FSDP's all-gathers need every rank.
            b = batch if batch is not None else dummy
            loss_sum += float(self._forward_loss(b))
            targets += float((b.labels[:, 1:] != IGNORE_INDEX).sum())
        return loss_sum, targets
