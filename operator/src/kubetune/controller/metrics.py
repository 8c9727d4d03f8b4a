"""Operator metrics for Prometheus (prometheus-client), served by the operator process.

Two kinds of series:

* State: what each FineTuneJob and GPUPool looks like now (phase, plan, cost, progress,
  capacity). Handlers hand every status they write to `observe_job`/`observe_pool`; the
  values are kept in a small registry and turned into series at scrape time, so a job's
  series disappear the moment `forget_job` drops it, and jobs-by-phase is always a count
  of what is there rather than a sum of increments.
* Events: plans made, recoveries, finished jobs, time to plan, time to running, queue
  wait, reconcile duration and errors. These are counters and histograms, updated when
  `observe_job` sees a transition between the status before a reconcile and after it.

Names follow `kubetune_<thing>_<unit>` with base units (seconds, bytes, US dollars as
`_usd`, ratios 0-1) and `_total` on counters. Per-job series carry `namespace` and
`finetunejob` labels; the chart's ServiceMonitor keeps them with `honorLabels`.
docs/metrics.md lists every series.

This module imports neither kopf nor a Kubernetes client: it works on plain dicts in the
wire format of the CRDs (camelCase), so the handlers can pass `status.to_wire()` and
`dict(body)` directly.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kubetune.api.vocabulary import (
    TERMINAL_PHASES,
    ConditionType,
    Phase,
    PlanReason,
    RecoveryReason,
)
from kubetune.controller.settings import metrics_port_from_env

__all__ = [
    "FINISHED_PHASES",
    "METRICS",
    "PHASES",
    "PLAN_REASONS",
    "RECOVERY_REASONS",
    "OperatorMetrics",
    "forget_job",
    "forget_pool",
    "observe_job",
    "observe_pool",
    "reconcile_timer",
    "start_server",
]

GIB = 1024**3
PHASES: tuple[str, ...] = tuple(Phase)
"""Values of the `phase` label, every one present from the start."""
FINISHED_PHASES: tuple[str, ...] = tuple(p for p in Phase if p in TERMINAL_PHASES)
RECOVERY_REASONS: tuple[str, ...] = tuple(RecoveryReason)
STATUS_WRITE_RESULTS: tuple[str, ...] = ("ok", "rejected", "failed")
PLAN_REASONS: tuple[str, ...] = tuple(PlanReason)

# Planning takes seconds; launching takes seconds (pods present) to hours (queued for GPUs).
_PLAN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 600)
_WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
LOOP_LAG_EVERY_S = 0.5
_RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _version() -> str:
    try:
        return importlib.metadata.version("kubetune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parse_time(value: Any) -> float | None:
    """Unix seconds of an RFC 3339 timestamp (as the API server and our status write them)."""
    if not value:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _condition_time(status: Mapping[str, Any], type_: str, wanted: str = "True") -> float | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == wanted:
            return _parse_time(cond.get("lastTransitionTime"))
    return None


def _recoveries(status: Mapping[str, Any]) -> dict[str, int]:
    """Recoveries by reason; reasons outside the closed set are not counted, so that the
    `reason` label stays bounded whatever a status holds."""
    counts = dict.fromkeys(RECOVERY_REASONS, 0)
    for rec in status.get("recoveries") or []:
        reason = str(rec.get("reason"))
        if reason in counts:
            counts[reason] += 1
    # The list keeps only the latest entries of earlier attempts; the counters keep all.
    for reason, n in (status.get("recoveryCounts") or {}).items():
        if reason in counts and isinstance(n, int):
            counts[reason] = max(counts[reason], n)
    return counts


@dataclass
class _Job:
    """What the collector needs of one FineTuneJob, distilled from its last status."""

    phase: str = Phase.PENDING
    pool: str = ""
    method: str = ""
    gpu_product: str = ""
    spot: bool = False
    gpus: int = 0
    gpu_memory_bytes: float | None = None
    estimated_gpu_memory_bytes: float | None = None
    estimated_cost_usd: float | None = None
    estimated_tokens_per_second: float | None = None
    accrued_cost_usd: float = 0.0
    cost_rate_usd_per_hour: float | None = None
    budget_usd: float | None = None
    step: int = 0
    total_steps: int = 0
    eta_seconds: float | None = None
    last_progress: float | None = None
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    restarts: int = 0
    recoveries: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pool:
    nodes: int = 0
    allocatable_gpus: int = 0
    free_gpus: int = 0
    price_per_gpu_hour_usd: float | None = None


class _StateCollector(Collector):
    def __init__(self, owner: OperatorMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kubetune_operator_info", "1 per operator process; `version` label", labels=["version"]
        )
        info.add_metric([_version()], 1)
        yield info
        with self.owner._lock:
            jobs = dict(self.owner._jobs)
            pools = dict(self.owner._pools)
            reconciled = dict(self.owner._reconciled)
        last = GaugeMetricFamily(
            "kubetune_finetunejob_last_reconcile_timestamp_seconds",
            "When the operator last completed a reconcile of this unfinished job (Unix time; "
            "time() minus this is its age)",
            labels=["namespace", "finetunejob"],
        )
        for (namespace, name), when in sorted(reconciled.items()):
            last.add_metric([namespace, name], when)
        yield last
        yield from _job_families(jobs)
        yield from _pool_families(jobs, pools)


def _job_families(jobs: Mapping[tuple[str, str], _Job]) -> Iterator[Metric]:
    by_phase = GaugeMetricFamily(
        "kubetune_finetunejobs",
        "FineTuneJobs by phase (from the operator's view)",
        labels=["phase"],
    )
    counts = dict.fromkeys(PHASES, 0)
    for job in jobs.values():
        if job.phase in counts:
            counts[job.phase] += 1
    for phase, n in counts.items():
        by_phase.add_metric([phase], n)
    yield by_phase
    ordered = sorted(jobs.items())
    yield from _job_plan_families(ordered)
    for name, documentation, value_of in _JOB_GAUGES:
        gauge = GaugeMetricFamily(name, documentation, labels=_JOB_KEY)
        for (namespace, job_name), job in ordered:
            value = value_of(job)
            if value is not None:
                gauge.add_metric([namespace, job_name], value)
        yield gauge
    yield from _job_counter_families(ordered)


_JOB_KEY = ("namespace", "finetunejob")
_JOB_GAUGES: tuple[tuple[str, str, Callable[[_Job], float | None]], ...] = (
    (
        "kubetune_finetunejob_estimated_cost_usd",
        "Planned total cost",
        lambda j: j.estimated_cost_usd,
    ),
    (
        "kubetune_finetunejob_estimated_tokens_per_second",
        "Planned cluster-wide throughput (the throughput model's figure)",
        lambda j: j.estimated_tokens_per_second,
    ),
    ("kubetune_finetunejob_accrued_cost_usd", "Cost accrued so far", lambda j: j.accrued_cost_usd),
    (
        "kubetune_finetunejob_cost_rate_usd_per_hour",
        "Current spend rate",
        lambda j: j.cost_rate_usd_per_hour,
    ),
    (
        "kubetune_finetunejob_budget_usd",
        "spec.resources.maxCostUSD, when set",
        lambda j: j.budget_usd,
    ),
    ("kubetune_finetunejob_step", "Optimizer steps done (as last read)", lambda j: j.step),
    ("kubetune_finetunejob_total_steps", "Optimizer steps planned", lambda j: j.total_steps),
    (
        "kubetune_finetunejob_progress_ratio",
        "step / totalSteps (0-1)",
        lambda j: j.step / j.total_steps if j.total_steps else 0.0,
    ),
    (
        "kubetune_finetunejob_eta_seconds",
        "Estimated seconds of training left",
        lambda j: j.eta_seconds,
    ),
    (
        "kubetune_finetunejob_last_progress_timestamp_seconds",
        "When the step count last moved (Unix time)",
        lambda j: j.last_progress,
    ),
    (
        "kubetune_finetunejob_checkpoint_step",
        "Step of the newest complete checkpoint",
        lambda j: j.checkpoint_step,
    ),
    (
        "kubetune_finetunejob_checkpoint_timestamp_seconds",
        "When the newest complete checkpoint was written (Unix time)",
        lambda j: j.checkpoint_time,
    ),
)
"""The per-job gauges labelled by the job alone: (name, help, the value, None for no
sample), in the order they are exposed."""


def _job_plan_families(jobs: list[tuple[tuple[str, str], _Job]]) -> Iterator[Metric]:
    """The series of a job's plan, labelled with its pool (and method)."""
    key = _JOB_KEY
    info = GaugeMetricFamily(
        "kubetune_finetunejob_info",
        "1 per FineTuneJob; labels carry its phase and plan",
        labels=[*key, "phase", "pool", "method", "gpu_product", "spot"],
    )
    gpus = GaugeMetricFamily(
        "kubetune_finetunejob_gpus", "GPUs of the current plan", labels=[*key, "pool"]
    )
    capacity = GaugeMetricFamily(
        "kubetune_finetunejob_gpu_memory_capacity_bytes",
        "Memory of one GPU of the plan's pool (status.plan.gpuMemoryGiB)",
        labels=[*key, "pool"],
    )
    memory = GaugeMetricFamily(
        "kubetune_finetunejob_estimated_gpu_memory_bytes",
        "Planned peak memory per GPU (the estimator's figure, safety factor not included)",
        labels=[*key, "pool", "method"],
    )
    for (namespace, name), job in jobs:
        k = [namespace, name]
        info.add_metric(
            [*k, job.phase, job.pool, job.method, job.gpu_product, str(job.spot).lower()], 1
        )
        if job.pool:
            gpus.add_metric([*k, job.pool], job.gpus)
        if job.gpu_memory_bytes is not None:
            capacity.add_metric([*k, job.pool], job.gpu_memory_bytes)
        if job.estimated_gpu_memory_bytes is not None:
            memory.add_metric([*k, job.pool, job.method], job.estimated_gpu_memory_bytes)
    yield from (info, gpus, capacity, memory)


