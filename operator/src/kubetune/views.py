"""What the CLI shows of a cluster's objects: tables of FineTuneJobs and GPUPools (`kubetune
get`, `pools`), one job in full (`describe`), its live lines (`watch`), and which trainer
pods' logs to print (`logs`).

Pure: objects in (as the API server returns them), text out. Tables are laid out by rich,
each column as wide as its widest cell, so no value runs into the next one.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kubetune.api.units import about
from kubetune.api.v1alpha1 import GPUPool
from kubetune.api.vocabulary import COMPLETION_INDEX_ANNOTATION, GPU_RESOURCE, TERMINAL_PHASES
from kubetune.control.build.trainer import CONTAINER_NAME

NONE = "-"


def table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[str] = ()
) -> str:
    """Left-aligned text columns, right-aligned `numeric` ones, two spaces apart, laid out
    by rich as wide as their widest cell: never wrapped or cut to a terminal's width (the
    output is read by people and by scripts alike), no colour, no markup in cells."""
    right = set(numeric)
    grid = Table(box=None, pad_edge=False, padding=(0, 1), header_style="", show_edge=False)
    for header in headers:
        grid.add_column(header, justify="right" if header in right else "left", no_wrap=True)
    for row in rows:
        grid.add_row(*row)
    out = io.StringIO()
    Console(
        file=out, width=_UNBOUNDED, color_system=None, highlight=False, markup=False, emoji=False
    ).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


_UNBOUNDED = 100_000
"""The console width tables are laid out in: wider than any row, so none is wrapped."""


def age(created: str | None, now: datetime) -> str:
    """`kubectl`'s short age: 45s, 12m, 3h, 5d."""
    if not created:
        return NONE
    seconds = (now - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit != "m" else 1):
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def _usd(value: Any) -> str:
    return NONE if value is None else f"${float(value):,.2f}"


JOB_COLUMNS = ("NAME", "PHASE", "POOL", "GPUS", "PROGRESS", "ETA", "COST", "AGE")


def job_table(
    jobs: Iterable[Mapping[str, Any]], now: datetime | None = None, namespaces: bool = False
) -> str:
    """One row per FineTuneJob: phase, pool and GPUs of its plan, progress, ETA, cost spent
    of the estimate, age; with `namespaces`, a NAMESPACE column first."""
    now = now or datetime.now(UTC)
    rows = []
    for job in sorted(
        jobs, key=lambda j: (j["metadata"].get("namespace", ""), j["metadata"]["name"])
    ):
        meta, status = job["metadata"], job.get("status") or {}
        plan = status.get("plan") or {}
        progress = status.get("progress") or {}
        cost = status.get("cost") or {}
        total = progress.get("totalSteps") or 0
        done = (
            f"{progress.get('percent', 0)}% ({progress.get('step', 0)}/{total})" if total else NONE
        )
        spent = NONE
        if cost:
            spent = f"{_usd(cost.get('accruedUSD'))} of {_usd(cost.get('estimatedUSD'))}"
        row = [
            meta["name"],
            status.get("phase") or "Pending",
            plan.get("pool") or NONE,
            str(plan.get("totalGPUs") or NONE),
            done,
            progress.get("eta") or NONE,
            spent,
            age(meta.get("creationTimestamp"), now),
        ]
        rows.append([meta.get("namespace", ""), *row] if namespaces else row)
    headers = ["NAMESPACE", *JOB_COLUMNS] if namespaces else list(JOB_COLUMNS)
    return table(headers, rows, numeric=("GPUS",))


POOL_COLUMNS = (
    "NAME",
    "GPU",
    "MEM GiB",
    "GPUS/NODE",
    "NODES",
    "FREE GPUS",
    "$/GPU-H",
    "SPOT",
    "NAMESPACES",
    "STATE",
)


