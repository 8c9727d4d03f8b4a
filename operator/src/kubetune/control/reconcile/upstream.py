"""Chained jobs: a job whose model is another FineTuneJob's result (`ftj://<name>`) waits
until that one succeeded, then trains on where its whole model is (status.upstream)."""

from __future__ import annotations

from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus, UpstreamStatus
from kubetune.api.vocabulary import ConditionType, Phase, Reason
from kubetune.control import pods as p
from kubetune.control.build.names import child_names
from kubetune.control.conditions import get_condition
from kubetune.control.reconcile.context import Context, measured_spec
from kubetune_trainer.uris import Form, parse_uri, pvc_uri

UPSTREAM_GRACE_SECONDS = 60.0
"""How long a job waits for an `ftj://` upstream that does not exist (both applied at once
may arrive in either order) before it fails."""


def waiting_for_upstream(ctx: Context) -> bool:
    """A job whose model is another FineTuneJob's result (`ftj://<name>`) waits in Pending
    until that one Succeeded, then takes where its whole model is (status.upstream); it
    fails when the upstream failed, does not exist, or writes no whole model. True while
    it holds the job."""
    uri = ctx.raw_model_uri
    name = parse_uri(uri).job
    if name is None or ctx.s.upstream is not None:
        return False
    up = ctx.observed.upstream
    ctx.d.requeue_after = ctx.settings.queue_retry_seconds
    if up is None:
        created = p.parse_time(ctx.job.metadata.get("creationTimestamp"))
        young = created is None or (ctx.now - created).total_seconds() < UPSTREAM_GRACE_SECONDS
        if not ctx.observed.upstream_read:
            # No answer, or a refusal (the operator's RBAC, the API server's trouble):
            # the operator's log has the status code.
            _hold_for_upstream(ctx, name, "not read yet: the read got no answer")
            return True
        if young:
            _hold_for_upstream(ctx, name, "not found yet")
            return True
        ctx.fail(
            Reason.UPSTREAM_FAILED,
            f"FineTuneJob {name} (spec.model.uri {uri}) does not exist in namespace "
            f"{ctx.job.metadata.get('namespace')}. To fix: create it, or point "
            "spec.model.uri at an existing job, then create this job again",
        )
        return True
    upstream_status = up.status or FineTuneJobStatus()
    if upstream_status.phase == Phase.FAILED:
        why = get_condition(upstream_status.conditions, ConditionType.FAILED)
        said = f"{why.reason}: {why.message[:300]}" if why else upstream_status.message
        ctx.fail(
            Reason.UPSTREAM_FAILED,
            f"the upstream FineTuneJob {name} failed ({said}). To fix: run {name} again "
            "until it succeeds, then create this job again",
        )
        return True
    if upstream_status.phase != Phase.SUCCEEDED:
        _hold_for_upstream(ctx, name, f"phase {upstream_status.phase}")
        return True
    taken = upstream_result(up)
    if isinstance(taken, str):
        ctx.fail(Reason.UPSTREAM_FAILED, taken)
        return True
    ctx.s.upstream = taken
    ctx.job = chained(ctx.job, taken)
    ctx.spec = measured_spec(ctx.job.spec, ctx.s.stage_in)
    said = f"FineTuneJob {name} succeeded: training on its model at {taken.model_uri}"
    ctx.go.condition(ConditionType.UPSTREAM_READY, True, Reason.UPSTREAM_SUCCEEDED, said)
    ctx.d.event(Reason.UPSTREAM_SUCCEEDED, said)
    ctx.s.message = said
    ctx.d.requeue_after = None
    return False


def _hold_for_upstream(ctx: Context, name: str, state: str) -> None:
    said = f"waiting for FineTuneJob {name} ({state}) to succeed: its model is this job's"
    if get_condition(ctx.s.conditions, ConditionType.UPSTREAM_READY) is None:
        ctx.d.event(Reason.WAITING_FOR_UPSTREAM, said)
    ctx.go.condition(ConditionType.UPSTREAM_READY, False, Reason.WAITING_FOR_UPSTREAM, said)
    ctx.s.message = said


def upstream_result(up: FineTuneJob) -> UpstreamStatus | str:
    """Where a Succeeded FineTuneJob's whole model is, and what it is, for a job chained
    after it; a message with "To fix:" when it left none."""
    name = str(up.metadata.get("name"))
    spec, status = up.spec, up.status or FineTuneJobStatus()
    method = status.plan.method if status.plan is not None else spec.method
    if method in ("lora", "qlora") and not spec.output.merge_adapter:
        return (
            f"the upstream FineTuneJob {name} wrote a LoRA adapter only, not a whole model. "
            f"To fix: set spec.output.mergeAdapter: true on {name} and run it again, then "
            "create this job again"
        )
    folder = "model" if method == "full" else "merged"
    out = spec.output.uri
    # Only a `pvc://` or `s3://` output is elsewhere than the checkpoint volume's `output/`.
    if out is not None and parse_uri(out).form in (Form.PVC, Form.S3):
        model_uri = f"{out.rstrip('/')}/{folder}"
    elif spec.checkpoint.storage.retention == "delete":
        return (
            f"the upstream FineTuneJob {name} keeps its output on its checkpoint volume, "
            "which it deletes when it finishes (checkpoint.storage.retention: delete). To fix: "
            f"run {name} again with retention retain or an output.uri, then create this job "
            "again"
        )
    else:
        model_uri = pvc_uri(child_names(name, 1).pvc, f"output/{folder}")
    base = spec.model.uri
    inherited = status.upstream.architecture if status.upstream is not None else None
    hub_id = parse_uri(base).is_hub
    return UpstreamStatus(
        name=name,
        uid=str(up.metadata.get("uid") or ""),
        model_uri=model_uri,
        architecture=spec.model.architecture or inherited or (base if hub_id else None),
    )


def chained(job: FineTuneJob, upstream: UpstreamStatus | None) -> FineTuneJob:
    """The job as the rest of the reconcile sees it: an `ftj://` model replaced by where the
    upstream's model is (and its architecture, unless the spec names one)."""
    if upstream is None or parse_uri(job.spec.model.uri).form is not Form.FTJ:
        return job
    model = job.spec.model.model_copy(
        update={
            "uri": upstream.model_uri,
            "architecture": job.spec.model.architecture or upstream.architecture,
        }
    )
    return job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})
