"""The memory accounting: a `MemTracker` that sorts every storage of the step, and the map
from its kinds onto the estimator's breakdown keys.

PyTorch's tracker sorts storages into parameters, buffers, gradients, activations, backward
temporaries and optimizer states; `_Tracker` also tags the storages whose last dimension is
the vocabulary (logits and their gradients), the autocast copies of parameters under
`amp-bf16`, and QLoRA's dequantized weights, and keeps the peak of each window of the step
(before, first, middle, last block; forward and backward; the optimizer step), which the
per-block extrapolation needs one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from kubetune_trainer.simulate.spec import _DEVICE, MEASURED_COMPONENTS


class _Tracker(MemTracker):  # type: ignore[no-untyped-call]
    """`MemTracker` that also tags logits and autocast weight copies, keeps the tagged bytes
    at every peak, and hooks only parameters that have gradients (frozen LoRA bases).

    `_FSDPTracker` is the same on `FSDPMemTracker` (extra arguments go to its constructor)."""

    def __init__(self, vocab_size: int, *args: Any) -> None:
        super().__init__(*args)
        self.vocab_size = vocab_size
        self.tagged: dict[str, int] = dict.fromkeys(_TAGS, 0)
        self._dequantize_4bit = _dequantize_4bit_op()  # looked up once, not per operator
        self._tag_of: dict[int, tuple[str, Any]] = {}  # id(winfo) → (tag, winfo)
        self._func: Any = None
        self._args: Any = ()
        self.stage = "weights"
        """`forward`, `backward` or `step` (clipping and the optimizer), set by the driver."""
        self.blocks: list[nn.Module] = []
        self._block_fqns: dict[int, str] = {}
        self._seen_first: set[str] = set()
        self._seen_last: set[str] = set()
        self.windows: dict[str, tuple[int, dict[Any, int], dict[str, int]]] = {}
        """Window → (peak bytes, MemTracker snapshot at it, tagged bytes at it)."""

    # -- tags
    def _tag(self, t: torch.Tensor) -> str | None:
        func, args = self._func, self._args
        if func is not None and func is self._dequantize_4bit:
            return "dequant_workspace"
        if (
            func is torch.ops.aten._to_copy.default
            and args
            and isinstance(args[0], nn.Parameter)
            and not self._in_opt
        ):
            return "autocast_weight_copies"
        if t.dim() >= 1 and t.shape[-1] == self.vocab_size and not isinstance(t, nn.Parameter):
            return "logits"
        return None

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        new = [st for st in _storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        if not new or reftype.name not in _TRANSIENT:
            return
        tag = self._tag(t)
        if tag is None:
            return
        for st in new:
            winfo, _ = self._WINFO.get(st, (None, None))  # type: ignore[no-untyped-call]
            if winfo is not None and winfo.mem_consumed > 0:
                self._tag_of[id(winfo)] = (tag, winfo)
                self.tagged[tag] += winfo.mem_consumed

    def _delete_callback(self, winfo: Any, w_st: Any) -> None:
        hit = self._tag_of.pop(id(winfo), None)
        if hit is not None:
            self.tagged[hit[0]] -= winfo.mem_consumed
        super()._delete_callback(winfo, w_st)

    def _update_and_maybe_create_winfos(
        self, t: torch.Tensor, reftype: Any, update_existing: bool = False
    ) -> Any:
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        if reftype.name not in _TRANSIENT:
            for winfo in winfos:  # re-classified: no longer an activation
                hit = self._tag_of.pop(id(winfo), None)
                if hit is not None:
                    self.tagged[hit[0]] -= winfo.mem_consumed
        return winfos

    # -- peaks, per window of the step
    def _active_block(self) -> int | None:
        parents = self._mod_tracker.parents
        for i, block in enumerate(self.blocks):
            fqn = self._block_fqns.get(i)
            if fqn is None:
                known = self._mod_tracker.get_known_fqn(block)  # type: ignore[no-untyped-call]
                if known is None:
                    continue
                fqn = self._block_fqns[i] = known
            if fqn in parents:
                return i
        return None

    def _window_names(self) -> list[str]:
        """`<stage>:before|first|middle|last|after`: the decoder block running (first and last
        in execution order: backward runs the blocks in reverse) or the part outside them."""
        stage = self.stage
        if stage not in ("forward", "backward"):
            return [stage]
        idx = self._active_block()
        if idx is None:
            if stage in self._seen_last:
                return [f"{stage}:after"]
            return [f"{stage}:middle" if stage in self._seen_first else f"{stage}:before"]
        self._seen_first.add(stage)
        n = len(self.blocks)
        first, last = (0, n - 1) if stage == "forward" else (n - 1, 0)
        names = []
        if idx == first:
            names.append(f"{stage}:first")
        if idx == last:
            names.append(f"{stage}:last")
            self._seen_last.add(stage)
        return names or [f"{stage}:middle"]

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        snap = self._curr_mem_snap.get(_DEVICE)
        if snap is None:
            return
        total = int(snap.get("Total", 0))
        for name in self._window_names():
            if total > self.windows.get(name, (-1, {}, {}))[0]:
                self.windows[name] = (total, dict(snap), dict(self.tagged))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._func, self._args = func, args
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._func, self._args = None, ()

    # -- frozen parameters get no gradient hooks
    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        params, buffers = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad or param in self._param_to_grad_hook_handles:
                    continue

                def grad_hook(grad: torch.Tensor) -> None:
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(grad_hook),  # type: ignore[no-untyped-call]
                    param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda p: grad_hook(p.grad) if p.grad is not None else None
                    ),
                )
        return params, buffers


class _FSDPTracker(_Tracker, FSDPMemTracker):  # type: ignore[no-untyped-call]
    """`_Tracker` on `FSDPMemTracker`: sharded and unsharded parameters and gradients, FSDP2's
    all-gather and reduce-scatter buffers as their own kinds (`_breakdown` maps them)."""


_TRANSIENT = frozenset({"ACT", "TEMP", "OTH"})
"""Tracker kinds of the tensors a step creates and frees (where logits and casts are tagged)."""

_TAGS: tuple[str, ...] = ("logits", "autocast_weight_copies", "dequant_workspace")
"""Transient tensors told apart from the other activations: the vocabulary-wide ones, the
autocast copies of weights, and QLoRA's weights dequantized for a matmul (each tag is the
breakdown key it is reported under)."""


def _dequantize_4bit_op() -> Any:
    """bitsandbytes' `dequantize_4bit` operator (None until bitsandbytes is imported)."""
    ops = getattr(torch.ops, "bitsandbytes", None)
    if ops is None or not hasattr(ops, "dequantize_4bit"):
        return None
    return ops.dequantize_4bit.default


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    from torch.distributed._tools.common_utils import get_untyped_storages

    return list(get_untyped_storages(t))