def pool_table(pools: Iterable[Mapping[str, Any]]) -> str:
    """One row per GPUPool: its GPU (with the memory the planner uses), nodes ready of the
    most a job may use, free GPUs, price, spot, the namespaces whose jobs may use it (its
    namespaceSelector, `all` without one), and whether the operator reads it."""
    rows = []
    for obj in sorted(pools, key=lambda p: p["metadata"]["name"]):
        status = obj.get("status") or {}
        try:
            spec = GPUPool.model_validate(
                {"metadata": obj["metadata"], "spec": obj.get("spec") or {}}
            ).spec
        except ValidationError as exc:
            rows.append([obj["metadata"]["name"], NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE,
                         f"unreadable: {exc.errors()[0]['msg']}"])  # fmt: skip
            continue
        valid = next((c for c in status.get("conditions") or [] if c.get("type") == "Valid"), None)
        state = (
            "not seen by the operator"
            if valid is None
            else ("ok" if valid.get("status") == "True" else f"invalid: {valid.get('reason')}")
        )
        seen = status.get("updatedAt") is not None
        rows.append(
            [
                obj["metadata"]["name"],
                spec.gpu.product,
                f"{spec.gpu.memory_gib:g}",
                str(spec.gpus_per_node),
                f"{status.get('nodes', 0)}/{spec.max_nodes}" if seen else f"?/{spec.max_nodes}",
                str(status.get("freeGPUs", 0)) if seen else NONE,
                f"{spec.price_per_gpu_hour:,.2f}",
                "yes" if spec.spot else "no",
                (spec.namespace_selector.describe() if spec.namespace_selector else "") or "all",
                state,
            ]
        )
    return table(
        POOL_COLUMNS, rows, numeric=("MEM GiB", "GPUS/NODE", "NODES", "FREE GPUS", "$/GPU-H")
    )


def hours(seconds: float | None) -> str:
    """A duration as minutes under an hour (`54m`), else hours (`2.9h`)."""
    return NONE if seconds is None else about(seconds)


