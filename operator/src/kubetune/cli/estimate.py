"""`kubetune estimate`: the peak GPU memory of one training configuration, from the
estimator and (with --simulate) from the trainer's own step on fake tensors. No cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kubetune.cli.errors import Abort
from kubetune.planning.arch import ArchitectureError, ModelArch, known_models
from kubetune.planning.estimator import (
    ATTENTIONS,
    GIB,
    Attention,
    EstimatorError,
    TrainingSetup,
    VramEstimate,
    estimate_vram,
    trainer_attention,
)
from kubetune.planning.throughput import ROWS_PER_PAIR
from kubetune.sources import load_arch
from kubetune_trainer.contract import (
    METHODS,
    OBJECTIVES,
    OPTIMIZERS,
    PRECISIONS,
    SHARDINGS,
    Method,
    Optimizer,
    Precision,
    Sharding,
)
from kubetune_trainer.contract import Objective as TrainingObjective


def _arch(config: str | None, model: str | None, allow_network: bool) -> ModelArch:
    if not config and not model:
        raise click.UsageError("pass --model ID (see --list-models) or --config PATH/config.json")
    try:
        return load_arch(config or model or "", allow_network=allow_network)
    except ArchitectureError as exc:
        raise Abort(str(exc)) from exc


@click.command()
@click.option(
    "--config", "config", type=click.Path(exists=True), help="HF config.json file or dir."
)
@click.option("--model", help="Known model id, e.g. meta-llama/Llama-3.1-8B.")
@click.option("--list-models", is_flag=True, help="List the built-in architectures and exit.")
@click.option("--method", type=click.Choice(METHODS), default="lora", show_default=True)
@click.option("--lora-rank", type=int, default=16, show_default=True)
@click.option(
    "--lora-dropout",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    default=0.05,
    show_default=True,
    help="LoRA dropout (0 for MoE models whose stacked experts get adapters).",
)
@click.option(
    "--lora-targets",
    default="all-linear",
    show_default=True,
    help="Comma-separated module names, or all-linear.",
)
@click.option(
    "--objective",
    type=click.Choice(OBJECTIVES),
    default="sft",
    show_default=True,
    help="dpo: --micro-batch counts preference pairs, each a chosen and a rejected sequence.",
)
@click.option(
    "--micro-batch", type=int, default=1, show_default=True, help="Sequences (DPO: pairs) per GPU."
)
@click.option("--seq-len", type=int, default=2048, show_default=True)
@click.option(
    "--gpus", type=int, default=1, show_default=True, help="GPUs the model is sharded over."
)
@click.option("--sharding", type=click.Choice(SHARDINGS), default="full", show_default=True)
@click.option(
    "--grad-accumulation",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step (a plan's gradientAccumulation; global batch = "
    "micro-batch × GPUs × this). Above 1 the earlier micro-batches' gradients are counted at "
    "every moment of the step (unsharded fp32 under FSDP); --simulate runs one micro-batch.",
)
@click.option("--cpu-offload/--no-cpu-offload", default=False, show_default=True)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="bf16",
    show_default=True,
)
@click.option(
    "--optimizer",
    type=click.Choice(OPTIMIZERS),
    default="adamw",
    show_default=True,
)
@click.option("--grad-ckpt/--no-grad-ckpt", default=True, show_default=True)
@click.option(
    "--attention",
    type=click.Choice(ATTENTIONS),
    default=None,
    help="Default: what the trainer runs for the model (eager for Gemma 2, else sdpa, with "
    "the packed rows' mask); varlen: packed rows by document bounds, no mask (the trainer "
    "on a GPU).",
)
@click.option(
    "--chunked-ce/--no-chunked-ce",
    default=False,
    show_default=True,
    help="The loss over chunks of tokens, without full-vocabulary fp32 logits.",
)
@click.option(
    "--fused-ce/--no-fused-ce",
    default=False,
    show_default=True,
    help="The output projection and the loss in one kernel (Liger's fused linear "
    "cross-entropy; other trainers' use_liger_kernel): nothing of vocabulary size kept.",
)
@click.option(
    "--loss-chunk-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per chunk of the chunked loss (default: the kubetune trainer's; LitGPT: 128).",
)
@click.option(
    "--activation-offload/--no-activation-offload",
    default=False,
    show_default=True,
    help="Activations saved for backward wait in host memory.",
)
@click.option(
    "--optimizer-in-backward/--no-optimizer-in-backward",
    default=False,
    show_default=True,
    help="Each parameter stepped as soon as its gradient is made, the gradient freed "
    "(full fine-tuning; accumulation 1).",
)
@click.option(
    "--fused-experts/--linear-experts",
    default=True,
    show_default=True,
    help="MoE experts as stacked parameters (transformers >= 5, the kubetune trainer) or one "
    "nn.Linear each (older stacks: quantized by QLoRA, adapted by all-linear).",
)
@click.option("--double-quant/--no-double-quant", default=True, show_default=True)
@click.option(
    "--qlora-matmul-keeps-input/--qlora-matmul-drops-input",
    default=True,
    show_default=True,
    help="QLoRA: whether the 4-bit matmul keeps its input for backward, as older bitsandbytes "
    "releases do (published measurements); the kubetune trainer's drops it, and `kubetune "
    "plan` estimates with that.",
)
@click.option("--allow-network", is_flag=True, help="Fetch config.json of unknown hub models.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--simulate",
    is_flag=True,
    help="Also run the trainer's step on fake tensors (needs the trainer extra) and print "
    "its breakdown next to the estimate.",
)
def estimate(
    config: str | None,
    model: str | None,
    list_models: bool,
    method: Method,
    lora_rank: int,
    lora_dropout: float,
    lora_targets: str,
    objective: TrainingObjective,
    micro_batch: int,
    seq_len: int,
    gpus: int,
    sharding: Sharding,
    grad_accumulation: int,
    cpu_offload: bool,
    precision: Precision,
    optimizer: Optimizer,
    grad_ckpt: bool,
    attention: Attention | None,
    chunked_ce: bool,
    fused_ce: bool,
    loss_chunk_tokens: int | None,
    activation_offload: bool,
    optimizer_in_backward: bool,
    fused_experts: bool,
    double_quant: bool,
    qlora_matmul_keeps_input: bool,
    allow_network: bool,
    as_json: bool,
    simulate: bool,
) -> None:
    """Estimate peak GPU memory per GPU for one training configuration.

    With --simulate, the trainer's own model build and training step also run on fake tensors
    (no weights, no GPU; docs/simulate.md) and both breakdowns are printed side by side."""
    if list_models:
        for name in known_models():
            click.echo(name)
        return
    arch = _arch(config, model, allow_network)
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    rows = micro_batch * (ROWS_PER_PAIR if objective == "dpo" else 1)
    setup = TrainingSetup(
        method=method,
        micro_batch=rows,
        seq_len=seq_len,
        gpus=gpus,
        sharding=sharding,
        grad_accumulation=grad_accumulation,
        cpu_offload=cpu_offload,
        precision=precision,
        optimizer=optimizer,
        grad_ckpt=grad_ckpt,
        lora_rank=lora_rank,
        lora_dropout=lora_dropout,
        lora_targets=targets,
        qlora_double_quant=double_quant,
        qlora_matmul_keeps_input=qlora_matmul_keeps_input,
        attention=attention or trainer_attention(arch),
        chunked_ce=chunked_ce,
        fused_ce=fused_ce,
        loss_chunk_tokens=loss_chunk_tokens,
        activation_offload=activation_offload,
        optimizer_in_backward=optimizer_in_backward,
        fused_experts=fused_experts,
    )
    try:
        est = estimate_vram(arch, setup)
    except EstimatorError as exc:
        raise Abort(str(exc)) from exc
    sim = _simulate(config, arch, setup, objective) if simulate else None
    if as_json:
        out = {**est.to_dict(), "model": arch.name, "objective": objective}
        if sim is not None:
            out["simulated"] = sim
        click.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    _echo_estimate(arch, setup, objective, micro_batch, est, sim)


def _echo_estimate(
    arch: ModelArch,
    setup: TrainingSetup,
    objective: TrainingObjective,
    micro_batch: int,
    est: VramEstimate,
    sim: dict[str, Any] | None,
) -> None:
    """The estimate as a table: the configuration in one line, then each term per GPU (with
    --simulate, beside the simulated one); `micro_batch` counts pairs for DPO."""
    dpo = objective == "dpo"
    batch = f"{micro_batch} pairs ({setup.micro_batch} sequences)" if dpo else f"{micro_batch}"
    click.echo(
        f"{arch.name}: {setup.method}{' DPO' if dpo else ''}, {setup.gpus} GPU(s), "
        f"micro-batch {batch} × {setup.seq_len} tokens"
        + (f" × {setup.grad_accumulation} accumulated" if setup.grad_accumulation > 1 else "")
        + f", {setup.precision}, {setup.optimizer}, "
        f"checkpointing {'on' if setup.grad_ckpt else 'off'}"
        + (", chunked loss" if setup.chunked_ce else "")
        + (", fused loss" if setup.fused_ce else "")
        + (", activations offloaded" if setup.activation_offload else "")
        + (", optimizer in backward" if setup.optimizer_in_backward else "")
    )
    click.echo(f"parameters {arch.total_params / 1e9:.2f} B, trainable {est.trainable_params:,}")
    if sim is not None:
        _echo_comparison(est.breakdown, sim)
        return
    width = max(len(k) for k in est.breakdown)
    for key, value in est.breakdown.items():
        click.echo(f"  {key:<{width}}  {value / GIB:8.2f} GiB")
    click.echo(f"  {'total per GPU':<{width}}  {est.per_gpu_gib:8.2f} GiB")


# What fake tensors cannot see; the simulated column takes these terms from the estimator.
_UNSIMULATED = ("cuda_context", "nccl_buffers", "allocator_slack")


def _config_fields(config: str | None, arch: ModelArch) -> dict[str, Any]:
    """The config.json fields of the model: the --config file, or the built-in table's row."""
    if config:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise Abort(f"--simulate: cannot read {path}: {exc}") from exc
        if not isinstance(fields, dict):
            raise Abort(f"--simulate: {path} is not a JSON object")
        text = fields.get("text_config")
        return dict(text) if isinstance(text, dict) and "model_type" in text else fields
    from kubetune.planning.models_table import MODELS

    for entry in MODELS:
        if entry.hf_id == arch.name:
            return dict(entry.config)
    raise Abort(
        f"--simulate needs the model's config.json fields, and {arch.name} is not in the "
        "built-in table. To fix: pass --config PATH/config.json."
    )