def _job_counter_families(jobs: list[tuple[tuple[str, str], _Job]]) -> Iterator[Metric]:
    restarts = CounterMetricFamily(
        "kubetune_finetunejob_restarts", "Trainer relaunches of this job", labels=_JOB_KEY
    )
    recoveries = CounterMetricFamily(
        "kubetune_finetunejob_recoveries",
        "Failures the operator handled for this job, by reason",
        labels=[*_JOB_KEY, "reason"],
    )
    for (namespace, name), job in jobs:
        restarts.add_metric([namespace, name], job.restarts)
        for reason, n in sorted(job.recoveries.items()):
            recoveries.add_metric([namespace, name, reason], n)
    yield from (restarts, recoveries)


def _pool_families(
    jobs: Mapping[tuple[str, str], _Job], pools: Mapping[str, _Pool]
) -> Iterator[Metric]:
    in_use = GaugeMetricFamily(
        "kubetune_gpupool_gpus_in_use", "GPUs planned for Running jobs, by pool", labels=["pool"]
    )
    used: dict[str, int] = dict.fromkeys(pools, 0)
    for job in jobs.values():
        if job.phase == Phase.RUNNING and job.pool:
            used[job.pool] = used.get(job.pool, 0) + job.gpus
    for pool, n in sorted(used.items()):
        in_use.add_metric([pool], n)
    yield in_use
    nodes = GaugeMetricFamily("kubetune_gpupool_nodes", "Ready nodes of the pool", labels=["pool"])
    alloc = GaugeMetricFamily(
        "kubetune_gpupool_allocatable_gpus", "Allocatable GPUs on the pool's nodes", labels=["pool"]
    )
    free = GaugeMetricFamily(
        "kubetune_gpupool_free_gpus", "GPUs no running pod holds", labels=["pool"]
    )
    price = GaugeMetricFamily(
        "kubetune_gpupool_price_per_gpu_hour_usd", "Price of one GPU-hour", labels=["pool"]
    )
    for name, state in sorted(pools.items()):
        nodes.add_metric([name], state.nodes)
        alloc.add_metric([name], state.allocatable_gpus)
        free.add_metric([name], state.free_gpus)
        if state.price_per_gpu_hour_usd is not None:
            price.add_metric([name], state.price_per_gpu_hour_usd)
    yield from (nodes, alloc, free, price)