def describe_job(
    job: Mapping[str, Any], events: Iterable[Mapping[str, Any]], now: datetime | None = None
) -> str:
    """`kubetune describe`: the plan with its alternatives and memory breakdown, progress,
    cost, checkpoint, recoveries, conditions and the job's recent Events."""
    now = now or datetime.now(UTC)
    meta, spec, status = job["metadata"], job.get("spec") or {}, job.get("status") or {}
    lines = [
        f"Name:        {meta['name']}",
        f"Namespace:   {meta.get('namespace', '')}",
        f"Model:       {(spec.get('model') or {}).get('uri', NONE)} ({spec.get('method', NONE)})",
        f"Phase:       {status.get('phase') or 'Pending'}"
        + (f", attempt {status['attempt']}" if status.get("attempt") else "")
        + (f": {status['message']}" if status.get("message") else ""),
    ]
    plan = status.get("plan")
    if plan:
        lines += [
            f"Plan:        r{plan.get('revision', 1)} ({plan.get('reason', NONE)}): "
            f"{plan['method']} "
            f"on {plan['nodes']}×{plan['gpusPerNode']} {plan['gpuProduct']} (pool {plan['pool']}"
            f"{', spot' if plan.get('spot') else ''}), "
            f"~{hours(plan.get('estimatedDurationSeconds'))}, "
            f"~{_usd(plan.get('estimatedCostUSD'))}",
            f"  layout:    micro-batch {plan['microBatchSize']} × accumulation "
            f"{plan['gradientAccumulation']}, sharding {plan['sharding']}, {plan['precision']}, "
            f"{plan['optimizer']}, "
            f"checkpointing {'on' if plan['gradientCheckpointing'] else 'off'}"
            + (", chunked loss" if plan.get("chunkedCrossEntropy") else "")
            + (", fused loss" if plan.get("fusedCrossEntropy") else "")
            + (", activations offloaded" if plan.get("activationOffloading") else "")
            + (", optimizer in backward" if plan.get("optimizerInBackward") else ""),
            f"  memory:    {plan['perGPUMemoryGiB']:.1f} of {plan['gpuMemoryGiB']:g} GiB per GPU: "
            + ", ".join(f"{k} {v:.2f}" for k, v in (plan.get("memoryBreakdownGiB") or {}).items()),
        ]
        for alt in plan.get("alternatives") or []:
            lines.append(
                f"  instead:   {alt['pool']}: {alt['method']} on {alt['totalGPUs']} GPU(s), "
                f"{alt['perGPUMemoryGiB']:.1f} GiB/GPU, "
                f"~{hours(alt['estimatedDurationSeconds'])}, "
                f"~{_usd(alt['estimatedCostUSD'])}"
            )
        for rejected in plan.get("rejected") or []:
            lines.append(f"  not:       {rejected['pool']}: {rejected['reason']}")
    progress = status.get("progress") or {}
    if progress.get("totalSteps"):
        speed = progress.get("tokensPerSecond")
        extra = [
            f"loss {progress['loss']:.3f}" if progress.get("loss") is not None else "",
            f"{speed:,.0f} tok/s" if speed else "",
            f"ETA {progress['eta']}" if progress.get("eta") else "",
        ]
        lines.append(
            f"Progress:    {progress.get('percent', 0)}% ({progress.get('step', 0)}/"
            f"{progress['totalSteps']} steps)" + "".join(f", {e}" for e in extra if e)
        )
    rewards = dpo_rewards(progress)
    if rewards:
        lines.append(f"DPO rewards: {rewards}")
    cost = status.get("cost") or {}
    if cost:
        budget = (spec.get("resources") or {}).get("maxCostUSD")
        lines.append(
            f"Cost:        {_usd(cost.get('accruedUSD'))} spent "
            f"of ~{_usd(cost.get('estimatedUSD'))}"
            + (f" at {_usd(cost['rateUSDPerHour'])}/h" if cost.get("rateUSDPerHour") else "")
            + (f"; budget {_usd(budget)}" if budget is not None else "")
        )
    checkpoint = status.get("checkpoint")
    if checkpoint:
        lines.append(
            f"Checkpoint:  step {checkpoint['latestStep']}, {age(checkpoint.get('time'), now)} ago"
        )
    for recovery in status.get("recoveries") or []:
        lines.append(
            f"Recovered:   {recovery['reason']} {age(recovery.get('time'), now)} ago"
            + (
                f", resumed from step {recovery['step']}"
                if recovery.get("step") is not None
                else ""
            )
            + (f": {recovery['message']}" if recovery.get("message") else "")
        )
    conditions = status.get("conditions") or []
    if conditions:
        lines += ["", "Conditions:"]
        rows = [[c["type"], c["status"], c.get("reason", ""), age(c.get("lastTransitionTime"), now),
                 c.get("message", "")] for c in conditions]  # fmt: skip
        lines += [
            "  " + ln
            for ln in table(["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"], rows).splitlines()
        ]
    recent = sorted(events, key=_event_order)[-10:]
    lines += ["", "Events:" if recent else "Events:      none"]
    if recent:
        rows = [[age(_event_time(e) or None, now), e.get("type", ""), e.get("reason", ""),
                 e.get("message", "")] for e in recent]  # fmt: skip
        lines += [
            "  " + ln for ln in table(["AGE", "TYPE", "REASON", "MESSAGE"], rows).splitlines()
        ]
    return "\n".join(lines)


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _event_order(event: Mapping[str, Any]) -> tuple[str, int]:
    """By time, then (same second) by when the API server stored it."""
    version = str((event.get("metadata") or {}).get("resourceVersion") or "")
    return _event_time(event), int(version) if version.isdigit() else 0


# ---------------------------------------------------------------------- logs

_RANK_TAG = re.compile(r" rank(\d+) ")
"""How the trainer's log lines name their rank (`<time> rank3 INFO ...`, its logging format)."""