def _simulate(
    config: str | None, arch: ModelArch, setup: TrainingSetup, objective: TrainingObjective
) -> dict[str, Any]:
    """The trainer's step on fake tensors for `setup` (its DPO step for `objective` dpo: the
    simulation counts pairs where `setup` counts rows), with the terms fake tensors cannot see
    taken from the estimator's constants; a JSON-ready dict."""
    import dataclasses

    from kubetune.planning import estimator

    fields = _config_fields(config, arch)
    try:
        # Lazily: the operator runs without the trainer extra (pyproject's import contract
        # allows this one import besides kubetune_trainer.contract).
        from kubetune_trainer import simulate as sim_mod
    except ImportError as exc:
        raise Abort(
            f"--simulate runs the trainer's code, which needs torch and transformers ({exc}). "
            "To fix: pip install 'kubetune[trainer]' (the trainer extra), or drop --simulate."
        ) from exc
    names = {f.name for f in dataclasses.fields(sim_mod.SimulationSetup)}
    same = {k: v for k, v in dataclasses.asdict(setup).items() if k in names}
    if objective == "dpo":
        same.update(objective=objective, micro_batch=setup.micro_batch // ROWS_PER_PAIR)
    sim_setup = sim_mod.SimulationSetup(**same)
    try:
        result = sim_mod.simulate(fields, sim_setup)
    except (sim_mod.SimulationError, ValueError) as exc:
        raise Abort(f"--simulate: {exc}") from exc
    breakdown = {k: int(result.breakdown.get(k, 0)) for k in estimator.BREAKDOWN_COMPONENTS}
    transient = (
        breakdown["activations"]
        + breakdown["logits"]
        + breakdown["fsdp_buffers"]
        + breakdown["dequant_workspace"]
    )
    breakdown["cuda_context"] = estimator.CUDA_CONTEXT_BYTES
    breakdown["nccl_buffers"] = estimator.NCCL_BYTES if setup.gpus > 1 else 0
    breakdown["allocator_slack"] = round(
        max(estimator.ALLOCATOR_SLACK_MIN_BYTES, estimator.ALLOCATOR_SLACK_FRACTION * transient)
    )
    total = sum(breakdown.values())
    out: dict[str, Any] = result.to_dict()
    out.update(
        {
            "breakdown": breakdown,
            "breakdownGiB": {k: round(v / GIB, 3) for k, v in breakdown.items()},
            "perGPUBytes": total,
            "perGPUGiB": round(total / GIB, 3),
            "tensorPeakBytes": result.peak_bytes,
            "notSimulated": list(_UNSIMULATED),
        }
    )
    return out


def _echo_comparison(analytical: dict[str, int], sim: dict[str, Any]) -> None:
    simulated: dict[str, int] = sim["breakdown"]
    width = max(len(k) for k in analytical)
    click.echo(f"  {'component':<{width}}  {'estimate':>9}  {'simulated':>9}  {'difference':>10}")
    for key, value in analytical.items():
        other = simulated.get(key, 0)
        mark = " *" if key in _UNSIMULATED else ""
        click.echo(
            f"  {key:<{width}}  {value / GIB:9.2f}  {other / GIB:9.2f}  "
            f"{(other - value) / GIB:+10.2f}{mark}"
        )
    est_total = sum(analytical.values())
    sim_total = int(sim["perGPUBytes"])
    click.echo(
        f"  {'total per GPU':<{width}}  {est_total / GIB:9.2f}  {sim_total / GIB:9.2f}  "
        f"{(sim_total - est_total) / GIB:+10.2f}  GiB"
    )
    phases = sim["phases"]
    click.echo(
        "simulated on fake tensors ("
        + str(sim["method"])
        + f", {sim['seconds']:.1f} s): weights {phases['weights'] / GIB:.2f}, "
        f"after forward {phases['forward'] / GIB:.2f}, backward peak "
        f"{phases['backward_peak'] / GIB:.2f}, after optimizer step "
        f"{phases['optimizer'] / GIB:.2f}, peak {phases['peak'] / GIB:.2f} GiB "
        f"({sim['peakPhase'].replace('_', ' ')})"
    )
    click.echo(
        "* not visible to fake tensors: the simulated column takes these from the "
        "estimator's constants"
    )