class OperatorMetrics:
    """Metric objects and job state of one operator process (one registry per instance)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, runtime: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._pools: dict[str, _Pool] = {}
        self._reconciled: dict[tuple[str, str], float] = {}
        self._server: Any = None
        r = self.registry
        self._add_operator_metrics(r)
        self._add_job_metrics(r)
        for result in STATUS_WRITE_RESULTS:
            self.status_writes.labels(result)
        for phase in FINISHED_PHASES:
            self.finished.labels(phase)
        for reason in RECOVERY_REASONS:
            self.recoveries.labels(reason)
        r.register(_StateCollector(self))
        if runtime:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def _add_operator_metrics(self, r: CollectorRegistry) -> None:
        """How the operator itself keeps up: its handler runs, worker threads, event loop and
        status writes."""
        self.reconcile_duration = Histogram(
            "kubetune_reconcile_duration_seconds",
            "Time one handler run took",
            ["handler"],
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.reconcile_errors = Counter(
            "kubetune_reconcile_errors",
            "Handler runs that raised, by handler and exception type",
            ["handler", "error"],
            registry=r,
        )
        self.reconcile_wait = Histogram(
            "kubetune_reconcile_wait_seconds",
            "Time a job's look waited for a reconcile worker thread "
            "(KUBETUNE_PLANNER_WORKERS) before it could decide",
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "kubetune_event_loop_lag_seconds",
            "How late the operator's event loop ran a timer that was due (sampled every "
            f"{LOOP_LAG_EVERY_S} s): the time every watch event, job look and API call waits "
            "for the operator itself",
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.status_writes = Counter(
            "kubetune_status_writes",
            "Status writes of FineTuneJobs and GPUPools, by result: ok, rejected (HTTP 422, "
            "the job is marked StatusRejected) or failed (retries exhausted; tried again later)",
            ["result"],
            registry=r,
        )

    def _add_job_metrics(self, r: CollectorRegistry) -> None:
        """What happens to jobs: time to plan, to start and in the queue; plans, recoveries
        and finished jobs."""
        self.time_to_plan = Histogram(
            "kubetune_finetunejob_time_to_plan_seconds",
            "From a job's creation to its first plan",
            buckets=_PLAN_BUCKETS,
            registry=r,
        )
        self.time_to_loop = Histogram(
            "kubetune_finetunejob_time_to_loop_seconds",
            "From a new job's creation to the start of its loop in the operator: the API "
            "server's watch and the operator's event handling, before any planning",
            buckets=_PLAN_BUCKETS,
            registry=r,
        )
        self.time_to_running = Histogram(
            "kubetune_finetunejob_time_to_running_seconds",
            "From a job's creation to phase Running for the first time",
            ["pool"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kubetune_finetunejob_queue_wait_seconds",
            "Time a job spent Queued for capacity, observed when it leaves the queue",
            ["pool"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.plans = Counter(
            "kubetune_plans",
            "Plans made (first plans and re-plans), by chosen pool, method and reason",
            ["pool", "method", "reason"],
            registry=r,
        )
        self.recoveries = Counter(
            "kubetune_recoveries",
            "Failures the operator handled, by reason",
            ["reason"],
            registry=r,
        )
        self.finished = Counter(
            "kubetune_finetunejobs_finished",
            "Jobs that reached Succeeded or Failed",
            ["phase"],
            registry=r,
        )

    # ------------------------------------------------------------------ jobs

    def loop_started(self, created: Any, now: float | None = None) -> None:
        """A job the operator has not looked at before got its loop: how long after its
        creation (`now`: Unix seconds, default the clock)."""
        at = _parse_time(created)
        if at is not None:
            self.time_to_loop.observe(max(0.0, (time.time() if now is None else now) - at))

    def observe_job(
        self,
        body: Mapping[str, Any],
        status: Mapping[str, Any] | None = None,
        *,
        now: float | None = None,
    ) -> None:
        """Record a job after a reconcile.

        `body` is the object as the handler received it (metadata, spec, and the status
        before this reconcile); `status` is the status the handler is about to write, in
        wire format (`FineTuneJobStatus.to_wire()`), or None to take `body["status"]`.
        Transitions between the two update the event counters and histograms, so calling
        this twice with the same pair counts twice: call it once per reconcile.
        """
        now = time.time() if now is None else now
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        before: Mapping[str, Any] = body.get("status") or {}
        after: Mapping[str, Any] = before if status is None else status
        spec: Mapping[str, Any] = body.get("spec") or {}
        created = _parse_time(meta.get("creationTimestamp"))
        with self._lock:
            old = self._jobs.get(key)
            job = _distill(after, spec, old, now)
            self._jobs[key] = job
        if status is not None:
            self._count_transitions(before, after, job, created, now)

    def _count_transitions(
        self,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        job: _Job,
        created: float | None,
        now: float,
    ) -> None:
        old_plan = before.get("plan") or {}
        new_plan = after.get("plan") or {}
        if new_plan and new_plan.get("revision", 1) != old_plan.get("revision"):
            reason = str(new_plan.get("reason", PlanReason.INITIAL))
            if reason in PLAN_REASONS:
                self.plans.labels(
                    str(new_plan.get("pool", "")), str(new_plan.get("method", "")), reason
                ).inc()
            if not old_plan and created is not None:
                self.time_to_plan.observe(max(0.0, now - created))
        old_phase = before.get("phase") or Phase.PENDING
        new_phase = after.get("phase") or Phase.PENDING
        if not before.get("startTime") and after.get("startTime") and created is not None:
            started = _parse_time(after.get("startTime")) or now
            self.time_to_running.labels(job.pool).observe(max(0.0, started - created))
        if old_phase == Phase.QUEUED and new_phase != Phase.QUEUED:
            since = _condition_time(before, ConditionType.QUEUED)
            if since is not None:
                self.queue_wait.labels(str(old_plan.get("pool", ""))).observe(max(0.0, now - since))
        if new_phase in FINISHED_PHASES and old_phase != new_phase:
            self.finished.labels(new_phase).inc()
        old_rec = _recoveries(before)
        for reason, n in _recoveries(after).items():
            if n > old_rec.get(reason, 0):
                self.recoveries.labels(reason).inc(n - old_rec.get(reason, 0))

    def forget_job(self, namespace: str, name: str) -> None:
        """Drop a deleted job: its series vanish from the next scrape."""
        with self._lock:
            self._jobs.pop((namespace, name), None)
            self._reconciled.pop((namespace, name), None)

    def reconciled(self, namespace: str, name: str, when: float | None) -> None:
        """A job's last complete reconcile (status written), as a Unix time; None for a
        finished job, which is not looked at again until its TTL."""
        with self._lock:
            if when is None:
                self._reconciled.pop((namespace, name), None)
            else:
                self._reconciled[(namespace, name)] = when

    def reconciled_times(self) -> dict[tuple[str, str], float]:
        with self._lock:
            return dict(self._reconciled)

    # ------------------------------------------------------------------ pools

    def observe_pool(
        self, body: Mapping[str, Any], status: Mapping[str, Any] | None = None
    ) -> None:
        """Record a GPUPool's capacity (`status` as the pool handler patches it)."""
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        st: Mapping[str, Any] = status if status is not None else (body.get("status") or {})
        with self._lock:
            old = self._pools.get(str(meta.get("name")), _Pool())
            self._pools[str(meta.get("name"))] = _Pool(
                nodes=int(st.get("nodes", old.nodes) or 0),
                allocatable_gpus=int(st.get("allocatableGPUs", old.allocatable_gpus) or 0),
                free_gpus=int(st.get("freeGPUs", old.free_gpus) or 0),
                price_per_gpu_hour_usd=_float(spec.get("pricePerGPUHour")),
            )

    def forget_pool(self, name: str) -> None:
        with self._lock:
            self._pools.pop(name, None)

    # ------------------------------------------------------------------ handlers

    @contextmanager
    def reconcile_timer(self, handler: str) -> Iterator[None]:
        """Time a handler run; an exception counts as an error (by type) and propagates."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self.reconcile_errors.labels(handler, type(exc).__name__).inc()
            raise
        finally:
            self.reconcile_duration.labels(handler).observe(time.perf_counter() - t0)

    # ------------------------------------------------------------------ serving

    def start_server(self, port: int | None = None, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (None: KUBETUNE_METRICS_PORT's; 0: any free port).

        Returns the bound port, or -1 when disabled with KUBETUNE_METRICS_PORT=-1.
        Calling it again returns the running server's port.
        """
        if self._server is not None:
            return int(self._server.server_port)
        if port is None:
            port = metrics_port_from_env()
        if port < 0:
            return -1
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _distill(
    status: Mapping[str, Any], spec: Mapping[str, Any], old: _Job | None, now: float
) -> _Job:
    plan = status.get("plan") or {}
    progress = status.get("progress") or {}
    cost = status.get("cost") or {}
    ckpt = status.get("checkpoint") or {}
    resources = spec.get("resources") or {}
    step = int(progress.get("step") or 0)
    last_progress = old.last_progress if old is not None else None
    if old is None or step != old.step:
        # First sight: the progress time the operator wrote, else now.
        if old is None and progress.get("updatedAt"):
            last_progress = _parse_time(progress.get("updatedAt"))
        else:
            last_progress = now
    per_gpu_gib = _float(plan.get("perGPUMemoryGiB"))
    gpu_gib = _float(plan.get("gpuMemoryGiB"))
    recoveries = _recoveries(status)
    if old is not None:
        # Counters never go down, even if the status list is trimmed.
        for reason, n in old.recoveries.items():
            recoveries[reason] = max(n, recoveries.get(reason, 0))
    return _Job(
        phase=str(status.get("phase") or Phase.PENDING),
        pool=str(plan.get("pool") or ""),
        method=str(plan.get("method") or ""),
        gpu_product=str(plan.get("gpuProduct") or ""),
        spot=bool(plan.get("spot", False)),
        gpus=int(plan.get("totalGPUs") or 0),
        gpu_memory_bytes=gpu_gib * GIB if gpu_gib is not None else None,
        estimated_gpu_memory_bytes=per_gpu_gib * GIB if per_gpu_gib is not None else None,
        estimated_cost_usd=_float(cost.get("estimatedUSD", plan.get("estimatedCostUSD"))),
        estimated_tokens_per_second=_float(plan.get("estimatedTokensPerSecond")),
        accrued_cost_usd=_float(cost.get("accruedUSD")) or 0.0,
        cost_rate_usd_per_hour=_float(cost.get("rateUSDPerHour")),
        budget_usd=_float(resources.get("maxCostUSD")),
        step=step,
        total_steps=int(progress.get("totalSteps") or plan.get("totalSteps") or 0),
        eta_seconds=_float(progress.get("etaSeconds")),
        last_progress=last_progress,
        checkpoint_step=int(ckpt["latestStep"]) if ckpt.get("latestStep") is not None else None,
        checkpoint_time=_parse_time(ckpt.get("time")),
        restarts=max(int(status.get("restarts") or 0), old.restarts if old else 0),
        recoveries=recoveries,
    )


