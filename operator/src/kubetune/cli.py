"""`kubetune` command line: estimate memory, plan jobs offline, render CRDs, run the operator."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from kubetune.api.errors import KubetuneError
from kubetune.api.hints import did_you_mean
from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import CHAIN_SCHEME, FineTuneJob, GPUPool, Objective
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import single_node
from kubetune.planning.arch import ArchitectureError, ModelArch, known_models
from kubetune.planning.catalog import default_pools
from kubetune.planning.estimator import (
    ATTENTIONS,
    Attention,
    EstimatorError,
    TrainingSetup,
    estimate_vram,
    trainer_attention,
)
from kubetune.planning.planner import Plan, PlannerSettings, plan_job
from kubetune.planning.throughput import ROWS_PER_PAIR
from kubetune.sources import load_arch
from kubetune.views import (
    ObjectWatcher,
    describe_job,
    dump,
    hours,
    job_table,
    log_sources,
    outcome,
    pool_table,
)
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

GIB = 1024**3


class Abort(click.ClickException):
    """An error printed as-is (our messages already say how to fix them)."""

    def format_message(self) -> str:
        return self.message


COMMANDS_ENTRY_POINTS = "kubetune.commands"
"""Entry point group through which other distributions add commands: the local tooling
(operator/dev, distribution `kubetune-dev`) adds `kubetune dev` and `kubetune demo`."""

_TOOLING_COMMANDS = {
    "dev": "a local control plane with simulated GPU pools",
    "demo": "the end-to-end demo on a local control plane",
}


def _registered() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_ENTRY_POINTS)}


class _Commands(click.Group):
    """The built-in commands plus the registered ones, each imported only when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_registered()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        entry = _registered().get(cmd_name)
        if entry is not None:
            loaded = entry.load()
            if not isinstance(loaded, click.Command):
                raise Abort(f"entry point {entry.value} is not a click command")
            return loaded
        if cmd_name in _TOOLING_COMMANDS:
            return _missing_tooling(cmd_name)
        return None


def _missing_tooling(name: str) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def missing(args: tuple[str, ...]) -> None:
        raise Abort(
            f"`kubetune {name}` ({_TOOLING_COMMANDS[name]}) is part of the local tooling, "
            "which is not installed. To fix: run `make setup` in a kubetune checkout, or "
            "`pip install -e operator/dev` there."
        )

    return missing


@click.group(cls=_Commands)
@click.version_option(package_name="kubetune")
def main() -> None:
    """kubetune: right-sized, cost-aware LLM fine-tuning on Kubernetes."""


# ---------------------------------------------------------------------- estimate


def _arch(config: str | None, model: str | None, allow_network: bool) -> ModelArch:
    if not config and not model:
        raise click.UsageError("pass --model ID (see --list-models) or --config PATH/config.json")
    try:
        return load_arch(config or model or "", allow_network=allow_network)
    except ArchitectureError as exc:
        raise Abort(str(exc)) from exc


