"""Whether an object found under the name of a child this job creates is the job's own.

A create that finds the name taken has three answers:

- `Claim.OURS`: this job made it (its owner is this job), or it is a checkpoint volume that
  kubetune made for an earlier job of this name and retained, which a job created again under
  that name takes over (the trainer moves checkpoints of another job aside, `foreign/`), or
  it is the namespace's cache claim, which every job shares and none owns;
- `Claim.WAIT`: an earlier job of this name owns it and no longer exists, so the garbage
  collector is about to remove it: create it again later, launch nothing meanwhile;
- `Claim.CONFLICT`: someone else's; using it would run the trainer on what it does not own (a
  volume whose `step-N` folders it would prune, a Service it would redirect). The job fails
  with `ChildConflict` and a message that ends with "To fix:".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubetune.api.vocabulary import ANNOTATION_JOB_UID, LABEL_JOB

JOB_KIND = "FineTuneJob"


class Claim(enum.Enum):
    OURS = "ours"
    WAIT = "wait"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Owner:
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class Existing:
    """What decides whose a live object is: its owners, labels and annotations."""

    owners: Sequence[Owner] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    message: str = ""
    """Why, for `WAIT` (a log line) and `CONFLICT` (the job's failure message)."""


def judge(manifest: Mapping[str, Any], existing: Existing, job_name: str, job_uid: str) -> Verdict:
    """Whose `existing` is, the live object under the name `manifest` (a child of the
    FineTuneJob `job_name`, uid `job_uid`) asked for."""
    meta = manifest.get("metadata") or {}
    kind, name = str(manifest.get("kind")), str(meta.get("name"))
    namespace = meta.get("namespace")
    checkpoint_volume = ANNOTATION_JOB_UID in (meta.get("annotations") or {})
    if kind == "PersistentVolumeClaim" and not checkpoint_volume:
        return Verdict(Claim.OURS)  # the namespace's cache claim, which no job owns
    if any(o.uid == job_uid for o in existing.owners):
        return Verdict(Claim.OURS)
    earlier = [o for o in existing.owners if o.kind == JOB_KIND and o.name == job_name]
    if earlier:
        return Verdict(
            Claim.WAIT,
            f"{kind} {name} belongs to an earlier FineTuneJob {job_name} (uid "
            f"{earlier[0].uid}) that no longer exists; waiting for the garbage collector to "
            "remove it",
        )
    if checkpoint_volume and _retained_for(existing, job_name):
        return Verdict(Claim.OURS)
    if checkpoint_volume:
        return Verdict(
            Claim.CONFLICT,
            f"a {kind} named {name} already exists in namespace {namespace} and kubetune did "
            f"not make it for a FineTuneJob named {job_name} (it lacks the {ANNOTATION_JOB_UID} "
            f"annotation and the {LABEL_JOB}={job_name} label): the trainer would take its "
            "step-N folders for checkpoints and delete them as it prunes. To fix: create this "
            "job under another name, or rename or delete that claim; to train on files it "
            "holds, name them in spec.model.uri or spec.dataset.uri as pvc://",
        )
    return Verdict(
        Claim.CONFLICT,
        f"a {kind} named {name} already exists in namespace {namespace} and does not "
        f"belong to this FineTuneJob. To fix: delete or rename that {kind}, or create this "
        "job under another name",
    )


def _retained_for(existing: Existing, job_name: str) -> bool:
    """A checkpoint volume kubetune made for a job of this name and left without an owner
    (retention `retain`)."""
    return (
        not existing.owners
        and bool(existing.annotations.get(ANNOTATION_JOB_UID))
        and existing.labels.get(LABEL_JOB) == job_name
    )
