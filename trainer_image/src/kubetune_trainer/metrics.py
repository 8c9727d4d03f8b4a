"""Training metrics: a Prometheus endpoint on rank 0 and a JSON-lines log of the same values.

Names carry the `kubetune_trainer_` prefix and base units (seconds, bytes, ratios). Each run
uses its own registry, so several runs in one process (tests) do not collide. The endpoint
listens on every interface (what a pod needs); `$KUBETUNE_METRICS_ADDR` narrows it, e.g. to
127.0.0.1 for a run outside a pod.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

log = logging.getLogger(__name__)

PREFIX = "kubetune_trainer_"
ADDR_ENV = "KUBETUNE_METRICS_ADDR"
DEFAULT_ADDR = "0.0.0.0"

GAUGES = {
    "loss": "Training loss of the last optimizer step (mean over trained tokens)",
    "eval_loss": "Validation loss at the last evaluation",
    "learning_rate": "Learning rate of the last optimizer step",
    "step": "Optimizer steps completed",
    "total_steps": "Optimizer steps this run will take",
    "epoch": "Epochs completed (fractional)",
    "tokens_per_second": "Trained tokens per second over all ranks, last logging window",
    "samples_per_second": "Training rows per second over all ranks, last logging window",
    "mfu_ratio": "Model FLOPs utilization (0-1) against the accelerator's dense bf16 peak",
    "memory_allocated_peak_bytes": "Peak accelerator memory held by tensors (CPU: peak RSS)",
    "memory_reserved_peak_bytes": "Peak accelerator memory the allocator reserved (CPU: peak RSS)",
    "checkpoint_save_seconds": "Seconds the last checkpoint took to write",
    "last_checkpoint_step": "Step of the newest complete checkpoint",
    "world_size": "Training processes (GPUs) in this run",
    "dpo_rewards_chosen": "DPO: mean implicit reward beta*(policy - reference log-prob) of the "
    "chosen responses, last optimizer step",
    "dpo_rewards_rejected": "DPO: mean implicit reward of the rejected responses, last step",
    "dpo_reward_margin": "DPO: mean chosen minus rejected reward, last step",
    "dpo_reward_accuracy": "DPO: fraction of pairs whose chosen reward is the larger, last step",
    "eval_dpo_reward_accuracy": "DPO: reward accuracy on the validation pairs, last evaluation",
    "eval_dpo_reward_margin": "DPO: mean reward margin on the validation pairs, last evaluation",
    "early_stopping_best_step": "Early stopping: step of the best evaluation so far (-1: none)",
    "early_stopping_best_value": "Early stopping: the watched metric's best value so far",
    "early_stopping_evaluations_without_improvement": "Early stopping: evaluations in a row "
    "that did not improve on the best",
    "early_stopped": "1 once the run stopped early because patience ran out, else 0",
}
DPO_GAUGES = tuple(name for name in GAUGES if "dpo_" in name)
"""NaN unless the run's objective is DPO."""


class TrainerMetrics:
    def __init__(
        self,
        *,
        enabled: bool,
        port: int | None,
        log_path: str | None,
        labels: dict[str, str],
        addr: str = DEFAULT_ADDR,
    ) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(PREFIX + name, doc, registry=self.registry) for name, doc in GAUGES.items()
        }
        self.tokens_seen = Counter(
            PREFIX + "tokens_seen",
            "Trained tokens over all ranks since the start",
            registry=self.registry,
        )
        self.info = Info(PREFIX + "run", "What this trainer runs", registry=self.registry)
        self.info.info(labels)
        self.gauges["mfu_ratio"].set(math.nan)
        self.gauges["eval_loss"].set(math.nan)
        for name in DPO_GAUGES:
            self.gauges[name].set(math.nan)
        self.gauges["last_checkpoint_step"].set(-1)
        self.gauges["early_stopping_best_step"].set(-1)
        self.gauges["early_stopping_best_value"].set(math.nan)
        self.values: dict[str, float] = {}
        self.port: int | None = None
        self._server: Any = None
        self._log_file = None
        if not enabled:
            return
        if port is not None:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            self._server = server
            self.port = int(server.server_port)
            log.info("metrics on %s:%d/metrics", addr, self.port)
        if log_path:
            path = Path(log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = path.open("a", buffering=1)

    def set(self, **values: float) -> None:
        for name, value in values.items():
            self.values[name] = float(value)
            if name in self.gauges:
                self.gauges[name].set(value)

    def add_tokens(self, n: float) -> None:
        self.tokens_seen.inc(n)
        self.values["tokens_seen_total"] = self.values.get("tokens_seen_total", 0.0) + n

    def event(self, kind: str, **fields: Any) -> None:
        """Append one JSON line: the event, its own fields, then the current gauge values."""
        if not self.enabled or self._log_file is None:
            return
        record = {"time": time.time(), "event": kind, **self.values, **fields}
        clean = {
            k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()
        }
        self._log_file.write(json.dumps(clean, sort_keys=False) + "\n")

    def close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