@main.command()
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
        out = est.to_dict()
        out["model"] = arch.name
        out["objective"] = objective
        if sim is not None:
            out["simulated"] = sim
        click.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    batch = f"{micro_batch} pairs ({rows} sequences)" if objective == "dpo" else f"{micro_batch}"
    click.echo(
        f"{arch.name}: {method}{' DPO' if objective == 'dpo' else ''}, {gpus} GPU(s), "
        f"micro-batch {batch} × {seq_len} tokens"
        + (f" × {grad_accumulation} accumulated" if grad_accumulation > 1 else "")
        + f", {precision}, {optimizer}, checkpointing {'on' if grad_ckpt else 'off'}"
        + (", chunked loss" if chunked_ce else "")
        + (", fused loss" if fused_ce else "")
        + (", activations offloaded" if activation_offload else "")
        + (", optimizer in backward" if optimizer_in_backward else "")
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


# ---------------------------------------------------------------------- plan


def _load_yaml_docs(path: str) -> list[dict[str, Any]]:
    """The objects of a YAML file (`-`: stdin), the items of a `List` (what `kubectl get
    -o yaml` prints) included."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise Abort(f"cannot read {_source(path)}: {exc}") from exc
    objects: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise Abort(f"{_source(path)}: expected Kubernetes objects, found {doc!r:.60}")
        if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
            objects.extend(item for item in doc["items"] if isinstance(item, dict))
        else:
            objects.append(doc)
    return objects


def _source(path: str) -> str:
    return "stdin" if path == "-" else path


def load_pools(path: str | None) -> list[GPUPool]:
    if path is None:
        return default_pools()
    pools = []
    for doc in _load_yaml_docs(path):
        if doc.get("kind") != "GPUPool":
            continue
        try:
            pools.append(GPUPool.model_validate(doc))
        except ValidationError as exc:
            name = doc.get("metadata", {}).get("name")
            raise Abort(f"{_source(path)}: GPUPool {name}: {exc}") from exc
    if not pools:
        raise Abort(
            f"{_source(path)} holds no GPUPool objects. To fix: pass a file of GPUPools "
            "(examples/gpupools.yaml), or your cluster's: kubectl get gpupools -o yaml | "
            "kubetune plan JOB.yaml --pools -"
        )
    return pools


def load_job(path: str, name: str | None = None) -> FineTuneJob:
    """The FineTuneJob of `path` (the one called `name` in a file of several). A model that is
    another job of the same file (`ftj://<name>`) is planned as that job's model."""
    docs = [d for d in _load_yaml_docs(path) if d.get("kind") == "FineTuneJob"]
    names = [str((d.get("metadata") or {}).get("name")) for d in docs]
    if name is not None:
        if name not in names:
            raise Abort(f"{path}: no FineTuneJob {name!r} (it holds {', '.join(names) or 'none'})")
        chosen = docs[names.index(name)]
    elif len(docs) == 1:
        chosen = docs[0]
    else:
        raise Abort(
            f"{path}: expected one FineTuneJob, found {len(docs)} ({', '.join(names)}). "
            "To fix: pass --job NAME"
        )
    job = _validated_job(path, chosen)
    uri = job.spec.model.uri
    upstream = uri[len(CHAIN_SCHEME) :] if uri.startswith(CHAIN_SCHEME) else None
    if upstream in names and job.spec.model.architecture is None:
        before = _validated_job(path, docs[names.index(upstream)]).spec.model
        known = before.architecture or (None if "://" in before.uri else before.uri)
        model = job.spec.model.model_copy(update={"architecture": known})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})
    return job


def _validated_job(path: str, doc: Mapping[str, Any]) -> FineTuneJob:
    try:
        # Field names as the API server takes them: camelCase only.
        return FineTuneJob.model_validate(doc, by_alias=True, by_name=False)
    except ValidationError as exc:
        lines = [f"{path}: invalid FineTuneJob:"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            hint = None
            if err["type"] == "extra_forbidden":
                hint = did_you_mean(err["loc"])
            lines.append(f"  {loc}: {err['msg']}" + (f"; {hint}" if hint else ""))
        raise Abort("\n".join(lines)) from exc


def format_plan(plan: Plan, objective_defaulted: bool = False) -> str:
    """The plan as a table: the chosen configuration (*) and the best of each other pool,
    with each one's memory headroom per GPU; `objective_defaulted`: the job left
    spec.resources.objective unset."""
    c = plan.chosen
    rows = [c, *plan.alternatives]
    width = max(len("POOL"), *(len(r.pool) for r in rows)) + 2
    lines = [
        f"{'':2}{'POOL':<{width}}{'METHOD':<7}{'GPUS':>5}{'NODES':>6}{'SHARD':>8}"
        f"{'MICRO×ACC':>11}{'CKPT':>6}{'GiB/GPU':>9}{'HEADROOM':>10}{'TOK/S':>10}{'TIME':>8}"
        f"{'COST':>11}"
    ]
    for i, r in enumerate(rows):
        mark = "* " if i == 0 else "  "
        used = r.estimate.per_gpu_bytes / GIB
        lines.append(
            f"{mark}{r.pool:<{width}}{r.method:<7}{r.total_gpus:>5}{r.nodes:>6}{r.sharding:>8}"
            f"{f'{r.micro_batch}×{r.grad_accum}':>11}{'on' if r.grad_ckpt else 'off':>6}"
            f"{used:>9.1f}{f'{(r.gpu_memory_gib - used) / r.gpu_memory_gib:.0%}':>10}"
            f"{r.tokens_per_second:>10,.0f}{hours(r.duration_s):>8}{f'${r.cost:,.2f}':>11}"
        )
    lines.append("")
    lines.append(
        f"steps {plan.total_steps:,}, tokens {plan.total_tokens:,}, objective {plan.objective}"
        + (" (the default: the job sets no resources.objective)" if objective_defaulted else "")
        + (" (dataset size assumed: set spec.dataset.totalTokens)" if plan.dataset.assumed else "")
    )
    if c.queued:
        lines.append("capacity: the chosen pool has no free GPUs right now; the job would queue")
    savers = [
        name
        for name, on in (
            ("chunked cross-entropy", c.estimate.setup.chunked_ce),
            ("fused cross-entropy", c.estimate.setup.fused_ce),
            ("activation offloading", c.estimate.setup.activation_offload),
            ("optimizer in backward", c.estimate.setup.optimizer_in_backward),
        )
        if on
    ]
    if savers:
        lines.append(f"memory savers: {', '.join(savers)}")
    lines.append(
        "memory per GPU (GiB): "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in c.estimate.breakdown.items() if v)
    )
    if plan.rejected:
        lines.append("rejected pools:")
        for rejection in plan.rejected:
            lines.append(f"  {rejection.pool}: {rejection.message}")
    return "\n".join(lines)


