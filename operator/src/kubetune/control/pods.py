"""What the trainer's batch Job and pods say happened (pure reads of Kubernetes objects).

The reconcile logic asks these questions of the objects the controller observed: did the
batch Job finish or fail, how did the trainer exit (the contract's exit codes, and the
termination message: the trainer's `TrainerResult` as JSON, or its reason in words), what
did the finished trainer report (`trainer_result`), was a pod preempted, has a pending pod
been unschedulable, does its trainer container run or why not, and which pods of this
attempt ended since the last look.
Everything here reads plain dicts in the Kubernetes wire format and returns named values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from kubetune.api.v1alpha1 import EarlyStoppedStatus, Recovery
from kubetune.api.vocabulary import Reason, RecoveryReason, StepKind
from kubetune_trainer.contract import (
    EARLY_STOPPED,
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
    OOM_PHASES,
    EarlyStoppingResult,
    TrainerResult,
)

TRAINER_CONTAINER = "trainer"
JOB_ENDING_EXITS = (
    EXIT_OOM,
    EXIT_CONFIG_ERROR,
    EXIT_CHECKPOINT_FAILED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
)
"""Trainer exits on which the batch Job's podFailurePolicy fails the whole Job."""
_TELLING_EXITS = (
    EXIT_OOM,
    EXIT_CONFIG_ERROR,
    EXIT_CHECKPOINT_FAILED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
)
"""Exits that decide what happens next, most telling first."""
HOST_OOM_REASON = "OOMKilled"
"""The container runtime's reason for a container whose processes the kernel killed for
memory (the node's RAM, not the GPU's)."""
HOST_MEMORY_GROWTH = 1.5
"""Host memory of the next attempt after the kernel killed a trainer for memory."""
HOST_MEMORY_FIX = (
    "raise the trainer's memory per GPU (Helm value operator.trainerMemoryPerGPU, "
    "KUBETUNE_TRAINER_MEMORY_PER_GPU) or allow a pool whose nodes have more memory "
    "(spec.resources.pools)"
)
HOST_OOM_ADVICE = (
    "the trainer ran out of host memory (its pod's memory limit, or the node's) and the "
    f"kernel killed it; the operator relaunches it with {HOST_MEMORY_GROWTH:g}× the memory. "
    f"To fix for good: {HOST_MEMORY_FIX}"
)


class PodPhase(StrEnum):
    """Kubernetes' own pod phases (`Pod.status.phase`), not a FineTuneJob's."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


POD_DONE = frozenset({PodPhase.SUCCEEDED, PodPhase.FAILED})
"""Pods in these phases hold no resources and run nothing."""


def parse_time(text: str | None) -> datetime | None:
    """A status timestamp (RFC 3339, whole seconds, UTC) as a datetime."""
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def pod_name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


_INDEXED_POD_NAME = re.compile(r"-(\d+)-[a-z0-9]+$")


def completion_index_of(name: str) -> str | None:
    """The completion index in the generated name of an Indexed Job's pod
    (`<job>-<index>-<suffix>`); None for another name."""
    match = _INDEXED_POD_NAME.search(name)
    return match.group(1) if match else None


def pod_phase(pod: Mapping[str, Any]) -> str | None:
    phase = (pod.get("status") or {}).get("phase")
    return None if phase is None else str(phase)


def job_condition(job_status: Mapping[str, Any], type_: str) -> bool:
    """Whether the batch Job's condition `type_` (Complete, Failed, ...) is True."""
    return any(
        cond.get("type") == type_ and cond.get("status") == "True"
        for cond in job_status.get("conditions") or []
    )


def job_succeeded(job_status: Mapping[str, Any]) -> bool:
    return job_condition(job_status, "Complete") or job_condition(job_status, "SuccessCriteriaMet")


def job_failed(job_status: Mapping[str, Any]) -> bool:
    return job_condition(job_status, "Failed") or job_condition(job_status, "FailureTarget")


def _trainer_terminations(
    pod: Mapping[str, Any], container: str = TRAINER_CONTAINER
) -> list[Mapping[str, Any]]:
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != container:
            continue
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term:
                out.append(term)
    return out


