"""The operator's reconcile loops and what they share, made once per operator process.

controller/handlers.py holds one `Reconcilers` and talks to it alone: it starts a job's loop
(controller/jobloop.py) and each pool's (controller/poolloop.py), wakes a job or the queued
ones when the watches say something changed (controller/capacity_view.py), and asks it for
liveness. Nothing here decides or writes; it ties the rooms together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kubetune.control.reconcile import ControllerSettings
from kubetune.controller.cache import Caches, JobKey
from kubetune.controller.capacity_view import CapacityView
from kubetune.controller.jobloop import JobLoop, JobState
from kubetune.controller.kube import Kube
from kubetune.controller.poolloop import PoolLoop
from kubetune.controller.status_writes import PostEvent
from kubetune.controller.waiting import Stopped
from kubetune.planning.arch import ModelArch


class Reconcilers:
    """Every job's and pool's loop, and what they share."""

    def __init__(
        self,
        settings: ControllerSettings,
        kube: Kube,
        load_arch: Callable[[str], ModelArch],
        post_event: PostEvent,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.jobs: dict[JobKey, JobState] = {}
        self.view = CapacityView(self.jobs)
        self.job_loop = JobLoop(settings, kube, self.view, self.jobs, load_arch, post_event)
        self.pool_loop = PoolLoop(settings, kube, self.view)
        self.pool_generations: dict[str, Any] = {}
        """Each pool's (event type, generation) as last seen: only a new one wakes anyone."""

    @property
    def caches(self) -> Caches | None:
        return self.view.caches

    @caches.setter
    def caches(self, caches: Caches) -> None:
        self.view.caches = caches

    async def run_job(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        await self.job_loop.run(body, stopped)

    async def run_pool(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        await self.pool_loop.run(body, stopped)

    def wake(self, key: JobKey) -> None:
        self.view.wake(key)

    def capacity_changed(self) -> None:
        self.view.capacity_changed()

    def health(self) -> dict[str, Any]:
        late = self.job_loop.stalled()
        if late:
            raise RuntimeError(
                f"no reconcile succeeded for {self.settings.stall_seconds:.0f}s; "
                f"{len(late)} job(s) overdue, e.g. {', '.join(late[:3])}"
            )
        return {"jobs": len(self.jobs), "queued": len(self.view.queued)}

    async def close(self) -> None:
        """Stop the reconcile workers and close the API client (the loops have ended)."""
        self.job_loop.executor.shutdown(wait=False, cancel_futures=True)
        await self.kube.client.close()