@main.command()
@click.argument("job_file", type=click.Path(exists=True))
@click.option(
    "--pools",
    "pools_file",
    type=click.Path(exists=True, allow_dash=True),
    help="GPUPools to plan against: a YAML file, or - for stdin (e.g. `kubectl get gpupools "
    "-o yaml`); default: the built-in catalog.",
)
@click.option(
    "--from-cluster",
    is_flag=True,
    help="Plan against the cluster's GPUPools and their free GPUs now (current kubeconfig).",
)
@click.option("--kubeconfig", default=None, help="With --from-cluster: this kubeconfig file.")
@click.option("--context", default=None, help="With --from-cluster: this kubeconfig context.")
@click.option(
    "--safety-factor", type=float, default=PlannerSettings.safety_factor, show_default=True
)
@click.option(
    "--default-objective",
    type=click.Choice(["cost", "time"]),
    default=PlannerSettings.default_objective,
    show_default=True,
    help="Objective of a job without spec.resources.objective (the operator's "
    "KUBETUNE_DEFAULT_OBJECTIVE).",
)
@click.option(
    "--read-write-many",
    is_flag=True,
    help="The checkpoint StorageClass offers ReadWriteMany (the operator's "
    "KUBETUNE_CHECKPOINT_READ_WRITE_MANY): a job with spec.checkpoint.storage.accessMode auto "
    "may span nodes. Without it, as the operator by default, such a job stays on one node.",
)
@click.option("--allow-network", is_flag=True, help="Fetch config.json of unknown hub models.")
@click.option(
    "--output",
    "-o",
    type=click.Choice(["table", "json", "yaml"]),
    default="table",
    show_default=True,
    help="json|yaml: status.plan as the operator would write it.",
)
@click.option("--json", "as_json", is_flag=True, hidden=True, help="The same as -o json.")
@click.option(
    "--job", "job_name", default=None, help="In a file of several FineTuneJobs: the one to plan."
)
def plan(
    job_file: str,
    pools_file: str | None,
    from_cluster: bool,
    kubeconfig: str | None,
    context: str | None,
    safety_factor: float,
    default_objective: Objective,
    read_write_many: bool,
    allow_network: bool,
    output: str,
    as_json: bool,
    job_name: str | None,
) -> None:
    """Plan a FineTuneJob offline: the chosen pool, GPUs, method, time and cost."""
    output = "json" if as_json else output
    job = load_job(job_file, job_name)
    if from_cluster and pools_file:
        raise Abort("--from-cluster and --pools both say where pools come from: pass one")
    if (kubeconfig or context) and not from_cluster:
        raise Abort("--kubeconfig and --context only mean something with --from-cluster")
    unreadable: list[str] = []
    tenant: Tenant | None = None
    tenant_note = ""
    if from_cluster:
        from kubetune.controller.readers import cluster_pools, cluster_tenant

        try:
            pools, unreadable = cluster_pools(10.0, kubeconfig, context)
        except Exception as exc:  # no kubeconfig, unreachable, forbidden
            raise Abort(f"cannot read the cluster's GPUPools: {exc}") from exc
        namespace = job.metadata.get("namespace")
        try:
            tenant = cluster_tenant(10.0, kubeconfig, context, namespace)
            tenant_note = f"; for namespace {tenant.name} (pools' namespaceSelectors applied)"
        except Exception as exc:  # e.g. a user who may not read Namespaces
            tenant_note = (
                f"; namespaceSelectors not applied (cannot read namespace "
                f"{namespace or 'of the context'}: {exc})"
            )
        if not pools:
            raise Abort(
                "the cluster has no GPUPool kubetune can read. To fix: create pools "
                "(examples/gpupools.yaml, or the chart's gpuPools)"
                + "".join(f"\n  {line}" for line in unreadable)
            )
    else:
        pools = load_pools(pools_file)
    model = job.spec.model.architecture or job.spec.model.uri
    # As the operator decides before the job's checkpoint volume exists.
    held = single_node(job, BuildSettings(checkpoint_read_write_many=read_write_many), None)
    try:
        arch = load_arch(model, allow_network=allow_network)
        result = plan_job(
            job.spec,
            pools,
            arch,
            PlannerSettings(
                safety_factor=safety_factor,
                default_objective=default_objective,
                # From the cluster, the pools' status says what is free now.
                use_live_capacity=from_cluster,
                tenant=tenant,
                single_node_reason=None if held is None else held.reason,
                single_node_fix="" if held is None else held.fix,
            ),
            # Every pool's best, not only the three runners-up the operator records.
            alternatives=len(pools),
        )
    except (KubetuneError, ArchitectureError, EstimatorError) as exc:
        raise Abort(str(exc)) from exc
    if output != "table":
        _dump(result.to_status(pools).to_wire(), output)
        return
    click.echo(f"{job.metadata.get('name', job_file)}: {arch.name}")
    if from_cluster:
        click.echo(f"pools: {len(pools)} from the cluster, with their free GPUs now{tenant_note}")
        for line in unreadable:
            click.echo(f"  {line}")
    elif pools_file is None:
        click.echo(
            f"pools: the built-in catalog ({len(pools)} pools, list prices); "
            "--pools or --from-cluster for yours"
        )
    else:
        click.echo(f"pools: {len(pools)} from {_source(pools_file)}")
    click.echo(format_plan(result, objective_defaulted=job.spec.resources.objective is None))


