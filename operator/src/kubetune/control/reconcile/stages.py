"""The CPU steps around training: the stage-in step before planning (fetch, check and measure
the model and data), and after training the GGUF export and the stage-out upload. Each is a
batch Job whose pod's termination message carries its result."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetune.api.errors import InfeasibleError, SpecError
from kubetune.api.units import size
from kubetune.api.v1alpha1 import (
    ExportStatus,
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    ProgressStatus,
    StageInStatus,
    StageOutStatus,
)
from kubetune.api.vocabulary import ConditionType, Reason, StepKind
from kubetune.control import pods as p
from kubetune.control.build.names import child_names
from kubetune.control.build.stages import (
    build_export,
    build_stage_in,
    build_stage_out,
    fetched_sources,
    gguf_uri,
    needs_export,
    needs_stage_in,
    needs_stage_out,
)
from kubetune.control.build.storage import CACHE_CLAIM
from kubetune.control.conditions import get_condition
from kubetune.control.reconcile.context import Context, ControllerSettings, Observed, measured_spec
from kubetune.control.reconcile.policy import refused
from kubetune.planning.arch import ArchitectureError
from kubetune.planning.estimator import EstimatorError
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    ExportResult,
    StageInResult,
    StageOutResult,
)


@dataclass(frozen=True)
class _AfterTraining:
    """A CPU step that runs after training succeeded, for `_after_training`."""

    kind: StepKind
    batch: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    build: Callable[[], list[dict[str, Any]]]
    """The step's objects; raises SpecError."""
    doing: Callable[[], str]
    """What the step does, for status.message, the condition and the Event."""
    record: Callable[[str], str | None]
    """Record the step's result (its termination message) in status and return the summary;
    None when the message holds no result."""
    kept: str
    """What is left where, when the step fails."""
    again: str
    """The verb for running the step again without training ("export", "upload")."""
    fixed: str
    """What to fix in the spec first, as "the fixed … and " (or nothing)."""


_STEP_CONDITIONS: dict[StepKind, tuple[ConditionType, Reason, Reason]] = {
    StepKind.EXPORT: (ConditionType.EXPORTED, Reason.EXPORTING, Reason.EXPORTED),
    StepKind.STAGE_OUT: (ConditionType.UPLOADED, Reason.UPLOADING, Reason.UPLOADED),
}
"""The condition of a step after training and its reasons while it runs and once done (its
failure's is in `_STEP_FAILURES`)."""


_STEP_VERBS: dict[StepKind, tuple[str, str]] = {
    StepKind.STAGE_IN: ("staging in", "is fetching and measuring"),
    StepKind.EXPORT: ("exporting to GGUF", "is converting the model"),
    StepKind.STAGE_OUT: ("uploading the output", "is uploading"),
}
"""What status.message says while a step's pod waits or runs."""


_STEP_FAILURES: dict[StepKind, Reason] = {
    StepKind.STAGE_IN: Reason.STAGE_IN_FAILED,
    StepKind.EXPORT: Reason.EXPORT_FAILED,
    StepKind.STAGE_OUT: Reason.UPLOAD_FAILED,
}


def may_create_stage_in(job: FineTuneJob, observed: Observed, settings: ControllerSettings) -> bool:
    """Whether a reconcile of `job` may create its stage-in step: only then does it need
    `Observed.cache_in_use` (what the step's cache eviction must keep)."""
    if observed.stage_in_job is not None or not needs_stage_in(job, settings.build):
        return False
    return job.status is None or not _staged_in(job.status)


def _staged_in(status: FineTuneJobStatus) -> bool:
    """Whether the stage-in step finished for the job (status.stageIn has its result, not
    only progress)."""
    return status.stage_in is not None and status.stage_in.model_path is not None


def _assumed_tokens(spec: FineTuneJobSpec) -> int | None:
    """Tokens of one epoch the spec's hints give (None: the planner's default assumption)."""
    data = spec.dataset
    if data.total_tokens is not None:
        return data.total_tokens
    if data.num_examples is not None and data.avg_tokens_per_example is not None:
        return data.num_examples * data.avg_tokens_per_example
    return None


