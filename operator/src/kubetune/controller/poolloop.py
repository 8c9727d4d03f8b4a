"""The loop of each GPUPool (a kopf daemon, controller/handlers.py): it writes the pool's live
capacity whenever it changed, and marks a pool the operator cannot read (condition
Valid=False) without letting it affect any job."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubetune.api.vocabulary import PoolConditionType, Reason
from kubetune.control.conditions import now_rfc3339
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller import metrics
from kubetune.controller.backoff import RANDOM
from kubetune.controller.cache import parse_pool
from kubetune.controller.capacity_view import CapacityView
from kubetune.controller.kube import Fenced, Kube, StatusRejected
from kubetune.controller.waiting import Stopped, backoff, wait

log = logging.getLogger("kubetune")


class PoolLoop:
    """Every GPUPool's loop (one per operator process)."""

    def __init__(self, settings: ControllerSettings, kube: Kube, view: CapacityView) -> None:
        self.settings = settings
        self.kube = kube
        self.view = view
        self.rng = RANDOM
        """Draws the waits after failures."""

    async def run(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        """The loop of one GPUPool: write its capacity whenever it changed."""
        name = str(body["metadata"]["name"])
        wake = self.view.pool_wakers[name] = asyncio.Event()
        failures = 0
        try:
            while not stopped:
                wake.clear()
                try:
                    with metrics.reconcile_timer("gpupool"):
                        await self.reconcile_pool(body)
                    failures = 0
                    delay = self.settings.resync_seconds
                except Fenced:
                    delay = self.settings.resync_seconds
                except Exception:
                    failures += 1
                    delay = backoff(failures, self.rng)
                    log.exception(
                        "GPUPool %s: capacity not written; next try in %.0fs", name, delay
                    )
                await wait(wake, stopped, delay)
                # Capacity changes come in bursts (a job's pods bind one by one): write at
                # most about once a second.
                await asyncio.sleep(1.0)
        finally:
            if self.view.pool_wakers.get(name) is wake:
                del self.view.pool_wakers[name]

    async def reconcile_pool(self, body: Mapping[str, Any]) -> None:
        caches = self.view.caches
        assert caches is not None
        meta = body["metadata"]
        name = str(meta["name"])
        old = dict(body.get("status") or {})
        parsed = parse_pool(body)
        if isinstance(parsed, str):
            message = (
                f"the operator cannot read this GPUPool ({parsed}); no job is planned onto it. "
                "To fix: correct the field and apply the pool again"
            )
            condition = _pool_condition(old, False, Reason.INVALID_SPEC, message)
            if condition is not None:
                log.error("GPUPool %s is invalid: %s", name, parsed)
                await self._write_pool(name, {"conditions": [condition]})
            return
        # Computed once per change of nodes, pods or reservations, for every pool at once.
        _, live = self.view.live_pools()
        capacity = dict(live.get(name) or caches.capacities([parsed])[name])
        capacity["observedGeneration"] = meta.get("generation")
        capacity["gpuMemoryGiB"] = parsed.spec.gpu.memory_gib  # the product's when not given
        patch = {k: v for k, v in capacity.items() if old.get(k) != v}
        condition = _pool_condition(old, True, Reason.POOL_ACCEPTED, "the operator reads this pool")
        if condition is not None:
            patch["conditions"] = [condition]
        if patch or not old.get("updatedAt"):
            patch["updatedAt"] = now_rfc3339()
            await self._write_pool(name, patch)
        metrics.observe_pool(body, capacity)

    async def _write_pool(self, name: str, patch: Mapping[str, Any]) -> None:
        try:
            await self.kube.patch_status(None, name, patch, pool=True)
        except StatusRejected as exc:
            metrics.status_write("rejected")
            log.error("status of GPUPool %s rejected (%s): %s", name, exc.fields, exc)
            return
        except Exception:
            metrics.status_write("failed")
            raise
        metrics.status_write("ok")


def _pool_condition(
    old: Mapping[str, Any], valid: bool, reason: Reason, message: str
) -> dict[str, Any] | None:
    """The pool's Valid condition, or None when it already says so."""
    wanted = "True" if valid else "False"
    for cond in old.get("conditions") or []:
        same = cond.get("status") == wanted and cond.get("reason") == reason
        if cond.get("type") == PoolConditionType.VALID and same:
            return None
    return {
        "type": str(PoolConditionType.VALID),
        "status": wanted,
        "reason": str(reason),
        "message": message,
        "lastTransitionTime": now_rfc3339(),
    }
