"""Direct Preference Optimization on {prompt, chosen, rejected} pairs (`objective: dpo`,
docs/dpo.md): the policy's log-probabilities against a reference's, the loss of
`kubetune_trainer.dpo`, and evaluation by loss and reward accuracy."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kubetune_trainer.data import (
    IGNORE_INDEX,
    Batch,
    PairRows,
    PreparedData,
    Record,
    eval_batches,
    prepare_preference_data,
)
from kubetune_trainer.distributed import all_reduce_sum, barrier
from kubetune_trainer.dpo import (
    REFERENCE_FILE,
    DpoSums,
    DpoTerms,
    dpo_loss,
    read_reference,
    write_reference,
)
from kubetune_trainer.identity import identity
from kubetune_trainer.loss import sequence_logps
from kubetune_trainer.recipe.loop import FineTuneRecipe

log = logging.getLogger(__name__)


class DpoRecipe(FineTuneRecipe):
    def _prepare(self, records: list[Record]) -> PreparedData:
        # Pairs are never packed (docs/dpo.md): `packing` is the SFT rows' setting.
        cfg = self.cfg
        return prepare_preference_data(
            records,
            tokenizer=self.tokenizer,
            sequence_length=cfg.training.sequence_length,
            validation_split=cfg.dataset.validation_split,
            seed=cfg.training.seed,
        )

    def _before_resume(self) -> None:
        """Full fine-tuning's reference is the initial weights: taken before a checkpoint
        replaces them."""
        if not self.built.adapter_only:
            with self._in_phase("eval"):
                self._precompute_reference()

    def _train_step(self, rng_at_start: dict[str, Any]) -> tuple[float, float, float]:
        """One optimizer step of DPO: the loss is the mean over the step's pairs, over all
        micro-batches and ranks."""
        env = self.env
        micro = self.batches.next_step()
        local_pairs = sum(int(b.input_ids.size(0)) // 2 for b in micro)
        (pairs,) = all_reduce_sum([float(local_pairs)], env)
        scale = env.world_size / max(pairs, 1.0)
        sums = DpoSums()
        for j, batch in enumerate(micro):
            if j > 0:
                self._check_flags(at_step_start=False, rng=rng_at_start)
            last = j == len(micro) - 1
            with self._grad_sync(last):
                terms = self._dpo_terms(batch)
                scaled: Any = terms.losses.sum() * scale
                scaled.backward()
            sums.add(terms)
        self._optimizer_step()
        tokens = float(sum(b.tokens for b in micro))
        reduced = all_reduce_sum([*sums.as_list(), tokens], env)
        total = DpoSums.from_list(reduced[:-1])
        self._step_values = total.means()
        return total.loss / max(total.pairs, 1.0), reduced[-1], total.pairs

    def _evaluate(self, rows: PairRows) -> float:
        """The DPO loss and rewards on the validation pairs."""
        sums = DpoSums()
        self.model.eval()
        with torch.no_grad():
            for batch in eval_batches(
                rows,
                micro_batch=self.cfg.training.micro_batch_size,
                world_size=self.env.world_size,
                rank=self.env.rank,
                pad_id=self.pad_id,
            ):
                terms = self._dpo_terms(batch if batch is not None else self._dummy_pairs())
                if batch is not None:
                    sums.add(terms)
        self.model.train()
        total = DpoSums.from_list(all_reduce_sum(sums.as_list(), self.env))
        self.last_eval_loss = total.loss / max(total.pairs, 1.0)
        means = total.means("eval_")
        self.eval_values = {
            "eval_loss": self.last_eval_loss,
            "eval_reward_accuracy": means["eval_dpo_reward_accuracy"],
        }
        self.metrics.set(eval_loss=self.last_eval_loss, **means)
        self.metrics.event("eval")
        log.info(
            "step %d eval_loss %.4f reward accuracy %.3f margin %.4f",
            self.step,
            self.last_eval_loss,
            means["eval_dpo_reward_accuracy"],
            means["eval_dpo_reward_margin"],
        )
        return self.last_eval_loss

    def _policy_logps(self, batch: Batch) -> torch.Tensor:
        """Summed log-probabilities of each row's response under the model being trained."""
        b = batch.to(self.env.device)
        return sequence_logps(
            self.model,
            input_ids=b.input_ids,
            labels=b.labels,
            attention_mask=b.attention_mask,
            autocast_dtype=self.built.autocast_dtype,
            chunked=self.built.chunked_loss,
            offload=self.built.offload if self.model.training else None,
        )

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        """The reference model's: precomputed (full), or the model with its adapters
        switched off (LoRA, QLoRA), without gradients and in eval mode (deterministic)."""
        if batch.ref_logps is not None:
            return batch.ref_logps.to(self.env.device)
        assert self.built.adapter_only, "full fine-tuning precomputes its reference"
        core: Any = self.built.core
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), core.disable_adapter():
                b = batch.to(self.env.device)
                logps: torch.Tensor = sequence_logps(
                    self.model,
                    input_ids=b.input_ids,
                    labels=b.labels,
                    attention_mask=b.attention_mask,
                    autocast_dtype=self.built.autocast_dtype,
                    chunked=self.built.chunked_loss,
                )
        finally:
            self.model.train(training)
        return logps

    def _dpo_terms(self, batch: Batch) -> DpoTerms:
        ref = self._reference_logps(batch)
        logps = self._policy_logps(batch)
        half = logps.size(0) // 2
        d = self.cfg.training.dpo
        return dpo_loss(
            logps[:half],
            logps[half:],
            ref[:half],
            ref[half:],
            beta=d.beta,
            label_smoothing=d.label_smoothing,
        )

    def _dummy_pairs(self) -> Batch:
        """One pair of padding, for a rank with nothing left to evaluate: FSDP's all-gathers
        need every rank in every forward."""
        return Batch(
            input_ids=torch.full((2, 2), self.pad_id, dtype=torch.long),
            labels=torch.full((2, 2), IGNORE_INDEX, dtype=torch.long),
            attention_mask=None,
            position_ids=None,
            tokens=0,
            ref_logps=torch.zeros(2),
        )

    def _precompute_reference(self) -> None:
        """Full fine-tuning's reference: every pair's log-probabilities under the initial
        weights, before any checkpoint is loaded (`kubetune_trainer.dpo`). Ranks split the
        pairs and sum what they computed; a file on the checkpoint volume keeps them for
        the next attempt."""
        t0 = time.monotonic()
        env = self.env
        splits = {
            name: rows
            for name, rows in (("train", self.data.train), ("validation", self.data.validation))
            if isinstance(rows, PairRows)
        }
        folder, fingerprint = self.checkpointer.root, identity(self.cfg)["fingerprint"]
        kept = read_reference(folder, fingerprint, {k: len(v) for k, v in splits.items()})
        # Every rank reads the same file; all use it or all compute (they compute together).
        (readers,) = all_reduce_sum([float(kept is not None)], env)
        if kept is not None and readers == env.world_size:
            for name, rows in splits.items():
                n = len(rows)
                rows.ref_chosen, rows.ref_rejected = kept[name][:n], kept[name][n:]
            self.metrics.event("dpo_reference", source="read", seconds=time.monotonic() - t0)
            log.info("DPO reference log-probabilities read from %s", folder / REFERENCE_FILE)
            return
        computed: dict[str, list[float]] = {}
        self.model.eval()
        for name, rows in splits.items():
            total = self._reference_of(rows)
            n = len(rows)
            rows.ref_chosen, rows.ref_rejected = total[:n], total[n:]
            computed[name] = list(total)
        self.model.train()
        if env.is_main:
            write_reference(folder, fingerprint, computed)
        barrier()
        self.metrics.event("dpo_reference", source="computed", seconds=time.monotonic() - t0)
        log.info("DPO reference log-probabilities precomputed in %.1fs", time.monotonic() - t0)

    def _reference_of(self, rows: PairRows) -> list[float]:
        """The log-probabilities of every pair of `rows` under the current weights: the
        chosen responses', then the rejected ones'; summed over the ranks' shares."""
        env, micro = self.env, self.cfg.training.micro_batch_size
        n = len(rows)
        values = [0.0] * (2 * n)
        with torch.no_grad():
            batches = eval_batches(
                rows,
                micro_batch=micro,
                world_size=env.world_size,
                rank=env.rank,
                pad_id=self.pad_id,
            )
            for k, batch in enumerate(batches):
                logps = self._policy_logps(batch if batch is not None else self._dummy_pairs())
                if batch is None:
                    continue
                start = (k * env.world_size + env.rank) * micro
                got = logps.double().cpu().tolist()
                half = len(got) // 2
                for j in range(half):
                    values[start + j] = got[j]
                    values[n + start + j] = got[half + j]
        return all_reduce_sum(values, env) if env.world_size > 1 else values
