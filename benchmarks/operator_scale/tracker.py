"""What happens to the jobs, as the benchmark's watches see them: each job's creation,
Planned condition, first batch Job and first pod (the latencies a run reports), the pods
still Pending and why, the status writes counted by what they changed, and when the run
has settled."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.measure import percentile
from benchmarks.operator_scale.scenario import LABEL_JOB

SETTLED_PHASES = frozenset({"Running", "Queued", "Succeeded", "Failed"})


def rfc3339_seconds(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class JobState:
    created: float
    phase: str = ""
    planned_at: float | None = None
    """The Planned condition's lastTransitionTime: when the operator's look began."""
    planned_seen: float | None = None
    """When the watch first showed Planned=True (this machine's clock, the API server's
    too): when a user could see it, at most the watch's lag late."""
    planned_written: float | None = None
    """When the status write that carried Planned=True landed, by the API server's clock:
    the latest `managedFields` time of the status subresource in that first event (1 s
    resolution). Decision → written is the operator's part; written → seen the watch's."""
    not_planned_reason: str = ""
    pool: str = ""
    queued: bool = False
    """Seen Queued at some point: it waited for GPUs (capacity did not exist at creation)."""
    first_queued: str = ""
    """Why it was first Queued (the status message, numbers as N)."""


@dataclass
class Snapshot:
    jobs: int
    planned: int
    phases: Counter[str]
    pending_pods: int
    young_pending_pods: int
    """Pending for less than the operator waits before it moves a pod to another pool."""
    running_pods: int
    running_without_pods: int
    not_planned_reasons: Counter[str]
    volume_pending_pods: int = 0
    """Pending only because the scheduler waits for its volume claims to bind: the test
    cluster's volume binder still at work, not a place the pod cannot get."""
    pending_reasons: Counter[str] = field(default_factory=Counter)
    """Why the scheduler turned the Pending pods away (`unscheduled_reason`) → pods."""

    def settled(self, expected: int) -> bool:
        """Every job in a settled phase with pods for its attempt, and no pod still waiting
        for a place the operator might yet find it (an older Pending pod found none) or for
        its volumes to bind (the steady window would measure that backlog's aftermath)."""
        return (
            self.jobs == expected
            and all(phase in SETTLED_PHASES for phase in self.phases.elements())
            and self.young_pending_pods == 0
            and self.volume_pending_pods == 0
            and self.running_without_pods == 0
        )

    def signature(self) -> tuple[Any, ...]:
        return (tuple(sorted(self.phases.items())), self.running_pods, self.pending_pods)


def unscheduled_reason(status: Mapping[str, Any]) -> str | None:
    """The scheduler's PodScheduled=False message, its numbers replaced by N so that pods
    turned away for the same reason count together; None when the pod was not turned away."""
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return re.sub(r"\d+", "N", str(c.get("message") or c.get("reason") or "?"))
    return None


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What a status write changed, as "<phase>: field, field" (a condition by its type):
    the steady window's writes counted by what they carried."""
    changed = sorted(
        k for k in old.keys() | new.keys() if k != "conditions" and old.get(k) != new.get(k)
    )
    conditions = {str(c.get("type")): c for c in old.get("conditions") or []}
    for c in new.get("conditions") or []:
        if conditions.get(str(c.get("type"))) != c:
            changed.append(f"conditions[{c.get('type')}]")
    return f"{new.get('phase') or '(none)'}: {', '.join(changed) or '(nothing)'}"


_POSITION = re.compile(r"position (\d+) in the queue")


