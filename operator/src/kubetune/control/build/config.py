"""The trainer's config: the job's spec with the plan's choices filled in, as the contract's
`TrainerConfig` (`kubetune_trainer.contract`), in a ConfigMap of its own per attempt (a
re-plan changes it); and the test faults an annotation asks of an attempt."""

from __future__ import annotations

import json
from typing import Any, get_args

from kubetune.api.errors import SpecError
from kubetune.api.v1alpha1 import FineTuneJob, PlanStatus
from kubetune.api.vocabulary import ANNOTATION_PLAN_REVISION, ANNOTATION_TEST_FAULTS
from kubetune.control.build.env import TOKEN_ENV
from kubetune.control.build.names import child_names, metadata, object_meta
from kubetune.control.build.paths import CHECKPOINT_DIR, CONFIG_KEY, OUTPUT_DIR, TRAIN_LOG
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import Location, locate, output_location, staged_in
from kubetune_trainer.contract import (
    CheckpointConfig,
    DatasetRef,
    DpoConfig,
    EarlyStoppingConfig,
    FaultInjection,
    InjectableOomPhase,
    JobRef,
    LoraConfig,
    MetricsConfig,
    ModelRef,
    OutputConfig,
    ParallelConfig,
    TrainerConfig,
    TrainingConfig,
)