def staging_in(ctx: Context) -> bool:
    """Run the stage-in step of a job with S3 sources before planning its launch: create
    it, follow it, fail the job with its reason, or take its measurements. True while it
    holds the job."""
    build = ctx.settings.build
    if not needs_stage_in(ctx.job, build) or _staged_in(ctx.s):
        return False
    batch = ctx.observed.stage_in_job
    if batch is None and _unplannable_before_staging(ctx):
        return True
    ctx.d.requeue_after = ctx.settings.poll_seconds
    if batch is None:
        if refused(ctx):
            return True
        try:
            keep = ctx.observed.cache_in_use
            ctx.d.create.extend(build_stage_in(ctx.job, build, keep_paths=keep))
        except SpecError as exc:
            ctx.fail(Reason.INVALID_SPEC, str(exc))
            return True
        ctx.go.plan()
        fetched = fetched_sources(ctx.job, build)
        what = (
            f"fetching {' and '.join(fetched)} into the namespace's cache (claim "
            f"{CACHE_CLAIM}), then checking and measuring the model and data"
            if fetched
            else f"reading the config.json of {ctx.job.spec.model.uri} and measuring "
            f"{ctx.job.spec.dataset.uri} (spec.model.architecture is unset)"
        )
        if get_condition(ctx.s.conditions, ConditionType.STAGED_IN) is None:
            ctx.d.event(Reason.STAGING_IN, what)
        ctx.go.condition(ConditionType.STAGED_IN, False, Reason.STAGING_IN, what)
        ctx.s.message = f"staging in: {what}"
        return True
    end = _step_ended(ctx, StepKind.STAGE_IN, batch, ctx.observed.stage_in_pods)
    if end is None:
        _show_stage_in_progress(ctx)
        return True
    if end.code == 0:
        staged = _parse_stage_in(end.message)
        if staged is None:
            ctx.fail(Reason.STAGE_IN_FAILED, _no_result(StepKind.STAGE_IN, batch, end))
            return True
        staged.assumed_tokens = _assumed_tokens(ctx.job.spec)
        ctx.s.stage_in = staged
        ctx.spec = measured_spec(ctx.job.spec, staged)
        # The trainer's children read where the files are from the job's status.
        ctx.job = ctx.job.model_copy(update={"status": ctx.s})
        summary = (
            f"staged in: {staged.examples} examples, {staged.tokens} tokens per epoch "
            f"(the plan assumed {staged.assumed_tokens}); {staged.downloaded_bytes} bytes "
            f"fetched, {staged.reused_bytes} reused from the cache"
        )
        ctx.go.condition(ConditionType.STAGED_IN, True, Reason.STAGED_IN, summary)
        ctx.d.event(Reason.STAGED_IN, summary)
        return False
    why = "a permanent failure" if end.code == EXIT_CONFIG_ERROR else "failed repeatedly"
    ctx.fail(Reason.STAGE_IN_FAILED, f"the stage-in step {why}: {end.message[-600:]}")
    return True


def _unplannable_before_staging(ctx: Context) -> bool:
    """Fail a job no pool could ever run before its model is fetched (a 405B model on
    one GPU), when its architecture is known without the files. An architecture only
    the files tell is read by the stage-in step; one spec.model.architecture names
    wrongly fails now."""
    if not ctx.observed.pools:
        return False
    try:
        arch = ctx.model_arch()
        ctx.plan_job(ctx.spec, ctx.observed.pools, arch, ctx.for_job(ctx.settings.planner))
    except ArchitectureError as exc:
        if ctx.spec.model.architecture is None:
            return False
        ctx.unplannable(Reason.UNKNOWN_ARCHITECTURE, str(exc))
        return True
    except InfeasibleError as exc:
        ctx.unplannable(Reason.INFEASIBLE, str(exc))
        return True
    except EstimatorError:
        return False  # said by the plan after the stage-in, with the model's own config
    return False


def _show_stage_in_progress(ctx: Context) -> None:
    """status.stageIn's bytes and files so far, from the stage-in pod's gauges."""
    scraped = ctx.observed.stage_in_metrics
    if not scraped:
        return
    done, total = (int(scraped.get(f"bytes_{k}", 0)) for k in ("done", "total"))
    files_done, files_total = (int(scraped.get(f"files_{k}", 0)) for k in ("done", "total"))
    ctx.s.stage_in = StageInStatus(
        bytes_done=done, bytes_total=total, files_done=files_done, files_total=files_total
    )
    if total:
        ctx.s.message = (
            f"staging in: {size(done)} of {size(total)}, {files_done} of {files_total} files"
        )
        # The Progress column of `kubectl get` until the launch counts steps instead.
        ctx.s.progress = ProgressStatus(summary=f"stage-in {size(done)}/{size(total)}")


