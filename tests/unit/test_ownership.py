"""Whose an object is that already holds the name of a job's child (control/ownership.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kubetune.api.vocabulary import ANNOTATION_JOB_UID, LABEL_JOB
from kubetune.control.ownership import Claim, Existing, Owner, judge

pytestmark = pytest.mark.unit

NAME, UID = "sft", "uid-2"


def manifest(kind: str, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"kind": kind, "metadata": meta}


CKPT = manifest("PersistentVolumeClaim", f"{NAME}-ckpt", {ANNOTATION_JOB_UID: UID})
CONFIG = manifest("ConfigMap", f"{NAME}-a1")
CACHE = manifest("PersistentVolumeClaim", "kubetune-cache")
MINE = Owner("FineTuneJob", NAME, UID)
EARLIER = Owner("FineTuneJob", NAME, "uid-1")


@pytest.mark.parametrize("child", [CKPT, CONFIG])
def test_a_child_this_job_owns_is_its_own(child: dict[str, Any]) -> None:
    assert judge(child, Existing(owners=(MINE,)), NAME, UID).claim is Claim.OURS


@pytest.mark.parametrize("child", [CKPT, CONFIG])
def test_a_child_an_earlier_job_of_this_name_still_owns_holds_the_launch(
    child: dict[str, Any],
) -> None:
    """Deleted and created again while the garbage collector still holds its old children:
    the owner is gone (names are unique, and this job now has the name), so wait for it."""
    verdict = judge(child, Existing(owners=(EARLIER,)), NAME, UID)
    assert verdict.claim is Claim.WAIT
    assert "uid-1" in verdict.message and "garbage collector" in verdict.message


def test_a_checkpoint_volume_kubetune_retained_for_this_name_is_taken_over() -> None:
    retained = Existing(labels={LABEL_JOB: NAME}, annotations={ANNOTATION_JOB_UID: "uid-1"})
    assert judge(CKPT, retained, NAME, UID).claim is Claim.OURS


@pytest.mark.parametrize(
    "existing",
    [
        Existing(),  # a claim the user made: its step-N folders are not checkpoints
        Existing(labels={LABEL_JOB: NAME}),  # the label alone is anyone's to set
        Existing(annotations={ANNOTATION_JOB_UID: "uid-9"}, labels={LABEL_JOB: "other"}),
        Existing(owners=(Owner("Deployment", "web", "uid-7"),)),
    ],
)
def test_any_other_claim_under_the_checkpoint_volume_s_name_is_a_conflict(
    existing: Existing,
) -> None:
    verdict = judge(CKPT, existing, NAME, UID)
    assert verdict.claim is Claim.CONFLICT
    assert "prunes" in verdict.message and "To fix:" in verdict.message


def test_objects_of_another_owner_conflict_and_the_shared_cache_claim_never_does() -> None:
    other = Existing(owners=(Owner("FineTuneJob", "other", "uid-9"),))
    verdict = judge(CONFIG, other, NAME, UID)
    assert verdict.claim is Claim.CONFLICT and "To fix:" in verdict.message
    assert judge(CONFIG, Existing(), NAME, UID).claim is Claim.CONFLICT
    assert judge(CACHE, Existing(), NAME, UID).claim is Claim.OURS
