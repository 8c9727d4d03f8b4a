"""Attention over packed rows without a block-diagonal mask (`training.packed_attention`).

A packed row lays several examples end to end, each with `position_ids` restarting at 0
(`kubetune_trainer.data.pack`). Given only those position ids, transformers builds a
block-diagonal causal mask of shape [batch, 1, seq, seq] so examples never attend to each
other; scaled_dot_product_attention then cannot use its flash kernels (they take no mask)
and falls back to a kernel that reads the mask.

With `varlen` the row's document boundaries go to attention as cumulative lengths over the
flattened batch instead (the `cu_seq_lens_q` / `max_length_q` keyword arguments transformers
passes through every layer to the attention function), and each layer calls
`torch.nn.attention.varlen.varlen_attn`, PyTorch's variable-length flash attention, causal
within each document. No mask is built. Where that kernel cannot run (no CUDA, fp32
weights, a PyTorch without it) the same function runs each document through SDPA with
`is_causal=True`, which is slower but computes the same attention; the trainer tests use
that path on CPU to show packed loss equals the loss of the documents one by one.

Models that need more than causal attention inside a document (a sliding window shorter
than the row, logit soft-capping, attention sinks) are left on the mask path: `supports`
says why.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kubetune_trainer.contract import PackedAttention

ATTENTION_NAME = "kubetune_varlen"
"""The name the attention function is registered under in transformers' AttentionInterface."""


@dataclass(frozen=True)
class DocumentBounds:
    """Where each document of a packed batch starts, over the batch flattened to one row."""

    cu_seqlens: torch.Tensor  # int32, [documents + 1], 0 ... batch * seq_len
    max_len: int  # the longest document

    def to(self, device: torch.device) -> DocumentBounds:
        return DocumentBounds(self.cu_seqlens.to(device, non_blocking=True), self.max_len)

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword arguments transformers hands on to the attention function."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }


def document_bounds(position_ids: np.ndarray[Any, Any]) -> DocumentBounds:
    """Documents of a packed batch ([rows, seq_len] position ids): one starts wherever the
    position is 0 and at every row's start."""
    rows, width = position_ids.shape
    flat = np.asarray(position_ids, dtype=np.int64).reshape(-1)
    starts = flat == 0
    starts[::width] = True
    edges = np.flatnonzero(starts)
    cu = np.append(edges, rows * width).astype(np.int32)
    return DocumentBounds(torch.from_numpy(cu), int(np.diff(cu).max()) if len(cu) > 1 else 0)


def supports(config: Any) -> str | None:
    """Why this model's attention cannot run per document without a mask, or None."""
    for name in ("attn_logit_softcapping",):
        if getattr(config, name, None):
            return f"{config.model_type} soft-caps its attention logits ({name})"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return f"{config.model_type} uses sliding-window attention ({window} tokens)"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return f"{config.model_type} mixes attention kinds ({sorted(set(layer_types))})"
    return None


def kernel_available() -> bool:
    """Whether this PyTorch has the variable-length flash kernel and a CUDA device."""
    return torch.cuda.is_available() and _varlen() is not None


def use_varlen(mode: PackedAttention, packing: bool, config: Any, device: torch.device) -> bool:
    """Whether the trainer runs packed rows through `packed_attention_forward`."""
    if not packing or mode == "mask":
        return False
    if supports(config) is not None:
        return False
    if mode == "varlen":
        return True
    return device.type == "cuda" and kernel_available()


def install(model: Any) -> None:
    """Register the attention function and switch the HF model under `model` to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    get_base = getattr(model, "get_base_model", None)
    hf: Any = get_base() if callable(get_base) else model
    setter = getattr(hf, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTENTION_NAME)
    else:  # older transformers: the config is what each attention layer reads
        hf.config._attn_implementation = ATTENTION_NAME


def _varlen() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _kernel_kwargs(fn: Callable[..., Any], scale: float, head_dim: int) -> dict[str, Any] | None:
    """Causal masking, scale and GQA as this PyTorch's `varlen_attn` spells them (its
    signature changed between releases); None when it cannot express them."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [batch, heads, seq, dim], key and
    value [batch, kv_heads, seq, dim]; returns [batch, seq, heads, dim]. Causal attention
    within each document of `cu_seq_lens_q`; a call without document bounds (a forward
    outside training, such as generation) is plain causal attention over each row."""
    if dropout:
        raise ValueError("packed attention has no attention dropout")
    batch, heads, seq, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        if attention_mask is not None:
            raise ValueError("packed attention takes document bounds, not an attention mask")
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        longest = seq
    else:
        longest = int(kwargs.get("max_length_q") or seq)
    groups = heads // key.size(1)
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.transpose(1, 2).reshape(batch * seq, key.size(1), dim)
    v = value.transpose(1, 2).reshape(batch * seq, value.size(1), dim)
    fn = _varlen()
    extra = _kernel_kwargs(fn, scale, dim) if fn is not None else None
    kernel = (
        fn is not None
        and extra is not None
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
    )
    if kernel:
        assert fn is not None and extra is not None
        if groups > 1 and "enable_gqa" not in extra:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = fn(q, k, v, cu.to(torch.int32), cu.to(torch.int32), longest, longest, **extra)
    else:
        out = _per_document(q, k, v, cu, scale, groups)
    return out.view(batch, seq, heads, dim), None


def _per_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    groups: int,
) -> torch.Tensor:
    """The same attention, one document at a time through SDPA (any device and dtype)."""
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    parts = []
    for start, end in itertools.pairwise(bounds):
        # [tokens, heads, dim] -> [1, heads, tokens, dim]
        qd, kd, vd = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        parts.append(od.squeeze(0).transpose(0, 1))
    return torch.cat(parts, dim=0)
