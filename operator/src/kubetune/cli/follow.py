"""What the CLI prints while it follows a job: its plan, progress and Events as they change
(`kubetune watch`), and which trainer pods' logs `kubetune logs` prints, with which prefix.

Pure, as views.py: objects in (as the API server returns them), text out; readers.py does
the reading and the waiting.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubetune.api.vocabulary import (
    COMPLETION_INDEX_ANNOTATION,
    GPU_RESOURCE,
    TERMINAL_PHASES,
    Phase,
)
from kubetune.cli.views import dump, event_order, hours, usd
from kubetune.control.build.trainer import CONTAINER_NAME

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


def plan_line(plan: Mapping[str, Any]) -> str:
    """A job's plan in one line, as `kubetune watch` prints it when it appears or changes."""
    return (
        f"plan r{plan.get('revision', 1)}: {plan['method']} on {plan['totalGPUs']}× "
        f"{plan['gpuProduct']} (pool {plan['pool']}), ~{plan['perGPUMemoryGiB']:.1f} GiB/GPU, "
        f"{plan['totalSteps']} steps, micro-batch {plan['microBatchSize']} × accumulation "
        f"{plan['gradientAccumulation']}, ~{hours(plan.get('estimatedDurationSeconds'))}, "
        f"~{usd(plan.get('estimatedCostUSD'))}"
    )


def _progress_parts(job: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The parts of a job's progress line: those whose change is news (phase, attempt, step,
    checkpoint, message), and those that only move along with them (loss, ETA, cost)."""
    status = job.get("status") or {}
    progress = status.get("progress") or {}
    news = [f"{status.get('phase') or Phase.PENDING:<9}"]
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
    if status.get("message") and status.get("phase") != Phase.RUNNING:
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
        for event in sorted(events, key=event_order):
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


def outcome(job: Mapping[str, Any]) -> str | None:
    """The phase of a finished job (Succeeded or Failed), else None."""
    phase = (job.get("status") or {}).get("phase")
    return str(phase) if phase in TERMINAL_PHASES else None
