"""Free GPUs per pool, from what the operator's caches hold about nodes and pods (pure).

The operator watches Nodes and pods (controller/cache.py) and keeps, per node, its
allocatable GPUs and memory and whether it takes pods, and per pod the GPUs it holds on its node.
`pool_capacity` turns those into a GPUPool's status numbers; it runs once per change of
the caches, never per job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubetune.api.units import quantity_value
from kubetune.api.vocabulary import GPU_RESOURCE
from kubetune.control.pods import POD_DONE
from kubetune.control.reach import matches


@dataclass(frozen=True)
class NodeInfo:
    """What capacity needs to know about one Node."""

    name: str
    labels: Mapping[str, str]
    gpus: int
    """Allocatable GPUs."""
    schedulable: bool
    """Ready and not cordoned."""
    not_ready_since: str | None = None
    """When its Ready condition last left True (RFC 3339; "" when not known); None while the
    node is Ready."""
    memory_gib: float = 0.0
    """Allocatable memory (0: not known)."""


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    condition = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    ready = condition is not None and condition.get("status") == "True"
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    allocatable = status.get("allocatable") or {}
    return NodeInfo(
        name=str(meta.get("name", "")),
        labels=dict(meta.get("labels") or {}),
        gpus=int(allocatable.get(GPU_RESOURCE, 0) or 0),
        schedulable=ready and not cordoned,
        not_ready_since=None if ready else str((condition or {}).get("lastTransitionTime") or ""),
        memory_gib=_gib(str(allocatable.get("memory") or "0")),
    )


def _gib(quantity: str) -> float:
    """A memory quantity in GiB; 0 for one that is not a quantity."""
    try:
        return round(float(quantity_value(quantity)) / 2**30, 2)
    except ValueError:
        return 0.0


def gpus_held(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    """(node, GPUs) for a pod that holds GPUs on a node now; None otherwise.

    A pod holds its GPUs from the moment it is bound to a node until it finishes: Pending
    pods bound to a node count, finished ones do not.
    """
    spec = pod.get("spec") or {}
    node = spec.get("nodeName")
    if not node or (pod.get("status") or {}).get("phase") in POD_DONE:
        return None
    gpus = 0
    for container in spec.get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        gpus += int(limits.get(GPU_RESOURCE, 0) or 0)
    return (str(node), gpus) if gpus else None


def pool_capacity(
    selector: Mapping[str, str], nodes: Iterable[NodeInfo], used: Mapping[str, int]
) -> dict[str, Any]:
    """A GPUPool's live numbers: ready nodes matching `selector`, their allocatable GPUs,
    and the GPUs no pod holds (in total and per node, nodes sorted by name), and the
    allocatable memory of the largest node (None when no node reports it)."""
    mine = sorted(
        (n for n in nodes if n.schedulable and matches(selector, n.labels)),
        key=lambda n: n.name,
    )
    free = [max(0, n.gpus - used.get(n.name, 0)) for n in mine]
    memory = max((n.memory_gib for n in mine), default=0.0)
    return {
        "nodes": len(mine),
        "allocatableGPUs": sum(n.gpus for n in mine),
        "freeGPUs": sum(free),
        "freeGPUsPerNode": free,
        "nodeMemoryGiB": memory or None,
    }


def overlaps(
    pool: str, selectors: Mapping[str, Mapping[str, str]], nodes: Iterable[NodeInfo]
) -> dict[str, list[str]]:
    """The other pools (of `selectors`, pool name → nodeSelector) that select some of the
    ready nodes `pool` selects, and which nodes (by name): their GPUs count in both."""
    out: dict[str, list[str]] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        if not node.schedulable or not matches(selectors[pool], node.labels):
            continue
        for other, selector in sorted(selectors.items()):
            if other != pool and matches(selector, node.labels):
                out.setdefault(other, []).append(node.name)
    return out
