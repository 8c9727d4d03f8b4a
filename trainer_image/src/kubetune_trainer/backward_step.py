"""The optimizer step inside backward (`training.optimizer_in_backward`).

An ordinary step keeps every gradient until backward ends, then steps: for full fine-tuning
that is a whole model's worth of gradients at the end of backward (2 bytes per parameter in
bf16; 15 GiB for an 8B model). Here each trainable parameter gets a post-accumulate-grad
hook: once its gradient is complete, the optimizer steps that parameter alone and the
gradient is freed, so at most one parameter's gradient exists at a time.

One optimizer serves every parameter, so checkpoints, learning-rate schedules and resumes
are those of the ordinary step: when a hook runs, the parameter it belongs to is the only
one holding a gradient (the others were freed by their own hooks, or have none yet), and
`optimizer.step()` (torch's AdamW, bitsandbytes' optimizers) skips parameters without one.

What it gives up, said where it is chosen (docs/trainer.md):
- **gradient-norm clipping**: no step sees every gradient before the first update, so there
  is no global norm to clip by (torchtune makes the same trade). The norm is still measured,
  from each gradient as its hook runs, and reported.
- **gradient accumulation**: the first micro-batch's gradients would be stepped on alone;
  accumulation must be 1.
- **DDP**: its hooks fire before the all-reduce averages a gradient; FSDP2 runs the hooks after
  its reduce-scatter, on the sharded gradient, which is what is needed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kubetune_trainer.contract import TrainerConfig


def refusal(cfg: TrainerConfig) -> str | None:
    """Why `cfg` cannot step the optimizer in backward (with the fix), or None."""
    t, par = cfg.training, cfg.parallel
    if t.gradient_accumulation > 1:
        return (
            f"training.optimizer_in_backward steps each parameter once its gradient is made, "
            f"and gradient_accumulation {t.gradient_accumulation} needs every micro-batch's "
            "first; to fix: set gradient_accumulation to 1 or turn optimizer_in_backward off"
        )
    if par.nodes * par.gpus_per_node > 1 and par.sharding == "none":
        return (
            "training.optimizer_in_backward would step on gradients DDP has not averaged yet; "
            "to fix: shard the model (parallel.sharding full or grad-op) or turn it off"
        )
    if par.cpu_offload:
        return (
            "training.optimizer_in_backward steps on the GPU and parallel.cpu_offload on the "
            "CPU; to fix: turn one of them off"
        )
    return None


class OptimizerInBackward:
    """Hooks that step `optimizer` per parameter as backward makes each gradient."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._squares: torch.Tensor | None = None
        self.stepped = 0
        """Parameters stepped since the last `finish` (tests and the step's sanity check)."""
        seen: set[int] = set()
        self._handles = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:  # a tied weight gets one hook
                seen.add(id(p))
                hook = p.register_post_accumulate_grad_hook  # untyped in torch
                self._handles.append(hook(self._step))  # type: ignore[no-untyped-call]

    def _step(self, param: torch.Tensor) -> None:
        grad: Any = param.grad
        if grad is None:
            return
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: this shard
        # The norm in fp32 without an fp32 copy of the gradient (one would be the largest
        # tensor of the step for a 128k-vocabulary embedding).
        square = torch.linalg.vector_norm(local.detach(), 2, dtype=torch.float32).square()
        self._squares = square if self._squares is None else self._squares + square
        self.optimizer.step()
        param.grad = None
        self.stepped += 1

    def finish(self, sharded: bool) -> float:
        """End of a step: the norm of every gradient it stepped (all ranks' shards)."""
        total = self._squares
        self._squares = None
        self.stepped = 0
        if total is None:
            return 0.0
        if sharded and dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        return math.sqrt(float(total))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
