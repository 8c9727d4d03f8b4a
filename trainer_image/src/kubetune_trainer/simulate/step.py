"""One training step on fake tensors (or, for the tests, real zero tensors), tracked.

The trainer's order: the model and its optimizer (`recipe.build_optimizer`), one untracked
step so that the optimizer's states exist (the steady state every later step runs in), then
under the tracker forward and loss (`loss.loss_sum`, or the DPO step's), backward, gradient
clipping, the optimizer step and `zero_grad(set_to_none=True)`, as
`FineTuneRecipe._train_step` runs them. Several GPUs: this process is rank 0 on PyTorch's
fake process group, and the model is sharded by the trainer's `modeling.shard_model`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kubetune_trainer import backward_step
from kubetune_trainer.backward_step import OptimizerInBackward
from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.dpo import dpo_loss
from kubetune_trainer.loss import ChunkedLoss, loss_sum, sequence_logps
from kubetune_trainer.modeling import _hf_model, decoder_blocks, shard_model
from kubetune_trainer.recipe import MAX_GRAD_NORM, build_optimizer
from kubetune_trainer.simulate.kernels import (
    _AssumeTrainedTokens,
    _dropout_as_on_cuda,
    _gemm_4bit_as_on_cuda,
)
from kubetune_trainer.simulate.model import (
    _bnb_tables,
    _build,
    _fake_storages,
    _quant_state_bytes,
)
from kubetune_trainer.simulate.spec import (
    _DEVICE,
    SimulationError,
    SimulationSetup,
    hf_config,
    trainer_config,
)
from kubetune_trainer.simulate.tracker import _breakdown, _FSDPTracker, _Tracker


@dataclass
class _Run:
    phases: dict[str, dict[str, int]]
    """Each point of the step (PHASES and the per-window peaks) → breakdown."""
    total_params: int
    trainable_params: int
    blocks: int


@dataclass
class _Inputs:
    """One micro-batch of zeros: `rows` rows (a DPO pair is two) of `seq_len` tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    rows: int
    seq_len: int


def _run_once(
    setup: SimulationSetup, fields: Mapping[str, Any], layers: int | None, *, fake: bool = True
) -> _Run:
    """One step with `layers` decoder blocks. `fake=False` runs the same step on real CPU
    tensors (zero weights) under the same tracker: what the tests compare the simulation to."""
    group = _fake_process_group(setup.gpus) if _sharded(setup) else contextlib.nullcontext()
    with warnings.catch_warnings(), group:
        warnings.simplefilter("ignore", FutureWarning)  # transformers' checkpointing renames
        return _step(setup, fields, layers, fake=fake)


def _step(
    setup: SimulationSetup, fields: Mapping[str, Any], layers: int | None, *, fake: bool
) -> _Run:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = trainer_config(setup)
    config = hf_config(fields, layers)
    model, chunked, total, trainable = _build(cfg, config, setup.attention)
    block_list = decoder_blocks(model)  # before sharding renames their classes
    blocks = len(block_list)
    vocab = int(getattr(_hf_model(model).config, "vocab_size", 0) or 0)
    sharded = _sharded(setup)
    # Rank 0 of `setup.gpus` on the fake process group `simulate` set up; the mesh is made
    # outside the fake mode (it holds real rank tensors).
    mesh = _rank0_mesh(setup.gpus) if sharded else None

    fake_mode: contextlib.AbstractContextManager[Any] = (
        FakeTensorMode() if fake else contextlib.nullcontext()
    )
    # Real tensors build bitsandbytes' tables themselves.
    tables: contextlib.AbstractContextManager[Any] = (
        _bnb_tables(fake_mode)
        if fake and (setup.method == "qlora" or setup.optimizer != "adamw")
        else contextlib.nullcontext()
    )
    with tables, fake_mode:
        optimizer, adapters, inputs = _ready(setup, cfg, model, mesh)

    tracker = _FSDPTracker(vocab, model, optimizer) if sharded else _Tracker(vocab)
    tracker.blocks = block_list
    tracker.track_external(model, optimizer)  # FSDPMemTracker: its own hooks, on entry
    lora = adapters if setup.method != "full" else 0
    phases = _tracked_step(
        setup, cfg, model, optimizer, chunked, inputs, tracker, fake_mode, fake=fake, lora=lora
    )
    return _Run(phases=phases, total_params=total, trainable_params=trainable, blocks=blocks)