# ---------------------------------------------------------------------- the cluster


def _dump(value: dict[str, Any], output: str) -> None:
    """`value` as JSON or YAML (`output`), as kubectl prints objects."""
    click.echo(dump(value, output))


def _print_objects(objects: list[dict[str, Any]], output: str, as_table: str) -> None:
    if output == "table":
        click.echo(as_table)
    else:
        _dump({"apiVersion": "v1", "kind": "List", "items": objects}, output)


def _namespace_option(fn: Any) -> Any:
    return click.option(
        "--namespace", "-n", default=None, help="Namespace (default: the context's)."
    )(fn)


def _connection_options(fn: Any) -> Any:
    fn = click.option("--context", default=None, help="Kubeconfig context (default: current).")(fn)
    return click.option("--kubeconfig", default=None, help="Kubeconfig file (default: the usual).")(
        fn
    )


def _cluster_options(fn: Any) -> Any:
    fn = click.option(
        "--output", "-o", type=click.Choice(["table", "json", "yaml"]), default="table",
        show_default=True,
    )(fn)  # fmt: skip
    return _connection_options(fn)


@main.command(name="get")
@_namespace_option
@click.option("--all-namespaces", "-A", is_flag=True, help="Jobs of every namespace.")
@_cluster_options
def get_jobs(
    namespace: str | None, all_namespaces: bool, kubeconfig: str | None, context: str | None,
    output: str,
) -> None:  # fmt: skip
    """List FineTuneJobs: phase, pool, GPUs, progress, ETA, cost spent of the estimate."""
    from kubetune.controller.readers import cluster_jobs

    try:
        jobs, where = cluster_jobs(10.0, kubeconfig, context, namespace, all_namespaces)
    except Exception as exc:  # no kubeconfig, unreachable, forbidden
        raise Abort(f"cannot read FineTuneJobs: {exc}") from exc
    if not jobs and output == "table":
        click.echo(f"no FineTuneJobs in {'any namespace' if where == '*' else where}")
        return
    _print_objects(jobs, output, job_table(jobs, namespaces=all_namespaces))


