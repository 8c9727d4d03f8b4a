"""What a look reads before `reconcile` decides: the caches, and the few reads they cannot
answer (the upstream job of an `ftj://` model, the claims and Secrets a launch needs, the
running trainer's and stage-in's metrics).

Nothing here LISTs: the caches are watch-fed (controller/cache.py), and the reads are by name
or of one pod's metrics, the scrapes bounded in number across every loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import TERMINAL_PHASES, Phase
from kubetune.control.build.storage import input_refs
from kubetune.control.lifecycle import is_finished
from kubetune.control.reconcile import (
    ControllerSettings,
    Observed,
    chained,
    may_create_stage_in,
    needs_preflight,
)
from kubetune.controller.cache import JobKey
from kubetune.controller.capacity_view import CapacityView
from kubetune.controller.kube import Kube
from kubetune_trainer.uris import parse_uri


@dataclass(frozen=True)
class Look:
    """What one look read, and from which view of capacity."""

    observed: Observed
    capacity: dict[str, dict[str, Any]]
    """Each pool's capacity before reservations (what admission starts from)."""
    version: tuple[int, int]
    """The view version the look began from (what its plan depends on)."""
    seen: tuple[int, float]
    """The capacity version it began from, and when (monotonic)."""


class Observer:
    """Reads what each look needs (one per operator process, shared by every job's loop)."""

    def __init__(self, settings: ControllerSettings, kube: Kube, view: CapacityView) -> None:
        self.settings = settings
        self.kube = kube
        self.view = view
        self.scrapes = asyncio.Semaphore(settings.scrape_concurrency)
        self.cache_users: dict[JobKey, tuple[str, ...]] = {}
        """Cache entries (status.stageIn paths) each unfinished job reads: the stage-in step
        of another job of the namespace never evicts them."""

    async def observe(self, key: JobKey, job: FineTuneJob, seen_batch_jobs: set[str]) -> Look:
        """The job's world as `reconcile` needs it; `seen_batch_jobs` gains the names of the
        batch Jobs the cache holds of it."""
        caches = self.view.caches
        assert caches is not None
        version = self.view.view_version
        pools, capacity = self.view.live_pools()
        observed = caches.observe(job, pools)
        for seen_job in (
            observed.batch_job,
            observed.stage_in_job,
            observed.export_job,
            observed.stage_out_job,
        ):
            if seen_job is not None:
                seen_batch_jobs.add(str(seen_job["metadata"].get("name")))
        seen = (version[0], time.monotonic())
        self.note_cache_use(key, job)
        if may_create_stage_in(job, observed, self.settings):
            observed = replace(observed, cache_in_use=self.cache_in_use(key))
        observed = await self._upstream(job, observed)
        observed = await self._inputs(job, observed)
        observed = await self._scrape(job, observed)
        return Look(observed, capacity, version, seen)

    async def _upstream(self, job: FineTuneJob, observed: Observed) -> Observed:
        """The FineTuneJob an `ftj://` model comes from, until its result is taken."""
        upstream = job.status.upstream if job.status is not None else None
        chain = parse_uri(job.spec.model.uri).job
        finished = job.status is not None and is_finished(job.status)
        if chain is not None and upstream is None and not finished:
            namespace = str(job.metadata.get("namespace"))
            found = await self.kube.read_finetunejob(namespace, chain)
            if found is not None:
                observed = replace(observed, upstream=found[0], upstream_read=True)
        return observed

    async def _inputs(self, job: FineTuneJob, observed: Observed) -> Observed:
        """Which claims and Secrets a launch needs do not exist (the launch preflight)."""
        upstream = job.status.upstream if job.status is not None else None
        preflight = input_refs(chained(job, upstream)) if needs_preflight(job) else []
        refs = [
            ref
            for ref in preflight
            # A Secret is read only once its namespace consented to it (api/tenancy.py).
            if ref.kind != "Secret"
            or (observed.tenant is not None and observed.tenant.allows_secret(ref.name))
        ]
        if refs:
            namespace = str(job.metadata.get("namespace"))
            missing = await self.kube.missing_inputs(namespace, refs)
            observed = replace(observed, missing_inputs=missing)
        return observed

    async def _scrape(self, job: FineTuneJob, observed: Observed) -> Observed:
        """The running trainer's metrics, and a running stage-in's bytes so far."""
        if job.status and job.status.phase == Phase.RUNNING and observed.pods:
            async with self.scrapes:
                scraped = await self.kube.trainer_metrics(observed.pods)
            observed = replace(observed, trainer_metrics=scraped)
        if observed.stage_in_pods and observed.stage_in_job is not None:
            async with self.scrapes:
                progress = await self.kube.stage_in_progress(observed.stage_in_pods)
            observed = replace(observed, stage_in_metrics=progress)
        return observed

    def note_cache_use(self, key: JobKey, job: FineTuneJob) -> None:
        """Note what this job reads from its cache (nothing once it finished)."""
        staged = job.status.stage_in if job.status is not None else None
        finished = job.status is not None and job.status.phase in TERMINAL_PHASES
        paths = () if staged is None or finished else (staged.model_path, staged.dataset_path)
        used = tuple(path for path in paths if path)
        if used:
            self.cache_users[key] = used
        else:
            self.cache_users.pop(key, None)

    def cache_in_use(self, key: JobKey) -> tuple[str, ...]:
        """What the other unfinished jobs with the same cache (this job's namespace's, or
        the cluster's) read. Linear in the jobs that read a cache, so asked only when a
        stage-in step is about to be created."""
        # One cache for the cluster (`cache_volume`): every namespace's jobs read it.
        shared = self.settings.build.cache_volume is not None
        return tuple(
            sorted(
                {
                    path
                    for other, used in self.cache_users.items()
                    if (shared or other[0] == key[0]) and other != key
                    for path in used
                }
            )
        )
