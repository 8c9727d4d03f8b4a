"""Whose checkpoints: the job that wrote them and what shaped its run.

The checkpoint volume is named after the job and outlives it, so a new job created under the
same name mounts the old job's checkpoints. Every checkpoint therefore records `identity(cfg)`
in its trainer_state.json, and at start-up `whose` says what the newest one is to this run.

The fingerprint covers what shapes the trained weights (model, data, method, LoRA, the
objective and its DPO settings, the optimisation that is asked for), never what an
out-of-memory re-plan changes between attempts of one job (micro-batch, accumulation,
precision, optimizer, memory savers, parallelism): those attempts must go on resuming their
own checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from kubetune_trainer.contract import TrainerConfig

IDENTITY_KEY = "identity"
"""trainer_state.json's key for `identity(cfg)`; absent in checkpoints of older trainers."""
RESUME_FIELD = "spec.checkpoint.resumeFromUID"
"""The job's field the operator maps to `checkpoint.resume_from_uid`."""

LORA_FIELDS = ("rank", "alpha", "dropout", "target_modules")
TRAINING_FIELDS = (
    "learning_rate",
    "warmup_ratio",
    "weight_decay",
    "epochs",
    "max_steps",
    "global_batch_size",
    "sequence_length",
    "packing",
    "seed",
    "objective",
)
DPO_FIELDS = ("beta", "label_smoothing")

Owner = Literal["own", "adopted", "unknown", "foreign"]
"""`own`: this job's. `adopted`: the job `checkpoint.resume_from_uid` names. `unknown`: no
identity recorded (an older trainer's). `foreign`: another job's."""


def fingerprint_fields(cfg: TrainerConfig) -> dict[str, Any]:
    """The fields that shape a run, by dotted name (as JSON would give them back)."""
    lora = cfg.lora if cfg.method != "full" else None
    fields: dict[str, Any] = {
        "model.source": cfg.model.source,
        "model.revision": cfg.model.revision,
        "dataset.source": cfg.dataset.source,
        "dataset.format": cfg.dataset.format,
        "dataset.validation_split": cfg.dataset.validation_split,
        "method": cfg.method,
    }
    fields.update({f"lora.{n}": getattr(lora, n) if lora else None for n in LORA_FIELDS})
    fields.update({f"training.{n}": getattr(cfg.training, n) for n in TRAINING_FIELDS})
    fields.update({f"training.dpo.{n}": getattr(cfg.training.dpo, n) for n in DPO_FIELDS})
    return dict(json.loads(json.dumps(fields)))


def fingerprint(fields: dict[str, Any]) -> str:
    """sha256 (hex) of the fields' canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def identity(cfg: TrainerConfig) -> dict[str, Any]:
    """What a checkpoint of this run records under `IDENTITY_KEY`."""
    fields = fingerprint_fields(cfg)
    return {
        "job_uid": cfg.job.uid,
        "job_name": cfg.job.name,
        "job_namespace": cfg.job.namespace,
        "fingerprint": fingerprint(fields),
        "fields": fields,
    }


def whose(saved: dict[str, Any] | None, cfg: TrainerConfig) -> Owner:
    """Whose a checkpoint with identity `saved` (None: none recorded) is to this run. A run
    without a uid (local, tests) takes any checkpoint for its own."""
    uid = str((saved or {}).get("job_uid") or "")
    if not uid:
        return "unknown"
    if not cfg.job.uid or uid == cfg.job.uid:
        return "own"
    return "adopted" if uid == cfg.checkpoint.resume_from_uid else "foreign"


def changed_fields(saved: dict[str, Any], cfg: TrainerConfig) -> dict[str, dict[str, Any]]:
    """Fingerprint fields that differ between identity `saved` and this run: name → old, new."""
    old, new = dict(saved.get("fields") or {}), fingerprint_fields(cfg)
    return {
        name: {"old": old.get(name), "new": new.get(name)}
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    }


def describe(changed: dict[str, dict[str, Any]]) -> str:
    """`a.b old → new, …` for a log line."""
    if not changed:
        return "no field of the fingerprint changed"
    return ", ".join(f"{n} {v['old']!r} → {v['new']!r}" for n, v in changed.items())
