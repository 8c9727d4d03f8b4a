"""spec.training.earlyStopping at a real kube-apiserver: the CRD's CEL rules refuse what the
pydantic validators refuse, with the same "To fix:" messages, and take what they take."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubetune.api.v1alpha1 import (
    EARLY_STOPPING_NEEDS_VALIDATION,
    REWARD_ACCURACY_NEEDS_DPO,
    FineTuneJobSpec,
)
from support.cluster import Cluster, job_doc

pytestmark = pytest.mark.integration

WITH_VALIDATION = {
    "uri": "/data/train.jsonl",
    "numExamples": 2000,
    "avgTokensPerExample": 200,
    "validationSplit": 0.05,
}


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"training": {"maxSteps": 20, "earlyStopping": {}}}, EARLY_STOPPING_NEEDS_VALIDATION),
        (
            {
                "dataset": {**WITH_VALIDATION, "validationSplit": 0},
                "training": {"maxSteps": 20, "earlyStopping": {"patience": 2}},
            },
            EARLY_STOPPING_NEEDS_VALIDATION,
        ),
        (
            {
                "dataset": WITH_VALIDATION,
                "training": {"earlyStopping": {"metric": "eval_reward_accuracy"}},
            },
            REWARD_ACCURACY_NEEDS_DPO,
        ),
    ],
)
def test_admission_refuses_early_stopping_without_what_it_needs(
    cluster: Cluster, namespace: str, over: dict[str, Any], message: str
) -> None:
    doc = job_doc("es-bad", **over)
    with pytest.raises(ValueError, match="To fix"):
        FineTuneJobSpec.model_validate(doc["spec"])
    out = cluster.apply(doc, namespace=namespace)
    assert out.returncode != 0
    assert message in " ".join(out.stderr.split()), out.stderr


@pytest.mark.parametrize(
    "over",
    [
        {"dataset": WITH_VALIDATION, "training": {"earlyStopping": {}}},
        {
            "dataset": WITH_VALIDATION,
            "training": {
                "objective": "dpo",
                "earlyStopping": {
                    "patience": 2,
                    "minDelta": 0.01,
                    "metric": "eval_reward_accuracy",
                },
            },
        },
    ],
)
def test_admission_takes_early_stopping_with_validation_data_and_stores_no_defaults(
    cluster: Cluster, namespace: str, over: dict[str, Any]
) -> None:
    doc = job_doc("es-good", **over)
    FineTuneJobSpec.model_validate(doc["spec"])
    out = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        "-n",
        namespace,
        input=json.dumps(doc),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout)["spec"]["training"]["earlyStopping"]
    assert stored == over["training"]["earlyStopping"]