@dataclass(frozen=True)
class TrainerExit:
    """How the trainer ended: its exit code (None when none was recorded), the tail of its
    termination message (a result's in words, as version 1 trainers wrote it: `oom
    peak_gib=... step=... rank=... phase=... <message>`), the runtime's reason (`Error`,
    `OOMKilled`, ...) and the `TrainerResult` it left (contract 2: on out of GPU memory)."""

    code: int | None
    detail: str
    reason: str = ""
    result: TrainerResult | None = None

    @property
    def oom_peak_gib(self) -> float | None:
        """The most GPU memory the run had reserved, from its result or a version 1
        trainer's words; None when it did not say."""
        oom = self.result.out_of_memory if self.result is not None else None
        return oom.peak_gib if oom is not None else peak_gib(self.detail)

    @property
    def oom_while(self) -> str | None:
        """What the trainer was doing when it ran out of GPU memory, in words
        (`evaluating`), from its result or a version 1 trainer's words; None when it did
        not say."""
        oom = self.result.out_of_memory if self.result is not None else None
        if oom is None:
            return oom_phase(self.detail)
        return OOM_PHASES.get(oom.phase) if oom.phase else None

    @property
    def host_oom(self) -> bool:
        """Killed for lack of host memory (OOMKilled, usually exit 137)."""
        return self.reason == HOST_OOM_REASON

    def describe(self) -> str:
        """`exit code 1`, `out of host memory (OOMKilled, exit code 137)` or `pod failure`,
        as recovery messages put it."""
        if self.host_oom:
            return f"out of host memory ({HOST_OOM_REASON}, exit code {self.code})"
        return f"exit code {self.code}" if self.code is not None else "pod failure"


def trainer_exit(pods: Sequence[Mapping[str, Any]]) -> TrainerExit:
    """The most telling trainer exit among the pods: OOM, then config error, then a failed
    checkpoint, then any."""
    seen: list[TrainerExit] = []
    for pod in pods:
        for term in _trainer_terminations(pod):
            code = term.get("exitCode")
            if code is None or code == 0:
                continue
            reason = str(term.get("reason") or "")
            if reason == HOST_OOM_REASON and code not in _TELLING_EXITS:
                # What the trainer logged last means little after the kernel killed it.
                seen.append(TrainerExit(int(code), HOST_OOM_ADVICE, reason))
                continue
            message = str(term.get("message") or "")
            result = parse_trainer_result(message)
            detail = (_in_words(result) if result is not None else message or reason).strip()
            seen.append(TrainerExit(int(code), detail[-500:], reason, result))
    for wanted in _TELLING_EXITS:
        for found in seen:
            if found.code == wanted:
                return found
    # A pod killed for host memory takes its peers down with it: it is the one to report.
    for found in seen:
        if found.host_oom:
            return found
    if seen:
        return seen[0]
    return TrainerExit(None, "no trainer exit code recorded")


@dataclass(frozen=True)
class StepEnd:
    """How a CPU step's last pod ended: its exit code and termination message."""

    code: int | None
    message: str


def step_end(pods: Sequence[Mapping[str, Any]], kind: StepKind) -> StepEnd:
    """The newest ended pod's exit of a CPU step (its termination message holds the result
    JSON on success, the reason and the fix on failure)."""
    ends = []
    for pod in pods:
        for term in _trainer_terminations(pod, kind.value):
            code = term.get("exitCode")
            ends.append((str(term.get("finishedAt") or ""), code, str(term.get("message") or "")))
    if not ends:
        return StepEnd(None, f"no {kind.value} exit recorded")
    _, code, message = max(ends, key=lambda e: e[0])
    return StepEnd(None if code is None else int(code), message.strip())


def trainer_result(pods: Sequence[Mapping[str, Any]]) -> TrainerResult | None:
    """What the trainer that finished reported: the `TrainerResult` in rank 0's termination
    message on exit 0 (its final step, total steps, loss and tokens, and how early stopping
    ended). A version 1 trainer wrote `early_stopped step=N best_step=M ...` or `completed
    step=N ...` instead, with early stopping on only; that is read into the same type, without
    the numbers it did not give. None when no pod exited 0 with one."""
    for pod in pods:
        for term in _trainer_terminations(pod):
            if term.get("exitCode") != 0:
                continue
            result = parse_trainer_result(str(term.get("message") or ""))
            if result is not None:
                return result
    return None


