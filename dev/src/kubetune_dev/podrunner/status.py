"""What the runner reports for a pod: container states, phase, conditions, exit reasons.

Pure functions from what the runner knows of each container (`ContainerRun`) to the `status`
a kubelet would patch: waiting/running/terminated states, the restartPolicy-Never phase, the
conditions with their transition times kept, exit codes and reasons (Completed, Error,
OOMKilled from the kernel's OOM-kill counter), termination messages, grace periods, and
`rfc3339`, the metav1.Time format of their timestamps.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

DEFAULT_GRACE_SECONDS = 30
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048

TERMINAL_PHASES = ("Succeeded", "Failed")


def rfc3339(t: float | None = None) -> str:
    """metav1.Time: seconds precision, UTC."""
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


@dataclass
class ContainerRun:
    """What the runner knows of one container, enough to build its status."""

    name: str
    image: str = ""
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    container_id: str = ""

    @property
    def succeeded(self) -> bool:
        return self.state == "terminated" and self.exit_code == 0


def exit_status(returncode: int, *, oom: bool = False) -> tuple[int, str, int | None]:
    """(exitCode, reason, signal) of a finished process, as the container runtime reports it.

    A process killed by signal N exits with 128+N. OOMKilled only when the kernel's OOM
    killer is known to have killed it (`oom`), never merely because of SIGKILL.
    """
    sig = -returncode if returncode < 0 else None
    code = 128 + sig if sig is not None else returncode
    if code == 0:
        reason = "Completed"
    elif oom and sig == signal.SIGKILL:
        reason = "OOMKilled"
    else:
        reason = "Error"
    return code, reason, sig


def parse_oom_kills(vmstat: str) -> int | None:
    """The kernel's count of OOM kills from /proc/vmstat (None if the kernel has none)."""
    for line in vmstat.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill":
            return int(value)
    return None


def container_status(run: ContainerRun, *, init: bool = False) -> dict[str, Any]:
    state: dict[str, Any]
    if run.state == "running":
        state = {"running": {"startedAt": run.started_at}}
    elif run.state == "terminated":
        term: dict[str, Any] = {
            "exitCode": run.exit_code if run.exit_code is not None else 0,
            "reason": run.reason,
            "startedAt": run.started_at,
            "finishedAt": run.finished_at,
        }
        if run.message:
            term["message"] = run.message
        if run.signal:
            term["signal"] = run.signal
        if run.container_id:
            term["containerID"] = run.container_id
        state = {"terminated": term}
    else:
        waiting: dict[str, Any] = {"reason": run.reason}
        if run.message:
            waiting["message"] = run.message
        state = {"waiting": waiting}
    status: dict[str, Any] = {
        "name": run.name,
        "image": run.image,
        "imageID": "",
        "ready": run.succeeded if init else run.state == "running",
        "restartCount": 0,
        "started": run.state == "running",
        "state": state,
    }
    if run.container_id:
        status["containerID"] = run.container_id
    return status


def pod_phase(init: Sequence[ContainerRun], main: Sequence[ContainerRun]) -> str:
    """restartPolicy Never: a failed init container fails the pod; all containers done →
    Succeeded if every one exited 0, else Failed; any running → Running; else Pending."""
    if any(c.state == "terminated" and not c.succeeded for c in init):
        return "Failed"
    if main and all(c.state == "terminated" for c in main):
        return "Succeeded" if all(c.succeeded for c in main) else "Failed"
    if any(c.state in ("running", "terminated") for c in main):
        return "Running"
    return "Pending"


def merge_conditions(
    previous: Sequence[Mapping[str, Any]], desired: Mapping[str, tuple[str, str]], now: str
) -> list[dict[str, Any]]:
    """Conditions (type → (status, reason)) keeping lastTransitionTime while status holds."""
    before = {str(c.get("type")): c for c in previous}
    out: list[dict[str, Any]] = []
    for kind, (status, reason) in desired.items():
        old = before.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        cond: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": since or now,
        }
        if reason:
            cond["reason"] = reason
        out.append(cond)
    return out


def pod_status(
    pod: Mapping[str, Any],
    init: Sequence[ContainerRun],
    main: Sequence[ContainerRun],
    *,
    pod_ip: str,
    host_ip: str,
    start_time: str,
    now: str,
) -> dict[str, Any]:
    """The `status` a kubelet would report for this pod."""
    phase = pod_phase(init, main)
    terminal = phase in TERMINAL_PHASES
    initialized = all(c.succeeded for c in init)
    ready = bool(main) and all(c.state == "running" for c in main)
    if terminal:
        ready_reason = "PodCompleted"
    elif not initialized:
        ready_reason = "ContainersNotInitialized"
    else:
        ready_reason = "" if ready else "ContainersNotReady"
    if initialized:
        init_reason = "PodCompleted" if terminal and init else ""
    else:
        init_reason = "ContainersNotInitialized"
    desired = {
        "PodReadyToStartContainers": ("False" if terminal else "True", ""),
        "Initialized": ("True" if initialized else "False", init_reason),
        "Ready": ("True" if ready else "False", ready_reason),
        "ContainersReady": ("True" if ready else "False", ready_reason),
        "PodScheduled": ("True", ""),
    }
    previous = (pod.get("status") or {}).get("conditions") or []
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": merge_conditions(previous, desired, now),
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "containerStatuses": [container_status(c) for c in main],
    }
    if init:
        status["initContainerStatuses"] = [container_status(c, init=True) for c in init]
    return status


def termination_grace(pod: Mapping[str, Any]) -> int:
    """Seconds between SIGTERM and SIGKILL: the deletion's grace period, else the pod's."""
    grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
    if grace is None:
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return max(0, int(grace if grace is not None else DEFAULT_GRACE_SECONDS))


def termination_message(written: bytes, log_tail: bytes, *, policy: str, exit_code: int) -> str:
    """The container's termination message: what it wrote to terminationMessagePath, or with
    FallbackToLogsOnError and a failure, the end of its log."""
    text = written[:MAX_TERMINATION_MESSAGE].decode("utf-8", errors="replace")
    if not text.strip() and policy == "FallbackToLogsOnError" and exit_code != 0:
        lines = log_tail.splitlines()[-FALLBACK_LOG_LINES:]
        text = b"\n".join(lines)[-FALLBACK_LOG_BYTES:].decode("utf-8", errors="replace")
    return text
