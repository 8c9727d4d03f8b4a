"""Where CPU and fake tensors would run the step otherwise than the trainer on a GPU.

Each is swapped in for the tracked step only: the chunked loss's one data-dependent question
answered as the worst case, dropout as CUDA's fused kernel with its 1-byte mask, and QLoRA's
4-bit matmul dequantizing its weight first as bitsandbytes' CUDA kernel does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _AssumeTrainedTokens(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answers the one data-dependent question of the trainer's step, "does this chunk hold a
    trained token?" (`ChunkedLoss`), with yes, the worst case (fake tensors hold no data)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _dropout_as_on_cuda() -> Iterator[None]:
    """Dropout as CUDA runs it: one fused kernel (`native_dropout`) that keeps a 1-byte mask
    for backward. On CPU, `F.dropout` multiplies by a noise tensor of the input's dtype and
    keeps that instead (2 or 4 bytes per element), which for LoRA's dropout on every adapted
    layer's input overstates a step's peak by gigabytes (docs/simulate.md). Swapped in for
    the step, recomputation under activation checkpointing included, then put back."""
    plain = torch.nn.functional.dropout

    def fused(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return plain(input, p, training, inplace)

    torch.nn.functional.dropout = fused
    try:
        yield
    finally:
        torch.nn.functional.dropout = plain


@contextlib.contextmanager
def _gemm_4bit_as_on_cuda(method: str) -> Iterator[None]:
    """QLoRA's 4-bit matmul as CUDA runs it. bitsandbytes' CUDA `gemm_4bit` dequantizes the
    whole weight to the input's dtype and then calls `linear` (its fallback, taken past 1,536
    tokens and wherever its fused kernel does not suit the GPU); the fake kernel allocates the
    output only. Each forward (recomputation included) first dequantizes the weight through
    bitsandbytes' own `dequantize_4bit`, which the tracker tags as `dequant_workspace`, and
    frees it once the output exists. Kept for every size: the fused kernel's choice depends on
    the GPU, and counting the copy errs on the safe side.

    Sharded, FSDP2 gathers each packed weight into a plain parameter that has lost its
    quantization state; bitsandbytes' `Linear4bit.forward` re-attaches the layer's state by
    wrapping the gathered tensor in a new `Params4bit`, which a fake tensor cannot become, so
    here the state is set on the gathered parameter as an attribute (what `Linear4bit` then
    reads): the same tensors, no copy."""
    if method != "qlora":
        yield
        return
    import bitsandbytes.functional as bnb_functional
    import bitsandbytes.nn.modules as bnb_modules
    from bitsandbytes.autograd._functions import MatMul4Bit

    plain = MatMul4Bit.forward
    plain_fix = bnb_modules.fix_4bit_weight_quant_state_from_module

    def fix(module: Any) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    def forward(
        ctx: Any,
        A: torch.Tensor,
        B: torch.Tensor,
        out: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        quant_state: Any = None,
    ) -> torch.Tensor:
        workspace = None
        if A.numel() and quant_state is not None:
            workspace = bnb_functional.dequantize_4bit(B.view(-1, 1), quant_state).to(A.dtype)
        result: torch.Tensor = plain(ctx, A, B, out, bias, quant_state)
        del workspace
        return result

    MatMul4Bit.forward = staticmethod(forward)  # type: ignore[method-assign]
    bnb_modules.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        MatMul4Bit.forward = plain  # type: ignore[method-assign]
        bnb_modules.fix_4bit_weight_quant_state_from_module = plain_fix
