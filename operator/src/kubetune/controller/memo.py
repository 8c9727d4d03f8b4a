"""What the job loops keep in memory instead of computing again: architectures by model id,
and each job's last plan.

Both are asked from reconcile's worker threads, hence the locks. Neither is read by anything
but a look; a restarted operator starts them empty.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
from kubetune.planning.arch import ModelArch
from kubetune.planning.planner import Plan, PlannerSettings, plan_job

ARCH_FAILURE_SECONDS = 300.0
"""An architecture that could not be loaded (e.g. a hub fetch that failed) is not tried
again for this long."""


class ArchCache:
    """Architectures by model id: found ones for good, failures for a while (thread-safe)."""

    def __init__(self, load: Callable[[str], ModelArch], failure_seconds: float) -> None:
        self._load = load
        self._failure_seconds = failure_seconds
        self._lock = threading.Lock()
        self._found: dict[str, ModelArch] = {}
        self._failed: dict[str, tuple[float, Exception]] = {}

    def __call__(self, model_id: str) -> ModelArch:
        with self._lock:
            if model_id in self._found:
                return self._found[model_id]
            failure = self._failed.get(model_id)
            if failure and time.monotonic() - failure[0] < self._failure_seconds:
                raise failure[1]
        try:
            arch = self._load(model_id)
        except Exception as exc:
            with self._lock:
                self._failed[model_id] = (time.monotonic(), exc)
            raise
        with self._lock:
            self._found[model_id] = arch
            self._failed.pop(model_id, None)
        return arch


class PlanMemo:
    """The last plan (or planning error) of each job, reused while nothing it depends on
    changed: the job's spec generation, the pools and their capacity, the planner
    settings (which carry what out-of-memory re-plans learned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[Any, Plan | Exception]] = {}

    def planner(self, uid: str, generation: Any, view_version: Any) -> Callable[..., Plan]:
        def plan(
            spec: FineTuneJobSpec,
            pools: Sequence[GPUPool],
            arch: ModelArch,
            settings: PlannerSettings,
        ) -> Plan:
            key = (generation, view_version, tuple(p.name for p in pools), arch, settings)
            with self._lock:
                last = self._last.get(uid)
            if last is not None and last[0] == key:
                if isinstance(last[1], Exception):
                    raise last[1]
                return last[1]
            try:
                result: Plan | Exception = plan_job(spec, pools, arch, settings)
            except Exception as exc:
                result = exc
            with self._lock:
                self._last[uid] = (key, result)
            if isinstance(result, Exception):
                raise result
            return result

        return plan

    def forget(self, uid: str) -> None:
        with self._lock:
            self._last.pop(uid, None)
