"""The Node this runner plays: its labels, taints, capacity, status and Lease, as API objects.

Pure functions (but for reading this machine's CPUs, memory, architecture and kernel): the
--labels/--taints flags parsed, the default capacity (simulated `nvidia.com/gpu` included),
the Node manifest registered once, the `status` patched on every heartbeat, and the Lease in
kube-node-lease that keeps the node-lifecycle controller from marking the node NotReady.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
KUBELET_VERSION = "v1.37.1-podrunner"


def micro_time(t: float | None = None) -> str:
    """metav1.MicroTime, as Lease.spec.renewTime wants it."""
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ"
    )


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` → dict (empty text: no labels)."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"label {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def parse_taints(text: str) -> list[dict[str, str]]:
    """`key=value:Effect,key:Effect` → Node taints."""
    taints: list[dict[str, str]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        head, sep, effect = item.rpartition(":")
        if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ValueError(
                f"taint {item!r} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute"
            )
        key, _, value = head.partition("=")
        taint = {"key": key, "effect": effect}
        if value:
            taint["value"] = value
        taints.append(taint)
    return taints


def default_capacity(
    cpu: str | None, memory: str | None, gpus: int, pods: int = 110, storage: str | None = None
) -> dict[str, str]:
    """Node capacity: this machine's CPUs and memory unless given, plus simulated GPUs."""
    if not memory:
        kib = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    kib = int(line.split()[1])
        memory = f"{kib}Ki" if kib else "8Gi"
    capacity = {
        "cpu": str(cpu or os.cpu_count() or 1),
        "memory": memory,
        "pods": str(pods),
        "ephemeral-storage": storage or "100Gi",
    }
    if gpus:
        capacity[GPU_RESOURCE] = str(gpus)
    return capacity


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def node_manifest(
    name: str, labels: Mapping[str, str], taints: Sequence[Mapping[str, str]]
) -> dict[str, Any]:
    all_labels = {
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": _arch(),
        **labels,
        "kubernetes.io/hostname": name,
        "kubetune.io/pod-runner": "true",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"taints": [dict(t) for t in taints]},
    }


def node_status(
    capacity: Mapping[str, str],
    *,
    host_ip: str,
    name: str,
    now: str,
    since: str,
    kubelet_port: int = 0,
) -> dict[str, Any]:
    """`kubelet_port`: where the runner serves container logs (0: nowhere)."""

    def cond(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }

    return {
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "sufficient PID available"),
            cond("Ready", "True", "KubeletReady", "kubetune local pod runner is posting ready"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": "kubetune local pod runner",
            "containerRuntimeVersion": "podrunner://0.1.0",
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": _arch(),
        },
    }


def lease_manifest(name: str, node_uid: str | None, renew: str, duration: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "kube-node-lease"}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}
        ]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": name, "leaseDurationSeconds": duration, "renewTime": renew},
    }
