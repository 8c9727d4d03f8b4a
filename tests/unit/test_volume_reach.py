"""A zonal checkpoint volume keeps a job's re-plans to pools that can mount it: the bound
PersistentVolume's node affinity against the pools' nodes (control/reach.py), observed from
the watch caches (controller/cache.py) and obeyed by the planner."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import Phase
from kubetune.control.capacity import NodeInfo
from kubetune.control.reach import VolumeReach, reaches, volume_reach, volume_terms
from kubetune.control.reconcile import Observed
from kubetune.controller.cache import Caches
from kubetune.planning.catalog import default_pools
from support.reconcile import SETTINGS, T0, Store, batch_job, make_job, run, unschedulable

pytestmark = pytest.mark.unit

ZONE = "topology.kubernetes.io/zone"


def zonal_volume(name: str, *zones: str) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": ZONE, "operator": "In", "values": list(zones)}]}
    return {
        "metadata": {"name": name},
        "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [term]}}},
    }


def node(name: str, pool_index: int, zone: str) -> NodeInfo:
    labels = {**default_pools()[pool_index].spec.node_selector, ZONE: zone}
    return NodeInfo(name=name, labels=labels, gpus=8, schedulable=True)


def test_a_volumes_node_affinity_is_read_and_matched_against_the_pools_nodes() -> None:
    assert volume_terms({"spec": {}}) is None  # mounts anywhere (NFS, a ReadWriteMany share)
    terms = volume_terms(zonal_volume("pv-1", "us-east-1a"))
    assert terms is not None
    assert reaches(terms, {ZONE: "us-east-1a"}) and not reaches(terms, {ZONE: "us-east-1b"})
    pools = default_pools()[:2]
    nodes = [
        node("a-0", 0, "us-east-1b"),
        node("a-1", 0, "us-east-1a"),
        node("b-0", 1, "us-east-1b"),
    ]
    reach = volume_reach("pv-1", terms, pools, (n.labels for n in nodes))
    assert reach.pools == {pools[0].name}
    assert reach.where == f"{ZONE} in (us-east-1a)"


def test_the_cache_observes_where_a_bound_checkpoint_volume_can_be_mounted() -> None:
    job = make_job().model_copy(update={"status": FineTuneJobStatus(phase=Phase.RUNNING)})
    claim = {"metadata": {"name": "demo-ckpt"}, "spec": {"volumeName": "pv-1"}}
    pools = default_pools()[:2]
    caches = Caches(
        Store(),
        Store(),
        Store({"a-0": [node("a-0", 0, "us-east-1a")], "b-0": [node("b-0", 1, "us-east-1b")]}),
        Store(),
        Store(),
        claims=Store({("team-a", "demo-ckpt"): [claim]}),
        volumes=Store({"pv-1": [volume_terms(zonal_volume("pv-1", "us-east-1a"))]}),
    )
    seen = caches.observe(job, pools)
    assert seen.checkpoint_reach == VolumeReach(
        "pv-1", f"{ZONE} in (us-east-1a)", frozenset({pools[0].name})
    )
    unbound = Caches(Store(), Store(), Store(), Store(), Store(), claims=Store(), volumes=Store())
    assert unbound.observe(job, pools).checkpoint_reach is None


def test_a_job_never_moves_to_a_pool_its_zonal_volume_cannot_reach() -> None:
    """Its pod found no room; the other pool has GPUs but sits in another zone: the new pods
    would wait for the volume forever, so the job stays and waits where its checkpoints are."""
    job, _ = run(make_job())
    first = job.status.plan  # type: ignore[union-attr]
    assert first is not None
    reach = VolumeReach("pv-1", f"{ZONE} in (us-east-1a)", frozenset({first.pool}))
    stuck = Observed(
        pools=default_pools(),
        batch_job=batch_job(active=1),
        pods=[unschedulable("demo-a1-0-bbbbb", T0)],
        checkpoint_reach=reach,
    )
    job, d = run(job, stuck, now=T0 + timedelta(seconds=SETTINGS.reschedule_seconds + 1))
    s = job.status
    assert s is not None and s.plan is not None
    assert s.attempt == 1 and s.plan.pool == first.pool and d.delete_jobs == []
    # Where the volume reaches every pool, the same look moves it (test_recovery's case).
    anywhere = Observed(
        pools=default_pools(),
        batch_job=batch_job(active=1),
        pods=[unschedulable("demo-a1-0-bbbbb", T0)],
    )
    job2, _ = run(make_job())
    job2, _ = run(job2, anywhere, now=T0 + timedelta(seconds=SETTINGS.reschedule_seconds + 1))
    assert job2.status is not None and job2.status.plan is not None
    assert job2.status.plan.pool != first.pool
