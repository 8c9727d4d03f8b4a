"""The training loss: summed next-token cross-entropy over the trained tokens.

Two ways to compute it, the same number (tested to 1e-5 on CPU, gradients included):

* **plain**: the model returns logits for every position, upcast to fp32, one
  `cross_entropy`. Autograd keeps the fp32 log-softmax of every (token, vocabulary) entry and
  the backward pass adds an fp32 gradient of the same size; with the bf16 logits and their
  fp32 copy that is about 14 bytes per entry, which at a 128k-262k vocabulary is often the
  largest single tensor of a step (2 GiB per 1,024 tokens of Llama-3).
* **chunked** (`training.chunked_cross_entropy`): the output projection is applied to a
  few hundred tokens at a time and each chunk's cross-entropy is taken at once, so the bf16
  logits and their fp32 copy exist for one chunk only; autograd keeps each chunk's fp32
  log-softmax (4 bytes per entry), the chunk's working set is transient. No extra FLOPs.

* **fused** (`training.fused_cross_entropy`): the output projection and the loss in one
  kernel, Liger's fused linear cross-entropy (liger-kernel, Triton): it projects a chunk of
  tokens at a time into a compute-dtype buffer of about tokens x hidden elements, turns it into
  the gradient in place and adds that chunk's share to the gradients of the hidden states and
  (trained) of the projection's weight during the forward, so nothing of vocabulary size waits
  for backward. It runs where Triton does (CUDA; on CPU only under Triton's interpreter,
  `TRITON_INTERPRET=1`, which the tests use); elsewhere the chunked path computes the same sum.

The chunked and fused paths replace the output projection's `forward` on its instance (the
module and its parameters stay where they are, so state dicts, FSDP2 sharding, PEFT adapters on
the output layer and tied embeddings are untouched) and computes the loss inside the model's
own forward, where FSDP2 has the root parameters gathered. It is used only while `labels` are
set (`ChunkedLoss.labels_set`): any other forward gets ordinary logits. A final logit soft-cap
(Gemma 2) moves into the chunk with it; a model that rescales its logits after the output
projection in any other way is refused (`ChunkedLossUnsupported`), not mis-trained.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kubetune_trainer.attention import DocumentBounds
from kubetune_trainer.bnb import import_bitsandbytes
from kubetune_trainer.contract import loss_chunk_tokens
from kubetune_trainer.data import IGNORE_INDEX

log = logging.getLogger(__name__)

# Config fields with which a causal LM changes its logits after the output projection.
_LOGIT_RESCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")


class ChunkedLossUnsupported(ValueError):
    """The model post-processes its logits in a way the chunked loss does not reproduce."""


class ChunkedLoss:
    """The chunked loss, installed on a model's output projection (see the module doc)."""

    def __init__(
        self,
        head: nn.Module,
        vocab_size: int,
        softcap: float | None = None,
        fused: Any = None,
    ) -> None:
        self.head = head
        self.chunk = loss_chunk_tokens(vocab_size)
        self.softcap = softcap
        self.fused = fused
        """Liger's fused linear cross-entropy (an autograd Function), or None: chunked."""
        self._fallback_logged = False
        self._labels: torch.Tensor | None = None
        self._per_row = False
        self._plain_forward = head.forward
        head.forward = self._forward

    @classmethod
    def install(cls, model: nn.Module, fused: bool = False) -> ChunkedLoss:
        """On the HF causal LM under `model` (PEFT-wrapped or not); `fused`: with the fused
        kernel (an output projection without adapters, liger-kernel installed)."""
        get_base = getattr(model, "get_base_model", None)
        hf: Any = get_base() if callable(get_base) else model
        config = hf.config
        head = hf.get_output_embeddings()
        if head is None:
            raise ChunkedLossUnsupported(f"{type(hf).__name__} has no output projection")
        for name in _LOGIT_RESCALES:
            value = getattr(config, name, None)
            if value not in (None, 1, 1.0):
                raise ChunkedLossUnsupported(
                    f"{config.model_type} rescales its logits ({name}={value})"
                )
        kernel = None
        if fused:
            if type(head) is not nn.Linear:
                raise ChunkedLossUnsupported(
                    f"the fused loss needs a plain linear output projection, not "
                    f"{type(head).__name__} (an adapter on the output layer?)"
                )
            if getattr(config, "final_logit_softcapping", None) is not None:
                # Liger's kernel has a soft-cap, but Triton's interpreter cannot run that
                # branch, so nothing here has checked it: not offered until it is.
                raise ChunkedLossUnsupported(
                    f"{config.model_type} soft-caps its logits, which the fused loss is not "
                    "verified for; the chunked loss handles it"
                )
            kernel = fused_kernel()
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None:
            config.final_logit_softcapping = None  # applied per chunk instead
        return cls(head, int(config.vocab_size), softcap, kernel)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self._plain_forward(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @contextlib.contextmanager
    def labels_set(self, labels: torch.Tensor, per_row: bool = False) -> Iterator[None]:
        """Within this block the model's forward returns the summed loss as its `logits`:
        one number, or with `per_row` one per row (what DPO needs)."""
        self._labels = labels
        self._per_row = per_row
        try:
            yield
        finally:
            self._labels = None
            self._per_row = False

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels = self._labels
        if labels is None:
            return self._logits(hidden)
        h = hidden[:, :-1, :].reshape(-1, hidden.size(-1))
        target = labels[:, 1:].reshape(-1)
        width = labels.size(1) - 1
        if self.fused is not None and self._fused_runs_on(h.device):
            return self._fused_forward(h.contiguous(), target.contiguous(), labels.size(0))
        shape = (labels.size(0),) if self._per_row else ()
        total = hidden.new_zeros(shape, dtype=torch.float32)
        for start in range(0, h.size(0), self.chunk):
            end = start + self.chunk
            keep = target[start:end]
            if not bool((keep != IGNORE_INDEX).any()):
                continue  # a chunk of prompt or padding adds nothing
            logits = self._logits(h[start:end]).float()
            if self._per_row:
                ce = F.cross_entropy(logits, keep, ignore_index=IGNORE_INDEX, reduction="none")
                row = torch.arange(start, start + keep.size(0), device=ce.device) // width
                total = total.index_add(0, row, ce)
            else:
                total = total + F.cross_entropy(
                    logits, keep, ignore_index=IGNORE_INDEX, reduction="sum"
                )
        return total

    def _fused_runs_on(self, device: torch.device) -> bool:
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return True
        if not self._fallback_logged:
            log.info(
                "training.fused_cross_entropy: the fused kernel needs CUDA; on %s the chunked "
                "loss computes the same sum",
                device.type,
            )
            self._fallback_logged = True
        return False

    def _fused_forward(self, h: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        weight = self.head.weight
        bias = self.head.bias
        assert isinstance(weight, torch.Tensor)
        # Positional arguments of LigerFusedLinearCrossEntropyFunction.forward: input, weight,
        # target, bias, class weights, ignore index, z-loss scale, label smoothing, reduction,
        # soft-cap. "sum" computes the gradients in the forward; "none" (one loss per token,
        # summed per row here) recomputes them in the backward with the per-token upstream.
        out = self.fused.apply(
            h,
            weight,
            target,
            bias if isinstance(bias, torch.Tensor) else None,
            None,
            IGNORE_INDEX,
            0.0,
            0.0,
            "none" if self._per_row else "sum",
            self.softcap,
        )
        loss: torch.Tensor = out[0]
        return loss.view(rows, -1).sum(-1) if self._per_row else loss


def fused_kernel() -> Any:
    """Liger's fused linear cross-entropy Function; `ChunkedLossUnsupported` when liger-kernel
    is not installed."""
    # liger-kernel imports peft, which imports bitsandbytes: import that the trainer's way.
    with contextlib.suppress(ImportError):  # not installed: peft does without it
        import_bitsandbytes()
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
    except ImportError as e:
        raise ChunkedLossUnsupported(
            f"the fused loss needs liger-kernel, which does not import here ({e})"
        ) from e
    return LigerFusedLinearCrossEntropyFunction


class OffloadActivations:
    """Activation offloading (`training.activation_offloading`): what autograd saves for
    backward during a forward is copied to host memory (pinned on GPU) and copied back when
    backward needs it.

    With non-reentrant activation checkpointing the tensors saved are each decoder block's
    input plus what lies outside the blocks (a recomputed block's internals live on the GPU
    only while it runs backward), so the GPU keeps one block's working set instead of one
    input per block. Parameters (and views of them) stay where they are: a saved weight is
    the weight itself, not a copy, and moving it would copy the model every micro-batch.
    Tensors under `min_bytes` stay too (not worth a transfer). Copies are synchronous: this
    trades PCIe time for GPU memory, which the planner prices (docs/planner.md).
    """

    MIN_BYTES = 1 << 20

    def __init__(self, min_bytes: int | None = None) -> None:
        self.min_bytes = self.MIN_BYTES if min_bytes is None else min_bytes
        self.offloaded_bytes = 0
        """Bytes moved to host memory by the latest forward."""

    def hooks(self, pin_memory: bool) -> torch.autograd.graph.saved_tensors_hooks:
        self.offloaded_bytes = 0

        def pack(t: torch.Tensor) -> Any:
            base = t._base if t._base is not None else t
            size = t.numel() * t.element_size()
            if isinstance(base, nn.Parameter) or size < self.min_bytes:
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
            host.copy_(t)
            self.offloaded_bytes += size
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin_memory)  # type: ignore[no-any-return]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def sequence_logps(
    model: nn.Module,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    autocast_dtype: torch.dtype | None = None,
    chunked: ChunkedLoss | None = None,
    offload: OffloadActivations | None = None,
) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens (fp32, shape [rows]): the
    per-sequence cross-entropy of `loss_sum`, negated, by the same two paths."""
    return -_cross_entropy(
        model,
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=None,
        autocast_dtype=autocast_dtype,
        chunked=chunked,
        offload=offload,
        per_row=True,
    )


def loss_sum(
    model: nn.Module,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    autocast_dtype: torch.dtype | None = None,
    chunked: ChunkedLoss | None = None,
    offload: OffloadActivations | None = None,
    documents: DocumentBounds | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of the next-token predictions over the positions whose label is
    not `IGNORE_INDEX` (fp32, a 0-dim tensor); `chunked` and `offload` are the memory savers
    above; `documents`, a packed batch's example bounds for a model whose attention takes
    them (`kubetune_trainer.attention`)."""
    return _cross_entropy(
        model,
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
        autocast_dtype=autocast_dtype,
        chunked=chunked,
        offload=offload,
        per_row=False,
        documents=documents,
    )


def _cross_entropy(
    model: nn.Module,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    autocast_dtype: torch.dtype | None = None,
    chunked: ChunkedLoss | None = None,
    offload: OffloadActivations | None,
    per_row: bool,
    documents: DocumentBounds | None = None,
) -> torch.Tensor:
    ctx: contextlib.AbstractContextManager[Any] = (
        torch.autocast(input_ids.device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    chunking = (
        chunked.labels_set(labels, per_row) if chunked is not None else contextlib.nullcontext()
    )
    offloading: contextlib.AbstractContextManager[Any] = (
        offload.hooks(pin_memory=input_ids.device.type == "cuda")
        if offload is not None
        else contextlib.nullcontext()
    )
    with ctx, chunking, offloading:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **(documents.model_kwargs() if documents is not None else {}),
        )
    if chunked is not None:
        return out.logits.float()  # type: ignore[no-any-return]
    logits = out.logits[:, :-1, :].float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none" if per_row else "sum",
    )
    return ce.view(labels.size(0), -1).sum(-1) if per_row else ce