@main.command()
@click.argument("name")
@_namespace_option
@_cluster_options
def describe(
    name: str, namespace: str | None, kubeconfig: str | None, context: str | None, output: str
) -> None:
    """One FineTuneJob: its plan and the alternatives, memory per GPU, progress, cost,
    checkpoint, recoveries, conditions and recent Events."""
    from lightkube.core.exceptions import ApiError

    from kubetune.controller.readers import job_with_events

    try:
        job, events = job_with_events(10.0, name, kubeconfig, context, namespace)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except Exception as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc}") from exc
    if output == "table":
        click.echo(describe_job(job, events))
    else:
        _dump(job, output)


@main.command()
@click.argument("name")
@_namespace_option
@click.option(
    "--interval", default=2.0, show_default=True, help="Seconds between looks at the job."
)
@click.option(
    "--timeout", type=float, default=None, help="Give up after this many seconds (exit 2)."
)
@_cluster_options
def watch(
    name: str,
    namespace: str | None,
    interval: float,
    timeout: float | None,
    kubeconfig: str | None,
    context: str | None,
    output: str,
) -> None:
    """Follow a FineTuneJob until it ends: its plan, progress, checkpoints, cost and Events
    as they change (-o json|yaml: the object each time it changes). Exits 0 when it
    succeeds, 1 when it fails, 2 on --timeout."""
    from lightkube.core.exceptions import ApiError

    from kubetune.controller.readers import client, watch_job

    deadline = time.monotonic() + timeout if timeout is not None else None
    try:
        with client(10.0, kubeconfig, context) as api:
            where = namespace or api.namespace or "default"
            watcher = None if output == "table" else ObjectWatcher(output)
            job = watch_job(api, name, where, click.echo, interval, deadline, watcher)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # no kubeconfig, unreachable
        raise Abort(f"cannot read FineTuneJob {name}: {exc}") from exc
    if job is None:
        click.echo(f"still not finished after {timeout:g}s", err=True)
        sys.exit(2)
    status = job.get("status") or {}
    if output == "table":
        message = f": {status['message']}" if status.get("message") else ""
        click.echo(f"{name} {status['phase']}{message}")
    sys.exit(0 if status["phase"] == "Succeeded" else 1)