#: The operator's metrics; the module-level functions below act on it.
METRICS = OperatorMetrics()


def observe_job(
    body: Mapping[str, Any], status: Mapping[str, Any] | None = None, *, now: float | None = None
) -> None:
    METRICS.observe_job(body, status, now=now)


def forget_job(namespace: str, name: str) -> None:
    METRICS.forget_job(namespace, name)


def reconciled(namespace: str, name: str, when: float | None) -> None:
    METRICS.reconciled(namespace, name, when)


def loop_started(created: str | None) -> None:
    METRICS.loop_started(created)


def reconcile_waited(seconds: float) -> None:
    METRICS.reconcile_wait.observe(seconds)


async def sample_loop_lag(
    every: float = LOOP_LAG_EVERY_S, metrics: OperatorMetrics | None = None
) -> None:
    """Observe, until cancelled, how late the running event loop wakes a sleep that is due:
    the wait of everything else on the loop at that moment."""
    histogram = (metrics or METRICS).loop_lag
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every
        await asyncio.sleep(every)
        histogram.observe(max(0.0, loop.time() - due))


def status_write(result: str) -> None:
    METRICS.status_writes.labels(result).inc()


def observe_pool(body: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> None:
    METRICS.observe_pool(body, status)


def forget_pool(name: str) -> None:
    METRICS.forget_pool(name)


def reconcile_timer(handler: str) -> Any:
    return METRICS.reconcile_timer(handler)


def start_server(port: int | None = None, addr: str = "0.0.0.0") -> int:
    return METRICS.start_server(port, addr)
