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
  training and validation pairs with the initial weights, before the optimizer's first step
  (and again at every start, before a checkpoint is loaded, so a resumed run uses exactly the
  same numbers: the pass is deterministic). Chosen over a frozen copy because the copy would
  hold a second set of weights on every GPU for the whole run (2 bytes per parameter in bf16,
  sharded like the policy under FSDP), which for the models full fine-tuning is planned for is
  often the difference between fitting and not. The precomputed values take 8 bytes per pair
  in host memory (two fp32 numbers; 8 MB per million pairs) and no accelerator memory beyond
  one forward's activations, which the training step exceeds anyway. The price is time: one
  forward over the dataset at every start, about a quarter to a third of one epoch's compute
  at one epoch.

What the planner should count for DPO on top of SFT at the same micro-batch of *pairs*: the
rows per micro-batch double (chosen and rejected), so activations and logits are those of
2 × micro_batch_size rows padded to the longer response; no extra weights for any method.
"""

from __future__ import annotations

from dataclasses import dataclass

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