def parse_trainer_result(message: str) -> TrainerResult | None:
    """The `TrainerResult` in a trainer's termination message: the last line that is one
    (several ranks of a pod may each write one), else a version 1 trainer's early-stopping
    line; None when there is neither. A line the kubelet cut short is skipped."""
    lines = message.splitlines()
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return TrainerResult.model_validate_json(line)
            except ValueError:  # pydantic's ValidationError, for bad JSON too
                continue
    for line in lines:
        result = _version_1_result(line)
        if result is not None:
            return result
    return None


def _version_1_result(line: str) -> TrainerResult | None:
    """A version 1 trainer's `early_stopped step=N best_step=M metric=... value=...
    patience=P evaluations_without_improvement=E` (or `completed ...`) line as a result."""
    words = line.split()
    if not words or words[0] not in (EARLY_STOPPED, "completed"):
        return None
    fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    try:
        value = float(fields["value"]) if "value" in fields else None
        waited = fields.get("evaluations_without_improvement")
        return TrainerResult(
            outcome=EARLY_STOPPED if words[0] == EARLY_STOPPED else "completed",
            step=int(fields["step"]),
            early_stopping=EarlyStoppingResult.model_validate(
                {
                    "stopped_early": words[0] == EARLY_STOPPED,
                    "best_step": int(fields["best_step"]),
                    "metric": fields.get("metric", "eval_loss"),
                    "best_value": value,
                    "patience": int(fields["patience"]) if "patience" in fields else None,
                    "evaluations_without_improvement": None if waited is None else int(waited),
                }
            ),
        )
    except (KeyError, ValueError):  # ValueError: pydantic's ValidationError too
        return None


def _in_words(result: TrainerResult) -> str:
    """A result as a version 1 trainer wrote it in words, for what reads the words."""
    oom = result.out_of_memory
    if oom is None:
        return f"{result.outcome} step={result.step}"
    phase = f" phase={oom.phase}" if oom.phase else ""
    return f"oom peak_gib={oom.peak_gib:.3f} step={oom.step} rank={oom.rank}{phase} {oom.message}"


def early_stopped(pods: Sequence[Mapping[str, Any]]) -> EarlyStoppedStatus | None:
    """How early stopping ended the run (`trainer_result`); None when no pod says it
    stopped early."""
    result = trainer_result(pods)
    es = result.early_stopping if result is not None else None
    if result is None or result.outcome != EARLY_STOPPED or es is None:
        return None
    value = es.best_value
    return EarlyStoppedStatus.model_validate(
        {
            "step": result.step,
            "bestStep": es.best_step,
            "metric": es.metric,
            "value": None if value is None or value != value else round(value, 6),
            "patience": es.patience,
        }
    )


def oom_phase(detail: str) -> str | None:
    """What the trainer was doing when it ran out of GPU memory (`phase=<key>` in its
    termination message), in words: `evaluating`; None when it did not say."""
    for token in detail.split():
        if token.startswith("phase="):
            return OOM_PHASES.get(token.split("=", 1)[1])
    return None


def peak_gib(detail: str) -> float | None:
    """The trainer writes `peak_gib=<float>` into its termination message on OOM."""
    for token in detail.replace(",", " ").split():
        if token.startswith("peak_gib="):
            try:
                return float(token.split("=", 1)[1])
            except ValueError:
                return None
    return None


def was_preempted(pod: Mapping[str, Any]) -> bool:
    """Disrupted (DisruptionTarget: preemption, eviction, drain) or exited with the
    preemption code after checkpointing on SIGTERM."""
    status = pod.get("status") or {}
    if any(
        cond.get("type") == "DisruptionTarget" and cond.get("status") == "True"
        for cond in status.get("conditions") or []
    ):
        return True
    return any(t.get("exitCode") == EXIT_PREEMPTED for t in _trainer_terminations(pod))


def unschedulable_since(pod: Mapping[str, Any]) -> datetime | None:
    """When a Pending pod was found unschedulable for lack of room (PodScheduled=False,
    Unschedulable). A volume problem (a missing or unbound claim) does not count: another
    pool cannot fix it."""
    status = pod.get("status") or {}
    bound = bool((pod.get("spec") or {}).get("nodeName"))
    if bound or status.get("phase") not in (None, PodPhase.PENDING):
        return None
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
            and "volume" not in str(cond.get("message", "")).lower()
            and "persistentvolumeclaim" not in str(cond.get("message", "")).lower()
        ):
            return parse_time(cond.get("lastTransitionTime"))
    return None


