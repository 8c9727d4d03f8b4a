"""The optimizer and its learning-rate schedule, as every objective uses them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kubetune_trainer.bnb import import_bitsandbytes
from kubetune_trainer.contract import TrainerConfig

MAX_GRAD_NORM = 1.0


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    """Linear warmup from 0, then cosine decay to 0 at total_steps (as HF's default)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(
    cfg: TrainerConfig, model: nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norms get no weight decay."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    lr = cfg.training.learning_rate
    name = cfg.training.optimizer
    optimizer_cls: Any
    if name == "adamw":
        optimizer_cls = torch.optim.AdamW
        fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    else:
        bnb: Any = import_bitsandbytes()
        optimizer_cls = {
            "adamw-8bit": bnb.optim.AdamW8bit,
            "paged-adamw-8bit": bnb.optim.PagedAdamW8bit,
            "paged-adamw-32bit": bnb.optim.PagedAdamW32bit,
        }[name]
        fast = {}
    optimizer: torch.optim.Optimizer = optimizer_cls(
        groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **fast
    )
    return optimizer


def build_scheduler(
    cfg: TrainerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`warmup_cosine` over `total_steps`, with `training.warmup_ratio` of them warming up."""
    warmup = math.ceil(cfg.training.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total_steps))


def configured_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    configured: list[dict[str, Any]],
) -> None:
    """Loading a checkpoint restores the optimizer's learning rate, weight decay and the
    like; this run's config sets them (they differ only in an adopted checkpoint of another
    job), the checkpoint only the place in the schedule. `configured` is each param group's
    settings as built, before the load."""
    groups = optimizer.param_groups
    for group, mine in zip(groups, configured, strict=True):
        group.update(mine)
    scheduler.base_lrs = [g["initial_lr"] for g in groups]
    lrs = [
        b * f(scheduler.last_epoch)
        for b, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