def _step_ended(
    ctx: Context, kind: StepKind, batch: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
) -> p.StepEnd | None:
    """How a CPU step's Job ended: its last pod's exit, with code 0 when the Job
    succeeded and the pod's code (never 0) when it failed. None while it runs: then
    status.message says what its pod does, and a pod that does not start within the
    startup timeout fails the job."""
    status = batch.get("status") or {}
    end = p.step_end(pods, kind)
    if p.job_succeeded(status):
        return p.StepEnd(0, end.message)
    if p.job_failed(status):
        return p.StepEnd(end.code or 1, end.message)
    verb, doing = _STEP_VERBS[kind]
    running = [p.pod_name(pod) for pod in pods if p.trainer_running(pod, kind.value)]
    waiting = p.most_telling([s for pod in pods if (s := p.startup(pod, kind.value))])
    if running:
        ctx.s.message = f"{verb}: pod {running[0]} {doing}"
    elif waiting is not None:
        ctx.s.message = f"{verb}: {waiting.message}"
        timeout = ctx.settings.startup_timeout_seconds
        if waiting.overdue(ctx.now, timeout):
            ctx.fail(
                _STEP_FAILURES[kind],
                f"the {kind.value} pod did not start within {timeout:.0f}s: "
                f"{waiting.message}. To fix: what the message names (the image, a Secret, "
                "a claim), then create the job again",
            )
    return None


def _after_training(ctx: Context, step: _AfterTraining) -> bool:
    """Run one CPU step after training succeeded (the export, the stage-out): create it,
    follow it, fail the job with its reason, or record what it did. True while it holds
    the job (the next step and the success wait for it)."""
    ctx.d.requeue_after = ctx.settings.poll_seconds
    condition, running, done = _STEP_CONDITIONS[step.kind]
    failed = _STEP_FAILURES[step.kind]
    if step.batch is None:
        if refused(ctx):  # a spec patched since the launch (its image, its Secret)
            return True
        try:
            ctx.d.create.extend(step.build())
            what = step.doing()
        except SpecError as exc:
            ctx.fail(Reason.INVALID_SPEC, str(exc))
            return True
        if get_condition(ctx.s.conditions, condition) is None:
            ctx.d.event(running, what)
        ctx.go.condition(condition, False, running, what)
        ctx.s.message = what
        return True
    end = _step_ended(ctx, step.kind, step.batch, step.pods)
    if end is None:
        return True
    if end.code == 0:
        summary = step.record(end.message)
        if summary is None:
            keep_output(ctx)
            ctx.fail(failed, f"{_no_result(step.kind, step.batch, end)}. {step.kept}")
            return True
        ctx.go.condition(condition, True, done, summary)
        ctx.d.event(done, summary)
        return False
    keep_output(ctx)
    why = "a permanent failure" if end.code == EXIT_CONFIG_ERROR else "failed repeatedly"
    name = (step.batch.get("metadata") or {}).get("name")
    detail = end.message[-600:]
    then = (
        "Then"
        if "To fix" in detail
        else (f"To fix: read its log (`kubectl logs job/{name}`); then")
    )
    ctx.fail(
        failed,
        f"the {step.kind.value} step {why}: {detail}. {step.kept}. {then}, to "
        f"{step.again} without training again, delete this job and create it again under "
        f"the same name with {step.fixed}spec.checkpoint.resumeFromUID: "
        f"{ctx.job.metadata.get('uid')} (it resumes at the last step and {step.again}s)",
    )
    return True


def keep_output(ctx: Context) -> None:
    """After an export or upload failed, the checkpoint volume holds the only copy of the
    trained output: a claim the job owns (retention `delete`) is released, so that neither
    the TTL nor a user deleting the job to create it again (as the failure message says to)
    deletes it with the job. Repeated until the watched claim shows no owner."""
    claim = ctx.observed.checkpoint_claim
    owners = ((claim or {}).get("metadata") or {}).get("ownerReferences") or []
    if claim is None or not any(o.get("uid") == ctx.job.metadata.get("uid") for o in owners):
        return
    name = str(claim["metadata"]["name"])
    if name not in ctx.d.release_claims:
        ctx.d.release_claims.append(name)


def output_at_risk(ctx: Context) -> bool:
    """Whether the job failed in the export or upload step (its output only on the volume)."""
    failed = get_condition(ctx.s.conditions, ConditionType.FAILED)
    return failed is not None and failed.reason in (
        _STEP_FAILURES[StepKind.EXPORT],
        _STEP_FAILURES[StepKind.STAGE_OUT],
    )


