"""Direct Preference Optimization: the loss, its rewards, and where the reference comes from.

The loss is DPO's sigmoid loss with label smoothing (conservative DPO, cDPO): for a pair with
policy log-probabilities (c, r) of the chosen and rejected responses and reference ones
(c₀, r₀), Δ = (c - c₀) - (r - r₀) and

    loss = -(1 - ε) · log σ(β Δ) - ε · log σ(-β Δ)

averaged over the pairs of the optimizer step (every pair weighs the same, over micro-batches
and ranks). The implicit rewards are β (c - c₀) and β (r - r₀); a pair is "accurate" when the
chosen reward is the larger. Log-probabilities are sums over response tokens only.

**The reference model.**

* LoRA and QLoRA: the model itself with its adapters switched off (PEFT's
  `disable_adapter()`), run without gradients before the policy forward of each micro-batch.
  No second copy of the weights and nothing precomputed: the frozen base *is* the reference.
  Cost: one extra forward per micro-batch (no backward), about a third more compute per step.
* Full fine-tuning: the reference log-probabilities are precomputed in one pass over the
  training and validation pairs with the initial weights, before the optimizer's first step,
  and kept on the checkpoint volume (`REFERENCE_FILE`, with the run's fingerprint): a later
  start of the same run (a resume after preemption, an out-of-memory re-plan) reads them
  instead of passing over the data again, so every attempt uses exactly the same numbers.
  Chosen over a frozen copy because the copy would hold a second set of weights on every GPU
  for the whole run (2 bytes per parameter in bf16, sharded like the policy under FSDP),
  which for the models full fine-tuning is planned for is often the difference between
  fitting and not. The precomputed values take 8 bytes per pair
  in host memory (two fp32 numbers; 8 MB per million pairs) and no accelerator memory beyond
  one forward's activations, which the training step exceeds anyway. The price is time: one
  forward over the dataset at the first start, about a quarter to a third of one epoch's
  compute at one epoch.

What the planner should count for DPO on top of SFT at the same micro-batch of *pairs*: the
rows per micro-batch double (chosen and rejected), so activations and logits are those of
2 × micro_batch_size rows padded to the longer response; no extra weights for any method.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class DpoTerms:
    """Per-pair terms of a micro-batch (shape [pairs])."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> DpoTerms:
    """The sigmoid DPO loss with label smoothing per pair, and the (detached) rewards."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    losses = (
        -F.logsigmoid(beta * delta) * (1 - label_smoothing)
        - F.logsigmoid(-beta * delta) * label_smoothing
    )
    return DpoTerms(
        losses=losses,
        chosen_rewards=beta * chosen_ratio.detach(),
        rejected_rewards=beta * rejected_ratio.detach(),
    )


@dataclass
class DpoSums:
    """What the metrics need, summed over pairs (so micro-batches and ranks add up)."""

    loss: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0
    accurate: float = 0.0
    pairs: float = 0.0

    def add(self, terms: DpoTerms) -> None:
        self.loss += float(terms.losses.detach().sum())
        self.chosen += float(terms.chosen_rewards.sum())
        self.rejected += float(terms.rejected_rewards.sum())
        self.accurate += float((terms.chosen_rewards > terms.rejected_rewards).sum())
        self.pairs += terms.losses.numel()

    def as_list(self) -> list[float]:
        return [self.loss, self.chosen, self.rejected, self.accurate, self.pairs]

    @classmethod
    def from_list(cls, values: list[float]) -> DpoSums:
        return cls(*values)

    def means(self, prefix: str = "") -> dict[str, float]:
        """`dpo_rewards_chosen`, `dpo_rewards_rejected`, `dpo_reward_margin`,
        `dpo_reward_accuracy` (means over pairs), names prefixed with `prefix`."""
        n = max(self.pairs, 1.0)
        return {
            f"{prefix}dpo_rewards_chosen": self.chosen / n,
            f"{prefix}dpo_rewards_rejected": self.rejected / n,
            f"{prefix}dpo_reward_margin": (self.chosen - self.rejected) / n,
            f"{prefix}dpo_reward_accuracy": self.accurate / n,
        }


log = logging.getLogger(__name__)

REFERENCE_FILE = "dpo-reference.json"
"""Full DPO's precomputed reference log-probabilities, in the checkpoint folder: the run's
fingerprint (`identity.fingerprint`), and per split (`train`, `validation`) the chosen then
the rejected values, one per pair in the split's order."""


def read_reference(
    folder: Path, fingerprint: str, sizes: dict[str, int]
) -> dict[str, list[float]] | None:
    """The reference values kept in `folder` for this run: None when there are none, they
    were written for another fingerprint, or a split has another number of pairs (`sizes`,
    pairs by split) than this run's."""
    path = folder / REFERENCE_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is not readable (%s): the reference is computed again", path, e)
        return None
    if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint:
        return None
    values = saved.get("values")
    if not isinstance(values, dict) or set(values) != set(sizes):
        return None
    for split, pairs in sizes.items():
        got = values[split]
        if not isinstance(got, list) or len(got) != 2 * pairs:
            return None
    return {split: [float(v) for v in values[split]] for split in sizes}


def write_reference(folder: Path, fingerprint: str, values: dict[str, list[float]]) -> None:
    """Keep the reference values in `folder`, atomically (a reader sees all or nothing). A
    failed write is logged, not raised: the next start computes them again."""
    path = folder / REFERENCE_FILE
    tmp = folder / f".{REFERENCE_FILE}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "values": values}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning(
            "could not keep the DPO reference in %s (%s): the next start computes it again", path, e
        )
        tmp.unlink(missing_ok=True)
