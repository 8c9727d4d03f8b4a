"""What the cluster's admins allow, enforced by the operator against the real API server:
pools kept to the namespaces they select, trainer images by allow-list, Secrets by the
namespace owner's consent, and the test-fault annotation ignored by a production operator
(the integration tier's runs without KUBETUNE_ALLOW_TEST_FAULTS).

Each refusal ends the job before anything is created for it: no volume, no pod.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.cluster import Cluster, job_doc, wait_phase
from support.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def fenced_pool(cluster: Cluster) -> Iterator[str]:
    """A pool on the simulated L40S nodes that only namespaces labelled team=vision use."""
    name = f"fenced-{uuid.uuid4().hex[:6]}"
    out = cluster.apply(
        {
            "apiVersion": "kubetune.io/v1alpha1",
            "kind": "GPUPool",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubetune.io/pool": "l40s"},
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                ],
                "gpu": {"product": "NVIDIA-L40S"},
                "gpusPerNode": 8,
                "maxNodes": 1,
                "pricePerGPUHour": 0.5,
                "namespaceSelector": {"matchLabels": {"team": "vision"}},
            },
        }
    )
    assert out.returncode == 0, out.stderr
    yield name
    cluster.kubectl("delete", "gpupool", name, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture
def vision_namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace labelled team=vision."""
    name = f"t-vision-{uuid.uuid4().hex[:6]}"
    labels = {"team": "vision", "pod-security.kubernetes.io/enforce": "restricted"}
    doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(doc))
    yield doc["metadata"]["name"]
    cluster.kubectl("delete", "namespace", doc["metadata"]["name"], "--wait=false", check=False)


def failed(cluster: Cluster, name: str, namespace: str) -> dict[str, Any]:
    obj = wait_phase(cluster, name, namespace, "Failed", "Running", "Succeeded")
    status = obj["status"]
    assert status["phase"] == "Failed", status
    return dict(status)


def created_nothing(cluster: Cluster, name: str, namespace: str) -> None:
    for kind in ("persistentvolumeclaim", "configmap", "job.batch"):
        assert not cluster.list(kind, namespace, f"kubetune.io/job={name}"), kind


def events(cluster: Cluster, name: str, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.name={name},involvedObject.kind=FineTuneJob",
    )  # fmt: skip
    return list(json.loads(out.stdout)["items"])


def test_a_pool_takes_only_the_namespaces_it_selects(
    cluster: Cluster, operator: Path, namespace: str, vision_namespace: str, fenced_pool: str
) -> None:
    doc = job_doc("fenced", resources={"pools": [fenced_pool]})
    assert cluster.apply(doc, namespace=vision_namespace).returncode == 0
    obj = wait_phase(cluster, "fenced", vision_namespace, "Running", "Succeeded")
    assert obj["status"]["plan"]["pool"] == fenced_pool

    assert cluster.apply(doc, namespace=namespace).returncode == 0
    status = failed(cluster, "fenced", namespace)
    assert (
        f"{fenced_pool}: namespace {namespace} may not use it (its spec.namespaceSelector "
        "selects team=vision)" in status["message"]
    )
    assert "ask the cluster admin for a pool this namespace may use" in status["message"]
    created_nothing(cluster, "fenced", namespace)


def test_a_trainer_image_off_the_allow_list_is_refused(
    cluster: Cluster, operator: Path, namespace: str
) -> None:
    doc = job_doc("own-image", trainerImage="registry.example.com/someone/miner:1")
    assert cluster.apply(doc, namespace=namespace).returncode == 0
    status = failed(cluster, "own-image", namespace)
    assert status["message"].startswith(
        "spec.trainerImage 'registry.example.com/someone/miner:1' is not allowed on this "
        "cluster (allowed: kubetune/trainer:test). To fix: remove spec.trainerImage"
    )
    (cond,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert cond["reason"] == "ImageNotAllowed"
    created_nothing(cluster, "own-image", namespace)


def test_a_secret_needs_the_namespace_owners_consent(
    cluster: Cluster, operator: Path, namespace: str
) -> None:
    doc = job_doc("gated", model={"tokenSecretRef": {"name": "hf-token"}})
    assert cluster.apply(doc, namespace=namespace).returncode == 0
    status = failed(cluster, "gated", namespace)
    assert status["message"] == (
        f"spec.model.tokenSecretRef names Secret 'hf-token', which namespace {namespace} has "
        "not allowed FineTuneJobs to use (allowed: none). To fix: a namespace admin runs "
        f"`kubectl annotate namespace {namespace} --overwrite "
        "kubetune.io/allowed-secrets=hf-token`"
    )
    created_nothing(cluster, "gated", namespace)
    # The fix the message gives works: with consent (and the Secret, which the launch
    # preflight checks), the next job launches.
    cluster.kubectl(
        "annotate", "namespace", namespace, "--overwrite", "kubetune.io/allowed-secrets=hf-token"
    )
    token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
             "stringData": {"token": "hf_x"}}  # fmt: skip
    assert cluster.apply(token, namespace=namespace).returncode == 0
    doc["metadata"]["name"] = "gated-2"
    assert cluster.apply(doc, namespace=namespace).returncode == 0
    obj = wait_phase(cluster, "gated-2", namespace, "Running", "Succeeded", "Failed")
    assert obj["status"]["phase"] != "Failed", obj["status"].get("message")


def test_the_test_fault_annotation_is_ignored_by_a_production_operator(
    cluster: Cluster, operator: Path, namespace: str
) -> None:
    doc = job_doc("faulty")
    doc["metadata"]["annotations"] = {"kubetune.io/test-faults": '{"oomAtStep": 2}'}
    assert cluster.apply(doc, namespace=namespace).returncode == 0
    wait_phase(cluster, "faulty", namespace, "Running", "Succeeded")
    config_map = wait_for(
        "the trainer's ConfigMap", lambda: cluster.get("configmap", "faulty-a1", namespace), 30
    )
    config = json.loads(config_map["data"]["config.json"])
    assert not (config.get("faults") or {}).get("oom_at_step"), config.get("faults")
    warned = wait_for(
        "a TestFaultsIgnored Event",
        lambda: [
            e for e in events(cluster, "faulty", namespace) if e["reason"] == "TestFaultsIgnored"
        ],
        30,
    )
    assert warned[0]["type"] == "Warning"
    assert "KUBETUNE_ALLOW_TEST_FAULTS" in warned[0]["message"]
