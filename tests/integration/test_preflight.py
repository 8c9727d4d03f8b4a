"""The launch preflight against a real kube-apiserver: a job whose `pvc://` claim or token
Secret is missing holds before any child is created, says which object and how to fix it,
and launches once the object exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.cluster import Cluster, job_doc, wait_phase
from support.waiting import wait_for

pytestmark = pytest.mark.integration


def held(cluster: Cluster, name: str, namespace: str) -> dict[str, Any]:
    """The job's InputsReady condition, once the operator set it."""

    def probe() -> dict[str, Any] | None:
        obj = cluster.get("finetunejob", name, namespace) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == "InputsReady":
                return dict(cond)
        return None

    return wait_for(f"{name}: InputsReady", probe, 30)


def no_children(cluster: Cluster, name: str, namespace: str) -> None:
    for kind, child in [("job.batch", f"{name}-a1"), ("pvc", f"{name}-ckpt")]:
        assert cluster.get(kind, child, namespace) is None, f"{kind}/{child} was created"


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def secret(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}


def test_a_missing_claim_holds_the_job_until_it_is_created(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    doc = job_doc("noclaim", dataset={"uri": "pvc://train-data/alpaca.jsonl"})
    cluster.apply(doc, namespace=namespace)

    cond = held(cluster, "noclaim", namespace)
    assert (cond["status"], cond["reason"]) == ("False", "MissingVolume")
    assert "PersistentVolumeClaim 'train-data' (spec.dataset.uri) does not exist" in cond["message"]
    assert "To fix: create the claim 'train-data'" in cond["message"]
    obj = cluster.get("finetunejob", "noclaim", namespace)
    assert obj is not None and obj["status"]["phase"] == "Pending"
    no_children(cluster, "noclaim", namespace)
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=noclaim"
    ).stdout
    assert "MissingVolume" in events

    assert cluster.apply(claim("train-data"), namespace=namespace).returncode == 0
    obj = wait_phase(cluster, "noclaim", namespace, "Running", "Succeeded", timeout=60)
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "InputsReady")
    assert (ready["status"], ready["reason"]) == ("True", "InputsFound")


def test_a_missing_secret_or_key_holds_the_job(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    # The namespace consents to the Secret (docs/security.md); only then is it read.
    cluster.kubectl(
        "annotate", "namespace", namespace, "--overwrite", "kubetune.io/allowed-secrets=hub-token"
    )
    token = {"tokenSecretRef": {"name": "hub-token", "key": "token"}}
    cluster.apply(job_doc("nosecret", model=token), namespace=namespace)

    cond = held(cluster, "nosecret", namespace)
    assert cond["reason"] == "MissingSecret"
    assert "Secret 'hub-token' (spec.model.tokenSecretRef) does not exist" in cond["message"]
    assert "kubectl create secret generic hub-token --from-literal=token=<token>" in cond["message"]

    # The Secret appears with the wrong key: still held, now for the key.
    assert cluster.apply(secret("hub-token", hf="x"), namespace=namespace).returncode == 0
    wait_for(
        "the key named",
        lambda: "has no key 'token'" in held(cluster, "nosecret", namespace)["message"],
        30,
    )
    no_children(cluster, "nosecret", namespace)

    assert cluster.apply(secret("hub-token", token="x"), namespace=namespace).returncode == 0
    wait_phase(cluster, "nosecret", namespace, "Running", "Succeeded", timeout=60)