def exporting(ctx: Context) -> bool:
    """The GGUF file spec.output.gguf asks for, written by the export step."""
    if not needs_export(ctx.job) or ctx.s.export is not None:
        return False

    def record(message: str) -> str | None:
        exported = _parse_export(message, gguf_uri(ctx.job))
        if exported is None:
            return None
        ctx.s.export = exported
        return (
            f"wrote {exported.uri} ({exported.quantization}, {exported.bytes} bytes) in "
            f"{exported.seconds}s"
        )

    pvc = child_names(ctx.job_name, 1).pvc
    return _after_training(
        ctx,
        _AfterTraining(
            kind=StepKind.EXPORT,
            batch=ctx.observed.export_job,
            pods=ctx.observed.export_pods,
            build=lambda: build_export(ctx.job, ctx.settings.build),
            doing=lambda: f"exporting the trained model to GGUF: {gguf_uri(ctx.job)}",
            record=record,
            kept=f"The trained output stays on the checkpoint volume ({pvc}, output/), which "
            "deleting this job leaves in place",
            again="export",
            fixed="the fixed spec.output.gguf and ",
        ),
    )


def staging_out(ctx: Context) -> bool:
    """An `s3://` output, uploaded by the stage-out step (the job succeeds only after)."""
    if not needs_stage_out(ctx.job) or ctx.s.stage_out is not None:
        return False

    def record(message: str) -> str | None:
        uploaded = _parse_stage_out(message)
        if uploaded is None:
            return None
        ctx.s.stage_out = uploaded
        return (
            f"uploaded {uploaded.files} files ({uploaded.bytes} bytes) to "
            f"{uploaded.destination}: {uploaded.uploaded_bytes} bytes sent, "
            f"{uploaded.skipped_bytes} already there"
        )

    pvc = child_names(ctx.job_name, 1).pvc
    return _after_training(
        ctx,
        _AfterTraining(
            kind=StepKind.STAGE_OUT,
            batch=ctx.observed.stage_out_job,
            pods=ctx.observed.stage_out_pods,
            build=lambda: build_stage_out(ctx.job, ctx.settings.build),
            doing=lambda: f"uploading the output to {ctx.spec.output.uri}",
            record=record,
            kept=f"The output stays on the checkpoint volume ({pvc}, output/), which deleting "
            "this job leaves in place",
            again="upload",
            fixed="",
        ),
    )


def _parse_stage_in(message: str) -> StageInStatus | None:
    """status.stageIn from the stage-in pod's termination message (a StageInResult as
    JSON); None when it is not one."""
    try:
        result = StageInResult.model_validate_json(message)
    except ValueError:  # pydantic's ValidationError, for bad JSON too
        return None
    return StageInStatus(
        model_path=result.model_path,
        dataset_path=result.dataset_path,
        examples=result.examples,
        tokens=result.tokens,
        downloaded_bytes=result.downloaded_bytes,
        reused_bytes=result.reused_bytes,
        seconds=round(result.seconds, 1),
        model_config_json=dict(result.model_config_json) or None,
    )


def _parse_stage_out(message: str) -> StageOutStatus | None:
    """status.stageOut from the stage-out pod's termination message (a StageOutResult as
    JSON); None when it is not one."""
    try:
        result = StageOutResult.model_validate_json(message)
    except ValueError:
        return None
    return StageOutStatus(
        destination=result.destination,
        files=result.files,
        bytes=result.bytes,
        uploaded_bytes=result.uploaded_bytes,
        skipped_bytes=result.skipped_bytes,
        seconds=round(result.seconds, 1),
    )


def _parse_export(message: str, uri: str) -> ExportStatus | None:
    """status.export from the export pod's termination message (an ExportResult as JSON);
    None when it is not one. `uri` says where the file is for the user (the pod's path is
    its mount)."""
    try:
        result = ExportResult.model_validate_json(message)
    except ValueError:
        return None
    return ExportStatus(
        uri=uri,
        quantization=result.quantization,
        bytes=result.bytes,
        seconds=round(result.seconds, 1),
    )


def _no_result(kind: StepKind, batch: Mapping[str, Any], end: p.StepEnd) -> str:
    name = (batch.get("metadata") or {}).get("name")
    return (
        f"the {kind.value} step ended without its result (termination message: "
        f"{end.message[:200]!r}). To fix: read its log (`kubectl logs job/{name}`) and create "
        "the job again"
    )