def _breakdown(
    snap: Mapping[Any, int], tagged: Mapping[str, int], adapters: int, method: str
) -> dict[str, int]:
    by_name: dict[str, int] = {}
    for kind, size in snap.items():
        name = getattr(kind, "name", None)  # "Total" is a plain string
        if name is not None:
            by_name[name] = by_name.get(name, 0) + int(size)

    def get(*names: str) -> int:
        return sum(by_name.get(name, 0) for name in names)

    # MemTracker's kinds, and FSDPMemTracker's: the rank's shards are the weights, gradients
    # and optimizer states; what FSDP2 gathers or reduces for a while is `fsdp_buffers`.
    params = get("PARAM", "SHARDED_PARAM")
    lora = min(adapters, params) if method != "full" else 0
    tags = {tag: int(tagged.get(tag, 0)) for tag in _TAGS}
    transient = get(*_TRANSIENT, "INP")
    out = dict.fromkeys(MEASURED_COMPONENTS, 0)
    out["weights"] = params - lora + get("BUFFER")
    out["lora_adapters"] = lora
    out["gradients"] = get("GRAD", "SHARDED_GRAD")
    out["optimizer_states"] = get("OPT")
    out["fsdp_buffers"] = get("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER")
    out.update(tags)
    out["activations"] = transient - sum(tags.values())
    return out