def build_trainer_config(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> TrainerConfig:
    """The contract the trainer reads: the job's spec with the plan's choices filled in."""
    name, namespace, uid = metadata(job)
    spec = job.spec
    model_loc = locate(spec.model.uri, split_revision=True)
    dataset_loc = locate(spec.dataset.uri)
    staged = staged_in(job)
    if staged is not None:  # the stage-in step put them in the cache (or read them in place)
        model_loc = Location("path", str(staged.model_path))
        dataset_loc = Location("path", str(staged.dataset_path or dataset_loc.source))
    output_loc = output_location(job)
    lora = None
    if plan.method != "full":
        settings_lora = spec.lora_or_default
        lora = LoraConfig(
            rank=settings_lora.rank,
            alpha=settings_lora.alpha,
            dropout=settings_lora.dropout,
            target_modules=list(settings_lora.target_modules),
            double_quant=settings_lora.double_quant,
        )
    training = spec.training
    model, dataset = source_refs(job, model_loc, dataset_loc)
    return TrainerConfig(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        method=plan.method,
        model=model,
        dataset=dataset,
        lora=lora,
        training=TrainingConfig(
            epochs=training.epochs,
            max_steps=training.max_steps,
            total_steps=plan.total_steps,
            learning_rate=training.learning_rate,
            warmup_ratio=training.warmup_ratio,
            weight_decay=training.weight_decay,
            sequence_length=training.sequence_length,
            global_batch_size=training.global_batch_size,
            micro_batch_size=plan.micro_batch_size,
            gradient_accumulation=plan.gradient_accumulation,
            packing=training.packing,
            gradient_checkpointing=plan.gradient_checkpointing,
            precision=plan.precision,
            optimizer=plan.optimizer,
            chunked_cross_entropy=bool(plan.chunked_cross_entropy),
            fused_cross_entropy=bool(plan.fused_cross_entropy),
            activation_offloading=bool(plan.activation_offloading),
            optimizer_in_backward=bool(plan.optimizer_in_backward),
            seed=training.seed,
            objective=training.objective,
            dpo=DpoConfig(
                beta=dpo.beta if (dpo := training.dpo) else DpoConfig().beta,
                label_smoothing=dpo.label_smoothing if dpo else DpoConfig().label_smoothing,
            ),
            early_stopping=(
                EarlyStoppingConfig(**es.effective())
                if (es := training.early_stopping) is not None
                else None
            ),
        ),
        parallel=ParallelConfig(
            nodes=plan.nodes, gpus_per_node=plan.gpus_per_node, sharding=plan.sharding
        ),
        checkpoint=CheckpointConfig(
            dir=CHECKPOINT_DIR,
            interval_steps=spec.checkpoint.interval_steps,
            interval_minutes=spec.checkpoint.interval_minutes,
            keep=spec.checkpoint.keep,
            resume_from_uid=spec.checkpoint.resume_from_uid,
            attempt=attempt,
        ),
        output=OutputConfig(
            dir=output_loc.source if output_loc is not None else OUTPUT_DIR,
            merge_adapter=spec.output.merge_adapter,
        ),
        metrics=MetricsConfig(port=settings.metrics_port, log_path=TRAIN_LOG),
        faults=fault_injection(job, attempt) if settings.allow_test_faults else FaultInjection(),
    )


_STEP_FAULTS = {
    "oomAtStep": "oom_at_step",
    "hangAtStep": "hang_at_step",
    "killAtStep": "kill_at_step",
    "diskFullAtStep": "disk_full_at_step",
    "hostMemoryAtStep": "host_memory_at_step",
}
_OOM_PHASES: tuple[str, ...] = get_args(InjectableOomPhase)


def fault_injection(job: FineTuneJob, attempt: int) -> FaultInjection:
    """The fault injection the `kubetune.io/test-faults` annotation asks of this attempt."""
    annotations = job.metadata.get("annotations") or {}
    raw = annotations.get(ANNOTATION_TEST_FAULTS)
    if not raw:
        return FaultInjection()
    how = (
        'expected a JSON object such as {"oomAtStep": 6, "attempts": [1]} or '
        '{"stepSeconds": 0.3}: oomAtStep, hangAtStep, killAtStep (with killRank, default 0), '
        "diskFullAtStep or hostMemoryAtStep a step >= 1, oomInPhase one of "
        f"{', '.join(_OOM_PHASES)}, attempts a list of attempt numbers (default: every "
        "attempt), stepSeconds a least time per step in (0, 60]"
    )
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS} is not JSON ({exc})", how) from None
    known = {*_STEP_FAULTS, "oomInPhase", "killRank", "attempts", "stepSeconds"}
    if not isinstance(spec, dict) or set(spec) - known:
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS}={raw!r} is not understood", how)
    steps = {field: spec.get(key) for key, field in _STEP_FAULTS.items()}
    attempts, seconds = spec.get("attempts"), spec.get("stepSeconds")
    phase, rank = spec.get("oomInPhase"), spec.get("killRank", 0)
    # JSON numbers arrive as int or float; true/false are bools, which isinstance calls ints.
    step_ok = all(s is None or (type(s) is int and s >= 1) for s in steps.values())
    seconds_ok = seconds is None or (type(seconds) in (int, float) and 0 < seconds <= 60)
    attempts_ok = attempts is None or (
        isinstance(attempts, list) and all(isinstance(a, int) for a in attempts)
    )
    other_ok = (phase is None or phase in _OOM_PHASES) and type(rank) is int and rank >= 0
    asks = [*steps.values(), seconds, phase]
    if not (step_ok and seconds_ok and attempts_ok and other_ok) or all(a is None for a in asks):
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS}={raw!r} is not understood", how)
    if attempts is not None and attempt not in attempts:
        return FaultInjection()
    return FaultInjection(
        **steps,
        oom_in_phase=phase,
        kill_rank=rank,
        min_step_seconds=None if seconds is None else float(seconds),
    )


def build_config_map(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> dict[str, Any]:
    name, _, _ = metadata(job)
    config = build_trainer_config(job, plan, settings, attempt)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            job,
            child_names(name, attempt).config_map,
            attempt=attempt,
            annotations={ANNOTATION_PLAN_REVISION: str(plan.revision)},
        ),
        "data": {CONFIG_KEY: config.to_json()},
    }


def source_refs(
    job: FineTuneJob, model: Location, dataset: Location
) -> tuple[ModelRef, DatasetRef]:
    """The contract's model and dataset references for where they are read from."""
    spec = job.spec
    return (
        ModelRef(
            source=model.source,
            kind=model.kind,
            revision=spec.model.revision or model.revision,
            token_env=TOKEN_ENV if spec.model.token_secret_ref is not None else None,
        ),
        DatasetRef(
            source=dataset.source,
            kind=dataset.kind,
            revision=spec.dataset.revision if dataset.kind == "hub" else None,
            format=spec.dataset.format,
            validation_split=spec.dataset.validation_split,
        ),
    )
