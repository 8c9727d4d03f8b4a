"""Before a launch: the claims and Secrets the job reads, which must exist before any GPU is
asked for (the admins' rules are policy.py's)."""

from __future__ import annotations

from collections.abc import Sequence

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import ConditionType, Phase, Reason
from kubetune.control import pods as p
from kubetune.control.conditions import get_condition
from kubetune.control.reconcile.context import Context, MissingInput


def needs_preflight(job: FineTuneJob) -> bool:
    """Whether a reconcile of `job` may launch a new attempt from where it is (not yet
    running, or suspended): only then are the claims and Secret it reads looked up."""
    phase = job.status.phase if job.status is not None else Phase.PENDING
    if job.spec.suspend:
        return False
    return phase in (Phase.PENDING, Phase.PLANNING, Phase.QUEUED, Phase.SUSPENDED)


def inputs_missing(ctx: Context) -> bool:
    """Hold a job whose claims or token Secret do not exist (before any GPU is asked
    for): condition InputsReady=False naming each, until they exist; after the startup
    timeout the job fails. True while it holds the job."""
    missing = ctx.observed.missing_inputs
    before = get_condition(ctx.s.conditions, ConditionType.INPUTS_READY)
    if not missing:
        if before is not None and before.status != "True":
            ctx.go.condition(
                ConditionType.INPUTS_READY, True, Reason.INPUTS_FOUND, "every input exists"
            )
            ctx.d.event(Reason.INPUTS_FOUND, "Every claim and Secret the job reads exists")
        return False
    namespace = str(ctx.job.metadata.get("namespace") or "default")
    volume = any(m.ref.kind == "PersistentVolumeClaim" for m in missing)
    reason = Reason.MISSING_VOLUME if volume else Reason.MISSING_SECRET
    timeout = ctx.settings.startup_timeout_seconds
    what = "; ".join(m.describe(namespace) for m in missing)
    message = f"{what}. To fix: {_fix_missing(missing)}"
    since = p.parse_time(before.last_transition_time) if before is not None else None
    if before is None or before.status == "True" or since is None:
        since = ctx.now
    waited = (ctx.now - since).total_seconds()
    if waited >= timeout:
        ctx.go.condition(ConditionType.INPUTS_READY, False, reason, message)
        ctx.fail(reason, f"still missing after {waited:.0f}s: {message}")
        return True
    held = f"{message}; the job starts once it exists (it fails after {timeout:.0f}s)"
    if before is None or before.status == "True" or before.message != held:
        ctx.d.event(reason, held, warning=True)
    ctx.go.condition(ConditionType.INPUTS_READY, False, reason, held)
    ctx.s.message = held
    ctx.d.requeue_after = ctx.settings.queue_retry_seconds
    return True


def _fix_missing(missing: Sequence[MissingInput]) -> str:
    fixes = []
    for m in missing:
        if m.ref.kind == "Secret":
            key = m.ref.key or "token"
            fixes.append(
                f"create it (`kubectl create secret generic {m.ref.name} "
                f"--from-literal={key}=<token>`) or correct {m.ref.field}"
            )
        else:
            fixes.append(f"create the claim {m.ref.name!r} or correct {m.ref.field}")
    return "; ".join(dict.fromkeys(fixes))
