"""The loop of each GPUPool (a kopf daemon, controller/handlers.py): it writes the pool's live
capacity whenever it changed, marks a pool the operator cannot read (condition Valid=False)
without letting it affect any job, and says when another pool selects some of its nodes
(condition Overlapping=True: their GPUs count in both)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubetune.api.vocabulary import PoolConditionType, Reason
from kubetune.control.capacity import overlaps
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
            conditions = _pool_conditions(
                old, [(PoolConditionType.VALID, False, Reason.INVALID_SPEC, message)]
            )
            if conditions is not None:
                log.error("GPUPool %s is invalid: %s", name, parsed)
                await self._write_pool(name, {"conditions": conditions})
            return
        # Computed once per change of nodes, pods or reservations, for every pool at once.
        pools, live = self.view.live_pools()
        capacity = dict(live.get(name) or caches.capacities([parsed])[name])
        capacity["observedGeneration"] = meta.get("generation")
        capacity["gpuMemoryGiB"] = parsed.spec.gpu.memory_gib  # the product's when not given
        patch = {k: v for k, v in capacity.items() if old.get(k) != v}
        selectors = {pool.name: dict(pool.spec.node_selector) for pool in pools}
        selectors[name] = dict(parsed.spec.node_selector)
        shared = overlaps(name, selectors, caches.node_infos())
        accepted = "the operator reads this pool"
        wanted: list[Wanted] = [(PoolConditionType.VALID, True, Reason.POOL_ACCEPTED, accepted)]
        if shared or _has(old, PoolConditionType.OVERLAPPING):
            wanted.append(_overlap_condition(shared))
        conditions = _pool_conditions(old, wanted)
        if conditions is not None:
            patch["conditions"] = conditions
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


Wanted = tuple[PoolConditionType, bool, Reason, str]
"""A pool condition: its type, status, reason and message."""


def _overlap_condition(shared: Mapping[str, list[str]]) -> Wanted:
    """Overlapping, from the other pools that select some of this pool's ready nodes."""
    if not shared:
        return (PoolConditionType.OVERLAPPING, False, Reason.POOLS_DISJOINT,
                "no other pool selects this pool's nodes")  # fmt: skip
    named = "; ".join(
        f"pool {other} selects {', '.join(nodes[:5])}{' …' if len(nodes) > 5 else ''}"
        for other, nodes in sorted(shared.items())
    )
    return (
        PoolConditionType.OVERLAPPING,
        True,
        Reason.POOLS_OVERLAP,
        f"{named} as well: their GPUs count in each pool, so plans on them may count them "
        "twice. To fix: make the pools' nodeSelectors disjoint (a label that tells the "
        "nodes apart), or merge the pools",
    )


def _has(old: Mapping[str, Any], kind: PoolConditionType) -> bool:
    return any(c.get("type") == kind for c in old.get("conditions") or [])


def _pool_conditions(old: Mapping[str, Any], wanted: list[Wanted]) -> list[dict[str, Any]] | None:
    """The pool's conditions as `wanted`, or None when they already say so. A condition
    whose status does not change keeps its lastTransitionTime."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    out = []
    for kind, ok, reason, message in wanted:
        status = "True" if ok else "False"
        prior = before.get(str(kind)) or {}
        same = prior.get("status") == status
        if same and prior.get("reason") == reason and prior.get("message") == message:
            out.append(dict(prior))
            continue
        since = prior.get("lastTransitionTime") if same else None
        out.append(
            {
                "type": str(kind),
                "status": status,
                "reason": str(reason),
                "message": message,
                "lastTransitionTime": since or now_rfc3339(),
            }
        )
    return None if out == list(old.get("conditions") or []) else out