def position_move(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """How a queued job's position moved between two statuses, by direction and by how far
    against the position shown before (the operator writes a move of less than a tenth
    less often); None unless both show one."""
    before = _POSITION.search(str(old.get("message") or ""))
    after = _POSITION.search(str(new.get("message") or ""))
    if before is None or after is None:
        return None
    shown, now = int(before.group(1)), int(after.group(1))
    if now == shown:
        return "unmoved"
    way = "forward" if now < shown else "back"
    far = "a tenth or more" if abs(now - shown) * 10 >= shown else "less than a tenth"
    return f"{way} {far}"


def _waits_for_volumes(reason: str) -> bool:
    """The scheduler's VolumeBinding plugin: "pod has unbound immediate
    PersistentVolumeClaims"."""
    return "PersistentVolumeClaim" in reason


class Timings(NamedTuple):
    """Per job (namespace, name), server clock, 1 s resolution."""

    created: dict[tuple[str, str], float]
    planned: dict[tuple[str, str], float]
    first_batch_job: dict[tuple[str, str], float]
    first_pod: dict[tuple[str, str], float]
    queued: frozenset[tuple[str, str]]
    """Jobs seen Queued at some point."""
    planned_seen: dict[tuple[str, str], float]
    planned_written: dict[tuple[str, str], float]


def status_written_at(meta: Mapping[str, Any]) -> float | None:
    """The latest time a manager wrote the object's status subresource (`managedFields`)."""
    times = [
        rfc3339_seconds(str(entry["time"]))
        for entry in meta.get("managedFields") or []
        if entry.get("subresource") == "status" and entry.get("time")
    ]
    return max(times) if times else None


class Tracker:
    """FineTuneJobs and trainer pods as the watches see them."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self.jobs: dict[tuple[str, str], JobState] = {}
        self.first_pod: dict[tuple[str, str], float] = {}
        self.first_batch_job: dict[tuple[str, str], float] = {}
        """(namespace, job) → creation time of its first batch Job: the operator's part of
        creation → first pod ends there; the Job controller's part begins."""
        self.pods: dict[tuple[str, str], tuple[tuple[str, str], str, float]] = {}
        """(namespace, pod) → (namespace, job), phase, creation time."""
        self.unscheduled: dict[tuple[str, str], str] = {}
        """Pending pods the scheduler turned away → its reason (`unscheduled_reason`)."""
        self.phase_changes = 0
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}
        """Each job's status as last seen (`status_changes` compares against it)."""
        self.counting_writes = False
        self.steady_seen = False
        """Set when the steady window begins: `burst_writes` stops counting."""
        self.writes: Counter[str] = Counter()
        """While `counting_writes`: what each status change the watch showed changed
        (`status_changes`) → how many."""
        self.moves: Counter[str] = Counter()
        """While `counting_writes`: queued jobs' position moves (`position_move`) → how
        many."""
        self.burst_writes: Counter[str] = Counter()
        """Until the steady window: what each status change the watch showed changed, a
        queued job's move counted as `<phase>: position <move>` (creation → steady)."""
        self.last_phase_change = 0.0
        """When (monotonic) the watch last showed a job change phase."""

    def on_job(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if kind == "DELETED":
            return
        status = obj.get("status") or {}
        with self._lock:
            state = self.jobs.get(key)
            if state is None:
                state = self.jobs[key] = JobState(rfc3339_seconds(meta["creationTimestamp"]))
            before = self.statuses.get(key)
            self.statuses[key] = status
            counting = self.counting_writes or not self.steady_seen
            if counting and before is not None and before != status:
                what = status_changes(before, status)
                move = position_move(before, status)
                if self.counting_writes:
                    self.writes[what] += 1
                    if move is not None:
                        self.moves[move] += 1
                elif not self.steady_seen:
                    self.burst_writes[what if move is None else f"{what}; position {move}"] += 1
            phase = str(status.get("phase") or "")
            if phase != state.phase:
                self.phase_changes += 1
                self.last_phase_change = time.monotonic()
                state.phase = phase
            if phase == "Queued" and not state.queued:
                state.queued = True
                state.first_queued = re.sub(r"\d+", "N", str(status.get("message") or ""))[:160]
            state.pool = str((status.get("plan") or {}).get("pool") or "")
            for cond in status.get("conditions") or []:
                if cond.get("type") != "Planned":
                    continue
                if cond.get("status") == "True" and state.planned_at is None:
                    state.planned_at = rfc3339_seconds(cond["lastTransitionTime"])
                    state.planned_seen = self.clock()
                    state.planned_written = status_written_at(meta)
                elif cond.get("status") != "True":
                    state.not_planned_reason = str(cond.get("reason") or "")

    @staticmethod
    def _keep_first(
        first: dict[tuple[str, str], float], meta: Mapping[str, Any]
    ) -> tuple[tuple[str, str], float]:
        """Record a child's creation time if it is its job's first; (job, creation time)."""
        job = (str(meta.get("namespace")), str((meta.get("labels") or {}).get(LABEL_JOB)))
        created = rfc3339_seconds(meta["creationTimestamp"])
        if created < first.get(job, math.inf):
            first[job] = created
        return job, created

    def on_pod(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            job, created = self._keep_first(self.first_pod, meta)
            self.unscheduled.pop(key, None)
            if kind == "DELETED" or meta.get("deletionTimestamp"):
                self.pods.pop(key, None)
            else:
                status = obj.get("status") or {}
                phase = str(status.get("phase") or "Pending")
                self.pods[key] = (job, phase, created)
                reason = unscheduled_reason(status) if phase == "Pending" else None
                if reason is not None:
                    self.unscheduled[key] = reason

    def on_batch_job(self, kind: str, obj: Mapping[str, Any]) -> None:
        with self._lock:
            self._keep_first(self.first_batch_job, obj.get("metadata") or {})

    def snapshot(self, now: float, patience: float) -> Snapshot:
        """The state at `now` (epoch seconds); a Pending pod younger than `patience` seconds
        is young."""
        with self._lock:
            phases = Counter(s.phase or "(none)" for s in self.jobs.values())
            pod_phases = Counter(phase for _, phase, _ in self.pods.values())
            with_pods = {job for job, _, _ in self.pods.values()}
            running_jobs = [k for k, s in self.jobs.items() if s.phase == "Running"]
            return Snapshot(
                jobs=len(self.jobs),
                planned=sum(1 for s in self.jobs.values() if s.planned_at is not None),
                phases=phases,
                pending_pods=pod_phases["Pending"],
                young_pending_pods=sum(
                    1
                    for _, phase, created in self.pods.values()
                    if phase == "Pending" and now - created < patience
                ),
                running_pods=pod_phases["Running"],
                volume_pending_pods=sum(
                    1 for r in self.unscheduled.values() if _waits_for_volumes(r)
                ),
                pending_reasons=Counter(self.unscheduled.values()),
                running_without_pods=sum(1 for k in running_jobs if k not in with_pods),
                not_planned_reasons=Counter(
                    s.not_planned_reason or "(no Planned condition)"
                    for s in self.jobs.values()
                    if s.planned_at is None
                ),
            )

    def first_queued(self) -> dict[str, int]:
        """How many jobs were first Queued for each reason, commonest first."""
        with self._lock:
            found = Counter(s.first_queued for s in self.jobs.values() if s.queued)
        return dict(found.most_common(8))

    def timings(self) -> Timings:
        with self._lock:
            created = {k: s.created for k, s in self.jobs.items()}
            planned = {k: s.planned_at for k, s in self.jobs.items() if s.planned_at is not None}
            queued = frozenset(k for k, s in self.jobs.items() if s.queued)
            seen = {k: s.planned_seen for k, s in self.jobs.items() if s.planned_seen is not None}
            written = {
                k: s.planned_written for k, s in self.jobs.items() if s.planned_written is not None
            }
            return Timings(
                created,
                planned,
                dict(self.first_batch_job),
                dict(self.first_pod),
                queued,
                seen,
                written,
            )

    def pools(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(s.pool or "(none)" for s in self.jobs.values()))


def latencies(start: Mapping[Any, float], end: Mapping[Any, float]) -> list[float]:
    return [end[k] - start[k] for k in end if k in start]


def launch_latencies(t: Timings) -> dict[str, float]:
    """Creation → first batch Job and → first pod, and batch Job → first pod, p50 and p99,
    over the jobs that have one (NaN where none has); the keys of an operator run's record
    and of a launching `--planned-floor` run's."""
    out: dict[str, float] = {}
    for key, since, at in (
        ("batch_job", t.created, t.first_batch_job),
        ("pod", t.created, t.first_pod),
        ("pod_after_batch_job", t.first_batch_job, t.first_pod),
    ):
        lat = latencies(since, at)
        out[f"{key}_p50_s"] = percentile(lat, 50)
        out[f"{key}_p99_s"] = percentile(lat, 99)
    return out


def first_seen(path: Path) -> dict[tuple[str, str], float]:
    """What `first_events` wrote: (namespace, job) → when a watch first showed it."""
    out: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "job" in record:
            namespace, _, name = str(record["job"]).partition("/")
            out[(namespace, name)] = float(record["at"])
    return out


def after_delivery(
    delivered: Mapping[tuple[str, str], float], planned: Mapping[tuple[str, str], float]
) -> dict[str, Any]:
    """Creation → Planned past the API server's delivery, job by job: when the operator
    decided the job's Planned condition less when the independent watch first saw the job.
    The API server serves the two watches apart, so the operator may come first (negative);
    the condition's time has 1 s resolution (truncated), which moves it down by up to a
    second. Empty when no job has both."""
    after = latencies(delivered, planned)
    if not after:
        return {}
    return {
        "plan_after_delivery_n": len(after),
        "plan_after_delivery_p50_s": percentile(after, 50),
        "plan_after_delivery_p99_s": percentile(after, 99),
    }
