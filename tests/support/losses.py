"""What the loss tests share: a batch with a prompt and padding (or packed rows), a tiny model
full or with LoRA, and one step's loss and gradients (torch is imported by the callers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubetune_trainer.data import IGNORE_INDEX
from kubetune_trainer.loss import ChunkedLoss, loss_sum


def batch(vocab: int, rows: int = 2, width: int = 40, packed: bool = False) -> dict[str, Any]:
    """Two rows whose first 7 tokens are a prompt; the second right-padded by 9, or with
    `packed` two documents per row whose positions restart."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :7] = IGNORE_INDEX  # a prompt
    mask = None
    pos = None
    if packed:  # two documents per row, positions restart
        pos = torch.cat([torch.arange(15), torch.arange(width - 15)]).repeat(rows, 1)
    else:
        mask = torch.ones_like(ids)
        mask[1, -9:] = 0  # right padding
        labels[1, -9:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}


def model(path: Path, method: str, targets: list[str] | None = None) -> Any:
    """The tiny model at `path` in fp32, full or with LoRA (`targets`; None: PEFT's default)
    whose B matrices are non-zero, so that adapter gradients flow."""
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
        built = get_peft_model(built, cfg)
        for n, p in built.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    return built


def loss_and_grads(model: Any, batch: dict[str, Any], loss: ChunkedLoss | None) -> Any:
    """One forward and backward of the summed loss: (loss, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    value = loss_sum(model, chunked=loss, **batch)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


def tiny_gemma2(layers: int) -> Any:
    """A random Gemma 2 of `layers` blocks with a final logit soft-cap of 2 (low, so that the
    cap changes the loss)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
    )
    return Gemma2ForCausalLM(config)