def _trainer_status(
    pod: Mapping[str, Any], container: str = TRAINER_CONTAINER
) -> Mapping[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            return cs  # type: ignore[no-any-return]
    return None


def trainer_running(pod: Mapping[str, Any], container: str = TRAINER_CONTAINER) -> bool:
    """The pod's trainer (or `container`) runs. (A Running pod that reports no status for
    it, as some test doubles do, counts as running: its only container is the trainer.)"""
    if pod_phase(pod) != PodPhase.RUNNING:
        return False
    cs = _trainer_status(pod, container)
    return cs is None or "running" in (cs.get("state") or {})


OVERDUE_DELETION_SECONDS = 60
"""A pod still there this long after its deletion was due (deletionTimestamp, which includes
the grace period) sits on a lost node: it no longer counts as running."""


def still_running(pod: Mapping[str, Any], now: datetime) -> bool:
    """A trainer pod that may still write to the checkpoint folder: Running or Pending (it
    may yet start), unless it is being deleted and either no node took it (the scheduler
    places no pod that is being deleted) or its deletion is long overdue (its node is gone:
    nothing runs there any more, and the pod object lingers)."""
    if pod_phase(pod) not in (PodPhase.PENDING, PodPhase.RUNNING):
        return False
    due = parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
    if due is None:
        return True
    if not (pod.get("spec") or {}).get("nodeName"):
        return False
    return (now - due).total_seconds() < OVERDUE_DELETION_SECONDS


Interval = tuple[datetime | None, datetime | None]
"""When a trainer ran: (started, finished), None where not known or not yet."""


def trainer_interval(pod: Mapping[str, Any], container: str = TRAINER_CONTAINER) -> Interval | None:
    """When the pod's trainer ran, by the kubelet's own times: (startedAt, None) while it
    runs, (startedAt, finishedAt) once it ended; None when it never ran. A Running pod that
    reports no status for it counts as running since a time not known (None, None)."""
    cs = _trainer_status(pod, container)
    if cs is None:
        return (None, None) if pod_phase(pod) == PodPhase.RUNNING else None
    state = cs.get("state") or {}
    if "running" in state:
        return parse_time((state["running"] or {}).get("startedAt")), None
    ended = state.get("terminated")
    if ended and ended.get("startedAt"):
        return parse_time(ended.get("startedAt")), parse_time(ended.get("finishedAt"))
    return None


IMAGE_PULL_WAITING = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
"""The kubelet's waiting reasons for an image it cannot pull."""
CONFIG_WAITING = frozenset({"CreateContainerConfigError", "CreateContainerError"})
"""The kubelet's waiting reasons for a container it cannot create (a Secret, a key, a
ConfigMap missing; a bad mount)."""


@dataclass(frozen=True)
class Startup:
    """Why a trainer pod of the attempt does not run yet."""

    pod: str
    reason: Reason
    """IMAGE_PULL_FAILED, CONTAINER_CONFIG_ERROR, UNSCHEDULABLE or PODS_STARTING."""
    message: str
    since: datetime | None
    """Since when it could have started: bound to its node, else created."""
    for_room: bool
    """It waits for room in the pool (unschedulable for lack of GPUs, not for a volume):
    the queue and the move to another pool deal with that, not the startup timeout."""

    def overdue(self, now: datetime, timeout: float) -> bool:
        """It could have started `timeout` seconds ago and has not (waiting for room never
        is: the queue and the move to another pool deal with that)."""
        since = self.since
        return not self.for_room and since is not None and (now - since).total_seconds() >= timeout

    @property
    def user_error(self) -> bool:
        """A cause only the job's owner or the cluster's admin can fix: relaunching the
        same pods does not help."""
        return self.reason in (Reason.IMAGE_PULL_FAILED, Reason.CONTAINER_CONFIG_ERROR)


_STARTUP_ORDER = (
    Reason.IMAGE_PULL_FAILED,
    Reason.CONTAINER_CONFIG_ERROR,
    Reason.UNSCHEDULABLE,
    Reason.PODS_STARTING,
)


def startup(pod: Mapping[str, Any], container: str = TRAINER_CONTAINER) -> Startup | None:
    """Why the pod's trainer (or `container`) does not run yet; None when it runs or the pod
    ended."""
    if pod_phase(pod) in POD_DONE or trainer_running(pod, container):
        return None
    name = pod_name(pod)
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    since = parse_time(meta.get("creationTimestamp"))
    for cond in status.get("conditions") or []:
        if cond.get("type") != "PodScheduled":
            continue
        if cond.get("status") == "True":
            since = parse_time(cond.get("lastTransitionTime")) or since
        elif cond.get("reason") == "Unschedulable":
            why = str(cond.get("message") or "no node fits")
            return Startup(
                name,
                Reason.UNSCHEDULABLE,
                f"pod {name} is unschedulable: {why}",
                since,
                for_room=unschedulable_since(pod) is not None,
            )
    waiting = ((_trainer_status(pod, container) or {}).get("state") or {}).get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    detail = f"{reason}: {waiting.get('message')}" if waiting.get("message") else reason
    if reason in IMAGE_PULL_WAITING:
        return Startup(name, Reason.IMAGE_PULL_FAILED, f"pod {name}: {detail}", since, False)
    if reason in CONFIG_WAITING:
        return Startup(name, Reason.CONTAINER_CONFIG_ERROR, f"pod {name}: {detail}", since, False)
    doing = detail or str(status.get("phase") or PodPhase.PENDING)
    return Startup(name, Reason.PODS_STARTING, f"pod {name}: {doing}", since, False)


def most_telling(startups: Sequence[Startup]) -> Startup | None:
    """The startup problem to show first: an image or config error before waiting for room
    before an ordinary start."""
    if not startups:
        return None
    return min(startups, key=lambda s: (_STARTUP_ORDER.index(s.reason), s.pod))


@dataclass(frozen=True)
class PodEnd:
    """A trainer pod of the current attempt that ended early; the batch Job replaces it."""

    pod: str
    reason: RecoveryReason
    message: str
    host_oom: bool = False
    """The kernel killed its trainer for host memory (OOMKilled)."""


@dataclass(frozen=True)
class PodLook:
    """What one look at an attempt's pods found: the pods that ended early since the last
    look, and the names of those alive now (the next look's `last_seen`)."""

    ended: list[PodEnd]
    alive: list[str]


def ended_pods(
    pods: Sequence[Mapping[str, Any]],
    last_seen: Sequence[str],
    recoveries: Sequence[Recovery],
    attempt: int,
    job_failed_count: int,
) -> PodLook:
    """The pods of `attempt` that ended since the last look, and the pods alive now.

    A pod is seen ending (phase Failed: preempted when it was disrupted or exited with the
    preemption code, else a pod failure), or it is simply gone at the next look (deleted soon
    after it ended). A gone pod counts as a failure when the batch Job's `failed` counter —
    which leaves out the failures its podFailurePolicy ignores, i.e. preemptions — is ahead
    of the failures recorded so far, else as a preemption. Pods already recorded in
    `recoveries`, and exits that fail the whole batch Job, are not reported.
    """
    mine = [r for r in recoveries if r.attempt == attempt]
    recorded = {
        r.pod
        for r in mine
        if r.pod
        and r.reason
        in (RecoveryReason.PREEMPTION, RecoveryReason.POD_FAILURE, RecoveryReason.HOST_OOM)
    }
    failures = sum(1 for r in mine if r.reason == RecoveryReason.POD_FAILURE)
    ends: list[PodEnd] = []
    current = {pod_name(pod): pod for pod in pods}
    for name, pod in current.items():
        if name in recorded or pod_phase(pod) != PodPhase.FAILED:
            continue
        end = trainer_exit([pod])
        if end.code in JOB_ENDING_EXITS:
            continue  # the batch Job fails on it; the failure handling takes it from there
        if was_preempted(pod):
            ends.append(PodEnd(name, RecoveryReason.PREEMPTION, f"pod {name} preempted"))
        else:
            why = end.describe() if end.code is not None else "failed"
            message = f"pod {name} failed ({why}: {end.detail})"
            ends.append(PodEnd(name, RecoveryReason.POD_FAILURE, message, host_oom=end.host_oom))
    for name in last_seen:
        if name in current or name in recorded:
            continue
        if job_failed_count > failures + sum(
            1 for e in ends if e.reason == RecoveryReason.POD_FAILURE
        ):
            ends.append(PodEnd(name, RecoveryReason.POD_FAILURE, f"pod {name} failed and is gone"))
        else:
            ends.append(
                PodEnd(name, RecoveryReason.PREEMPTION, f"pod {name} preempted and is gone")
            )
    alive = sorted(name for name, pod in current.items() if pod_phase(pod) not in POD_DONE)
    return PodLook(ended=ends, alive=alive)