def _ready(
    setup: SimulationSetup, cfg: TrainerConfig, model: Any, mesh: Any
) -> tuple[Any, int, _Inputs]:
    """Under the fake mode: fake storages, sharding, the optimizer in its steady state, and
    the micro-batch; returns the optimizer, the trained parameters' bytes, the inputs."""
    _fake_storages(model)
    if mesh is not None:
        shard_model(model, cfg, mesh)
    optimizer = build_optimizer(cfg, model, torch.device("cuda"))
    # The steady state, not the first step: torch creates optimizer states in the first
    # `step()`, and every later step's forward and backward run with them allocated.
    trained = [p for p in _unique_params(model) if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    _clip_and_step(model, optimizer)
    if cfg.training.optimizer_in_backward:
        # The trainer's hooks (`recipe.FineTuneRecipe`): each parameter stepped and its
        # gradient freed as backward makes it; the step after backward then has none.
        why = backward_step.refusal(cfg)
        if why is not None:
            raise SimulationError(why)
        OptimizerInBackward(model, optimizer)
    adapters = _local_bytes(p for p in _unique_params(model) if p.requires_grad)
    b, s = setup.micro_batch * (2 if setup.objective == "dpo" else 1), setup.seq_len
    inputs = _Inputs(
        input_ids=torch.zeros((b, s), dtype=torch.long, device=_DEVICE),
        labels=torch.zeros((b, s), dtype=torch.long, device=_DEVICE),
        position_ids=torch.arange(s, device=_DEVICE).unsqueeze(0).expand(b, s).contiguous(),
        rows=b,
        seq_len=s,
    )
    return optimizer, adapters, inputs


def _tracked_step(
    setup: SimulationSetup,
    cfg: TrainerConfig,
    model: Any,
    optimizer: Any,
    chunked: ChunkedLoss | None,
    inputs: _Inputs,
    tracker: _Tracker,
    fake_mode: contextlib.AbstractContextManager[Any],
    *,
    fake: bool,
    lora: int,
) -> dict[str, dict[str, int]]:
    """Forward and loss, backward and the optimizer step under the tracker; the breakdown
    after the build, after forward, after the step, and at each window's peak."""
    sharded = _sharded(setup)
    # `modeling.build_model`: FSDP2 casts through its mixed-precision policy, not autocast.
    autocast = torch.bfloat16 if cfg.training.precision == "amp-bf16" and not sharded else None
    # Fake tensors hold no labels: the chunked loss's "any trained token here?" is answered yes.
    assume: contextlib.AbstractContextManager[Any] = (
        _AssumeTrainedTokens() if fake else contextlib.nullcontext()  # type: ignore[no-untyped-call]
    )
    phases: dict[str, dict[str, int]] = {}

    quant_states = _quant_state_bytes(model)

    def take(name: str) -> None:
        snap = tracker.get_tracker_snapshot("current").get(_DEVICE, {})
        phases[name] = _breakdown(snap, tracker.tagged, lora, setup.method)
        phases[name]["weights"] += quant_states

    # FSDPMemTracker sorts the sharded and unsharded parameters only once it is entered;
    # MemTracker already knows them from track_external.
    if not sharded:
        take("weights")
    with fake_mode, assume, tracker, _dropout_as_on_cuda(), _gemm_4bit_as_on_cuda(setup.method):
        if sharded:
            take("weights")
        tracker.stage = "forward"
        loss = _forward(setup, cfg, model, chunked, inputs, tracker, autocast)
        take("forward")
        tracker.stage = "backward"
        scaled: Any = loss * (1.0 / (inputs.rows * (inputs.seq_len - 1)))
        scaled.backward()
        del loss, scaled
        tracker.stage = "step"
        _clip_and_step(model, optimizer)
        take("optimizer")
    for name, (_, snap, tagged) in tracker.windows.items():
        phases[f"peak:{name}"] = _breakdown(snap, tagged, lora, setup.method)
        phases[f"peak:{name}"]["weights"] += quant_states
    return phases


def _forward(
    setup: SimulationSetup,
    cfg: TrainerConfig,
    model: Any,
    chunked: ChunkedLoss | None,
    inputs: _Inputs,
    tracker: _Tracker,
    autocast: torch.dtype | None,
) -> torch.Tensor:
    """The step's loss: the SFT loss summed over the tokens, or the DPO step's."""
    if setup.objective == "dpo":
        # MemTracker follows one forward per module and step: forget the reference's
        # per-module numbers (the windows' peaks stay) before the policy's forward.
        return _dpo_forward(
            model,
            cfg,
            inputs.input_ids,
            inputs.labels,
            autocast,
            chunked,
            between=tracker.reset_mod_stats,
        )
    return loss_sum(
        model,
        input_ids=inputs.input_ids,
        labels=inputs.labels,
        attention_mask=None,
        position_ids=inputs.position_ids,
        autocast_dtype=autocast,
        chunked=chunked,
    )


def _dpo_forward(
    model: Any,
    cfg: TrainerConfig,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    autocast: torch.dtype | None,
    chunked: ChunkedLoss | None,
    *,
    between: Callable[[], None],
) -> torch.Tensor:
    """`FineTuneRecipe._dpo_terms`' forward: the reference log-probabilities (LoRA: the model
    with its adapters off, without gradients, in eval mode; full: precomputed once per start,
    here zeros), then the policy's, then the DPO loss summed over the pairs."""
    rows = input_ids.size(0)
    if cfg.method == "full":
        ref = torch.zeros(rows, dtype=torch.float32, device=input_ids.device)
    else:
        model.eval()
        with torch.no_grad(), model.disable_adapter():
            ref = sequence_logps(
                model,
                input_ids=input_ids,
                labels=labels,
                attention_mask=None,
                autocast_dtype=autocast,
                chunked=chunked,
            )
        model.train()
        between()
    logps = sequence_logps(
        model,
        input_ids=input_ids,
        labels=labels,
        attention_mask=None,
        autocast_dtype=autocast,
        chunked=chunked,
    )
    half = rows // 2
    dpo = cfg.training.dpo
    terms = dpo_loss(
        logps[:half],
        logps[half:],
        ref[:half],
        ref[half:],
        beta=dpo.beta,
        label_smoothing=dpo.label_smoothing,
    )
    return terms.losses.sum()


def _clip_and_step(model: nn.Module, optimizer: Any) -> None:
    """`FineTuneRecipe._optimizer_step`. Run once before tracking as well: DTensor (FSDP2's
    sharded parameters) works out each op's output layout on fake tensors of the global shape
    the first time it meets that op, which a tracker under a fake mode cannot tell from the
    step's own tensors; later calls hit its cache."""
    norm = nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM
    )
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sharded(setup: SimulationSetup) -> bool:
    return setup.gpus > 1 and setup.sharding != "none"


def _rank0_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_DEVICE.type, (world,))


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    """This process as rank 0 of `world` on PyTorch's fake backend: collectives return at once
    and move no data, but their tensors are allocated as on a real group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of these (distinct) parameters' storages on this rank: a DTensor's local shard
    with FSDP2's padding."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.untyped_storage().nbytes()
    return total


def _unique_params(model: nn.Module) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p