@dataclass(frozen=True)
class LogSource:
    """One trainer pod whose log `kubetune logs` prints: the pod, the prefix its lines get
    when several pods are printed, and the rank whose lines are kept (None: all)."""

    pod: str
    prefix: str
    rank: int | None = None

    def keep(self, line: str) -> bool:
        """A line of this source's rank, or one that names no rank (torchrun's, Python's)."""
        if self.rank is None:
            return True
        tag = _RANK_TAG.search(line)
        return tag is None or int(tag.group(1)) == self.rank


def pod_index(pod: Mapping[str, Any]) -> int:
    """A trainer pod's node rank: its Indexed Job completion index."""
    meta = pod.get("metadata") or {}
    value = (meta.get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION) or (
        meta.get("labels") or {}
    ).get(COMPLETION_INDEX_ANNOTATION, "0")
    return int(value) if str(value).isdigit() else 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """Processes (ranks) a trainer pod runs: the GPUs its trainer container asks for."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == CONTAINER_NAME:
            resources = container.get("resources") or {}
            wanted = (resources.get("limits") or resources.get("requests") or {}).get(
                GPU_RESOURCE, 1
            )
            return max(1, int(wanted))
    return 1


def log_sources(
    pods: Iterable[Mapping[str, Any]], attempt: int, rank: int | None = None
) -> list[LogSource]:
    """The pods of one attempt to print, in node order (several of one index: oldest first);
    with `rank`, only the pod that runs it, keeping its lines. Raises ValueError when no pod
    runs `rank`."""
    ordered = sorted(
        pods,
        key=lambda p: (pod_index(p), str((p.get("metadata") or {}).get("creationTimestamp"))),
    )
    if rank is not None:
        ordered = [
            p
            for p in ordered
            if pod_index(p) * pod_gpus(p) <= rank < (pod_index(p) + 1) * pod_gpus(p)
        ]
        if not ordered:
            raise ValueError(f"no pod of attempt {attempt} runs rank {rank}")
    several = len(ordered) > 1
    return [
        LogSource(
            pod=str(p["metadata"]["name"]),
            prefix=f"[a{attempt}/node{pod_index(p)}] " if several else "",
            rank=rank,
        )
        for p in ordered
    ]


# ---------------------------------------------------------------------- watch


def plan_line(plan: Mapping[str, Any]) -> str:
    """A job's plan in one line, as `kubetune watch` prints it when it appears or changes."""
    return (
        f"plan r{plan.get('revision', 1)}: {plan['method']} on {plan['totalGPUs']}× "
        f"{plan['gpuProduct']} (pool {plan['pool']}), ~{plan['perGPUMemoryGiB']:.1f} GiB/GPU, "
        f"{plan['totalSteps']} steps, micro-batch {plan['microBatchSize']} × accumulation "
        f"{plan['gradientAccumulation']}, ~{hours(plan.get('estimatedDurationSeconds'))}, "
        f"~{_usd(plan.get('estimatedCostUSD'))}"
    )


def dpo_rewards(progress: Mapping[str, Any]) -> str:
    """A DPO job's implicit rewards in words, e.g. `accuracy 0.88 (eval 0.92), margin 0.41
    (eval 0.38), chosen 0.21, rejected -0.20`; empty for an SFT job or before the first step."""

    def pair(name: str, train: str, held_out: str) -> str:
        value, at_eval = progress.get(train), progress.get(held_out)
        if value is None and at_eval is None:
            return ""
        text = f"{name} {value:.2f}" if value is not None else f"{name} -"
        return text + (f" (eval {at_eval:.2f})" if at_eval is not None else "")

    parts = [
        pair("accuracy", "dpoRewardAccuracy", "evalDpoRewardAccuracy"),
        pair("margin", "dpoRewardMargin", "evalDpoRewardMargin"),
        *(
            f"{name} {progress[key]:.2f}"
            for name, key in (("chosen", "dpoRewardsChosen"), ("rejected", "dpoRewardsRejected"))
            if progress.get(key) is not None
        ),
    ]
    return ", ".join(p for p in parts if p)


