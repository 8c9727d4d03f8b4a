"""Every child of one training attempt, in the order they are applied.

A FineTuneJob owns five children:

1. the checkpoint PersistentVolumeClaim (one per FineTuneJob, it outlives attempts),
2. a ConfigMap with the trainer's `config.json` (one per attempt: a re-plan changes it),
3. a headless Service that gives the trainer pods stable DNS names for rendezvous
   (one per FineTuneJob),
4. a NetworkPolicy that admits to the trainer pods only their own job's pods, and on the
   metrics port the operator and the metrics scrapers (one per FineTuneJob; left out when
   the `network_policy` setting is off),
5. an Indexed `batch/v1` Job with one pod per node that runs `torchrun` (one per attempt).
"""

from __future__ import annotations

from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, PlanStatus
from kubetune.control.build.config import build_config_map
from kubetune.control.build.network import build_headless_service, build_network_policy
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import build_checkpoint_pvc
from kubetune.control.build.trainer import build_indexed_job


def build_children(
    job: FineTuneJob,
    plan: PlanStatus,
    pool: GPUPool,
    settings: BuildSettings,
    attempt: int,
) -> list[dict[str, Any]]:
    """Every child in apply order: volume, config, DNS, network policy, then the pods that
    need them (the policy exists before any trainer pod does)."""
    children = [
        build_checkpoint_pvc(job, plan, settings),
        build_config_map(job, plan, settings, attempt),
        build_headless_service(job, settings),
    ]
    if settings.network_policy:
        children.append(build_network_policy(job, settings))
    children.append(build_indexed_job(job, plan, pool, settings, attempt))
    return children