@main.command()
@click.argument("name")
@_namespace_option
@click.option(
    "--attempt", type=int, default=None, help="Which launch of the trainer (default: the latest)."
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="Only this global rank: the pod that runs it, its own lines and those that name no "
    "rank (default: every pod, each line prefixed with attempt and node).",
)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the pods end.")
@click.option("--tail", type=int, default=None, help="Only the last N lines of each pod.")
@_connection_options
def logs(
    name: str,
    namespace: str | None,
    attempt: int | None,
    rank: int | None,
    follow: bool,
    tail: int | None,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Print the trainer's log of a FineTuneJob: one attempt, every node or one rank."""
    from lightkube.core.exceptions import ApiError

    from kubetune.controller.kube import FineTuneJobResource
    from kubetune.controller.readers import client, stream_logs, trainer_pods

    try:
        with client(10.0, kubeconfig, context) as api:
            where = namespace or api.namespace or "default"
            job = api.get(FineTuneJobResource, name, namespace=where).to_dict()  # type: ignore[no-untyped-call]
            status = job.get("status") or {}
            latest = int(status.get("attempt") or 0)
            if latest == 0:
                raise Abort(
                    f"FineTuneJob {name} has not launched a trainer yet (phase "
                    f"{status.get('phase') or 'Pending'}): `kubetune watch {name}` follows it"
                )
            wanted = attempt if attempt is not None else latest
            if not 1 <= wanted <= latest:
                raise Abort(f"FineTuneJob {name} has attempts 1 to {latest}, not {wanted}")
            pods = trainer_pods(api, name, where, wanted)
            if not pods:
                raise Abort(
                    f"attempt {wanted} of {name} has no pods "
                    + ("yet" if wanted == latest and not outcome(job) else "left")
                    + ": the operator deletes an attempt's batch Job (and its pods) when it "
                    "stops or replaces it; the trainer's own record of every attempt is "
                    "train-log.jsonl on the checkpoint volume"
                )
            try:
                sources = log_sources(pods, wanted, rank)
            except ValueError as exc:
                raise Abort(str(exc)) from exc
            problems = stream_logs(api, where, sources, click.echo, follow, tail)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except KeyboardInterrupt:
        sys.exit(130)
    except Abort:
        raise
    except Exception as exc:  # no kubeconfig, unreachable
        raise Abort(f"cannot read the logs of {name}: {exc}") from exc
    if problems:
        raise Abort("\n".join(problems))


@main.command()
@_cluster_options
def pools(kubeconfig: str | None, context: str | None, output: str) -> None:
    """List the cluster's GPUPools: GPU, nodes, free GPUs, price, and whether they are read."""
    from kubetune.controller.readers import pool_objects

    try:
        objects = pool_objects(10.0, kubeconfig, context)
    except Exception as exc:
        raise Abort(f"cannot read GPUPools: {exc}") from exc
    if not objects and output == "table":
        click.echo("no GPUPools: create some (examples/gpupools.yaml, or the chart's gpuPools)")
        return
    _print_objects(objects, output, pool_table(objects))


# ---------------------------------------------------------------------- crds / operator


@main.command()
@click.option(
    "--out", "outdir", type=click.Path(), default=None, help="Write files here instead of stdout."
)
def crds(outdir: str | None) -> None:
    """Print (or write) the CustomResourceDefinitions."""
    from kubetune.api.crdgen import render_all

    files = render_all()
    if outdir is None:
        click.echo("---\n".join(files.values()))
        return
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        click.echo(f"wrote {out / name}")


@main.command()
@click.option(
    "--operator-url",
    default=None,
    help="The operator's metrics endpoint, e.g. http://kubetune-metrics.kubetune-system:8000"
    "/metrics (the chart's `helm test` passes its Service); without it only the CRDs are checked.",
)
@click.option("--timeout", default=10.0, show_default=True, help="Seconds per request.")
def check(operator_url: str | None, timeout: float) -> None:
    """Check an installation: the CRDs are established and the operator answers.

    Uses the current kubeconfig (in a pod: its service account). Exits 1 when anything
    fails, each failure saying what to look at.
    """
    from kubetune.controller.readers import run_checks

    try:
        findings = run_checks(operator_url, timeout)
    except Exception as exc:  # the API server itself: unreachable, forbidden
        raise Abort(f"cannot read the cluster's CRDs: {exc}") from exc
    for finding in findings:
        click.echo(finding.line())
    if not all(f.ok for f in findings):
        sys.exit(1)


@main.command()
@click.option(
    "--namespace", "-n", multiple=True, help="Watch only these namespaces (default: all)."
)
@click.option(
    "--liveness",
    default="http://0.0.0.0:8080/healthz",
    show_default=True,
    help="Liveness endpoint (/healthz); a standby replica answers it too.",
)
@click.option(
    "--log-format",
    type=click.Choice(["plain", "full", "json"]),
    default="full",
    show_default=True,
)
@click.option("--quiet", "-q", "log_level", flag_value="quiet", help="Warnings and errors only.")
@click.option("--verbose", "-v", "log_level", flag_value="verbose", help="Debug logging.")
@click.option("--debug", "-d", "log_level", flag_value="debug", help="Debug logging.")
def operator(
    namespace: tuple[str, ...], liveness: str, log_format: str, log_level: str | None
) -> None:
    """Run the operator (kopf) against the current kubeconfig / in-cluster config.

    One replica runs standalone. With KUBETUNE_LEADER_ELECTION=true several replicas share
    a Lease and only its holder works (docs/operations.md).
    """
    from kubetune.controller.leader import leader_settings_from_env
    from kubetune.controller.run import configure_logging, run_operator

    try:
        settings = leader_settings_from_env()
    except ValueError as exc:
        raise Abort(str(exc)) from exc
    configure_logging(log_format, log_level or "normal")
    sys.exit(run_operator(namespace, liveness, settings))


def kubectl_plugin() -> None:
    """`kubectl kubetune ...`: kubectl runs the `kubectl-kubetune` executable it finds on
    PATH with the words after `kubetune` (its own flags before it are not passed on: the
    kubeconfig comes from $KUBECONFIG, or --kubeconfig after the verb)."""
    main(prog_name="kubectl kubetune")


if __name__ == "__main__":
    main()