def _progress_parts(job: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The parts of a job's progress line: those whose change is news (phase, attempt, step,
    checkpoint, message), and those that only move along with them (loss, ETA, cost)."""
    status = job.get("status") or {}
    progress = status.get("progress") or {}
    news = [f"{status.get('phase') or 'Pending':<9}"]
    extra: list[str] = []
    if status.get("attempt"):
        news.append(f"attempt {status['attempt']}")
    if progress.get("totalSteps"):
        news.append(f"step {progress.get('step', 0)}/{progress['totalSteps']}")
        if progress.get("loss") is not None:
            extra.append(f"loss {progress['loss']:.4f}")
        if progress.get("dpoRewardAccuracy") is not None:
            extra.append(f"reward accuracy {progress['dpoRewardAccuracy']:.2f}")
        if progress.get("eta"):
            extra.append(f"ETA {progress['eta']}")
    checkpoint = status.get("checkpoint") or {}
    if checkpoint:
        news.append(f"checkpoint step {checkpoint.get('latestStep')}")
    cost = (status.get("cost") or {}).get("accruedUSD")
    if cost is not None:
        extra.append(f"cost ${float(cost):.4f}")
    if status.get("message") and status.get("phase") != "Running":
        news.append(f"- {status['message']}")
    return news, extra


def progress_line(job: Mapping[str, Any]) -> str:
    """A job's state in one line: phase, attempt, step, loss, ETA, checkpoint, cost so far,
    and the status message of a job that is not running."""
    news, extra = _progress_parts(job)
    message = [p for p in news if p.startswith("- ")]
    rest = [p for p in news if not p.startswith("- ")]
    return "  ".join([*rest, *extra, *message]).rstrip()


class Watcher:
    """What `kubetune watch` prints as a job changes: its plan whenever a new revision
    appears, the job's new Events, and a progress line whenever the phase, attempt, step,
    checkpoint or message moved (not for the cost alone). Feed it each look at the job and
    its Events; it returns the lines to print."""

    def __init__(self) -> None:
        self._revision: int | None = None
        self._news: list[str] = []
        self._events: set[str] = set()

    def update(self, job: Mapping[str, Any], events: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        status = job.get("status") or {}
        lines = []
        plan = status.get("plan")
        if plan and plan.get("revision", 1) != self._revision:
            self._revision = plan.get("revision", 1)
            lines.append(plan_line(plan))
        lines += self._new_events(events)
        news, _ = _progress_parts(job)
        if news != self._news:
            self._news = news
            lines.append(progress_line(job))
        return lines

    def _new_events(self, events: Iterable[Mapping[str, Any]]) -> list[str]:
        lines = []
        for event in sorted(events, key=_event_order):
            key = f"{(event.get('metadata') or {}).get('uid') or id(event)}/{event.get('count')}"
            if key in self._events:
                continue
            self._events.add(key)
            lines.append(
                f"event {event.get('type', '')} {event.get('reason', '')}: "
                f"{event.get('message', '')}"
            )
        return lines


class ObjectWatcher:
    """`kubetune watch -o json|yaml`: the whole job each time it changed (its
    resourceVersion), as `kubectl get -w -o json|yaml` prints objects."""

    def __init__(self, output: str) -> None:
        self._output = output
        self._version: str | None = None

    def update(self, job: Mapping[str, Any], events: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        version = str((job.get("metadata") or {}).get("resourceVersion"))
        if version == self._version:
            return []
        self._version = version
        # YAML documents of a stream are separated as kubectl separates them.
        return [dump(job, self._output) if self._output == "json" else "---\n" + dump(job, "yaml")]


def dump(value: Mapping[str, Any], output: str) -> str:
    """`value` as JSON or YAML (`output`), as kubectl prints objects."""
    if output == "json":
        return json.dumps(value, indent=2)
    return yaml.safe_dump(dict(value), sort_keys=False).rstrip("\n")


def outcome(job: Mapping[str, Any]) -> str | None:
    """The phase of a finished job (Succeeded or Failed), else None."""
    phase = (job.get("status") or {}).get("phase")
    return str(phase) if phase in TERMINAL_PHASES else None
