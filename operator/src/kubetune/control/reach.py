"""Where a checkpoint volume can be mounted (pure).

A bound PersistentVolume of a zonal disk (EBS, Persistent Disk, Azure Disk, most CSI block
volumes) carries `spec.nodeAffinity.required`: the nodes that can attach it, usually one zone
(`topology.kubernetes.io/zone In [us-east-1a]`). A re-plan onto a pool without such a node
would leave the new pods Pending forever. `volume_reach` reads that affinity against the
pools' nodes: only pools with at least one node that can mount the volume stay eligible
(`PlannerSettings.volume_pools`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubetune.api.v1alpha1 import GPUPool


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` is selected by a pool's `nodeSelector`."""
    return all(labels.get(key) == value for key, value in selector.items())


@dataclass(frozen=True)
class Requirement:
    """One `matchExpressions` entry of a node selector term."""

    key: str
    operator: str
    values: tuple[str, ...] = ()

    def holds(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator == "In":
            return value in self.values
        if self.operator == "NotIn":
            return value not in self.values
        if self.operator == "Exists":
            return value is not None
        if self.operator == "DoesNotExist":
            return value is None
        if self.operator in ("Gt", "Lt") and value is not None and self.values:
            try:
                have, want = int(value), int(self.values[0])
            except ValueError:
                return False
            return have > want if self.operator == "Gt" else have < want
        return False

    def describe(self) -> str:
        if self.operator in ("In", "NotIn"):
            return f"{self.key} {self.operator.lower()} ({', '.join(self.values)})"
        if self.operator in ("Gt", "Lt"):
            return f"{self.key} {'>' if self.operator == 'Gt' else '<'} {self.values[0]}"
        return f"{self.key} {'exists' if self.operator == 'Exists' else 'absent'}"


Term = tuple[Requirement, ...]


def volume_terms(volume: Mapping[str, Any]) -> tuple[Term, ...] | None:
    """The node selector terms of a PersistentVolume's required node affinity (any one term
    must hold); None when it has none (it mounts on any node)."""
    required = (((volume.get("spec") or {}).get("nodeAffinity") or {}).get("required")) or {}
    terms: list[Term] = []
    for term in required.get("nodeSelectorTerms") or []:
        reqs = tuple(
            Requirement(
                str(r.get("key", "")),
                str(r.get("operator", "")),
                tuple(str(v) for v in r.get("values") or ()),
            )
            for r in (term or {}).get("matchExpressions") or ()
        )
        if reqs:
            terms.append(reqs)
    return tuple(terms) or None


def reaches(terms: Sequence[Term], labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` can mount the volume."""
    return any(all(r.holds(labels) for r in term) for term in terms)


def describe(terms: Sequence[Term]) -> str:
    return " or ".join(" and ".join(r.describe() for r in term) for term in terms)


@dataclass(frozen=True)
class VolumeReach:
    """The pools whose nodes can mount a job's bound checkpoint volume."""

    volume: str
    """The PersistentVolume's name."""
    where: str
    """Its node affinity, in words: `topology.kubernetes.io/zone in (us-east-1a)`."""
    pools: frozenset[str]


def volume_reach(
    name: str,
    terms: Sequence[Term],
    pools: Sequence[GPUPool],
    node_labels: Iterable[Mapping[str, str]],
) -> VolumeReach:
    """Which of `pools` have a node (Ready or not: capacity is judged elsewhere) that can
    mount the volume `name` with node affinity `terms`; `node_labels`: every node's labels."""
    mountable = [labels for labels in node_labels if reaches(terms, labels)]
    reached = frozenset(
        pool.name
        for pool in pools
        if any(matches(pool.spec.node_selector, labels) for labels in mountable)
    )
    return VolumeReach(name, describe(terms), reached)
