"""What a reconcile observes of a job from the watch caches (controller/cache.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import LABEL_ATTEMPT, LABEL_JOB, LABEL_JOB_UID, Phase
from kubetune.controller.cache import Caches
from kubetune.planning.catalog import default_pools
from support.reconcile import Store, make_job

pytestmark = pytest.mark.unit

KEY = ("team-a", "demo")


def trainer_pod(name: str, uid: str | None) -> dict[str, Any]:
    labels = {LABEL_JOB: "demo", LABEL_ATTEMPT: "1"}
    if uid is not None:
        labels[LABEL_JOB_UID] = uid
    return {"metadata": {"name": name, "labels": labels}, "status": {"phase": "Running"}}


def test_pods_of_an_earlier_job_of_the_same_name_are_not_this_one_s() -> None:
    """Deleted and created again: the old job's attempt-1 pod, still terminating, is not
    taken for the new job's (it would show Training and a made-up preemption)."""
    job = make_job().model_copy(
        update={"status": FineTuneJobStatus(phase=Phase.RUNNING, attempt=1)}
    )
    batch = {
        "metadata": {
            "name": "demo-a1",
            "labels": {LABEL_JOB: "demo", LABEL_ATTEMPT: "1"},
            "ownerReferences": [{"kind": "FineTuneJob", "name": "demo", "uid": "uid-1"}],
        },
        "status": {"active": 1},
    }
    pods = [
        trainer_pod("demo-a1-0-old", "uid-0"),  # the deleted job's
        trainer_pod("demo-a1-0-new", "uid-1"),
        trainer_pod("demo-a1-0-legacy", None),  # made before pods carried the uid
    ]
    caches = Caches(Store({KEY: pods}), Store({KEY: [batch]}), Store(), Store(), Store())
    seen = caches.observe(job, default_pools())
    assert [p["metadata"]["name"] for p in seen.pods] == ["demo-a1-0-legacy", "demo-a1-0-new"]
