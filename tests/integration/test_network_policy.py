"""Each job's NetworkPolicy against a real kube-apiserver and garbage collector.

The local control plane has no CNI, so nothing enforces the policy here: these tests check
that the operator creates it, that the API server accepts every form the builder makes, and
that it goes with its job. Enforcement is described in docs/trainer-pods.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.control.build.names import label_value
from kubetune.control.build.network import build_network_policy
from kubetune.control.build.settings import BuildSettings
from support.cluster import Cluster, job_doc, wait_phase
from support.waiting import wait_for

pytestmark = pytest.mark.integration


def test_the_operator_creates_a_policy_that_goes_with_its_job(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    doc = job_doc("fenced", checkpoint={"storage": {"retention": "delete"}})
    cluster.apply(doc, namespace=namespace)
    wait_phase(cluster, "fenced", namespace, "Running", "Succeeded")
    policy = wait_for(
        "networkpolicy/fenced", lambda: cluster.get("networkpolicy", "fenced", namespace), 30
    )
    job = cluster.get("finetunejob", "fenced", namespace)
    assert job is not None
    (owner,) = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("FineTuneJob", job["metadata"]["uid"])
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"kubetune.io/job": "fenced"}}
    assert spec["policyTypes"] == ["Ingress"]
    same_job, scrapers = spec["ingress"]
    assert same_job == {"from": [{"podSelector": {"matchLabels": {"kubetune.io/job": "fenced"}}}]}
    assert scrapers["ports"] == [{"port": 9400, "protocol": "TCP"}]
    # The policy selects the trainer pods the batch Job made.
    pods = wait_for(
        "trainer pods", lambda: cluster.list("pods", namespace, "kubetune.io/job=fenced"), 30
    )
    assert all(p["metadata"]["labels"]["kubetune.io/job"] == "fenced" for p in pods)

    cluster.kubectl("delete", "ftj", "fenced", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "networkpolicy/fenced collected",
        lambda: cluster.get("networkpolicy", "fenced", namespace) is None,
        60,
    )


def test_the_api_server_accepts_every_form_of_the_policy(cluster: Cluster, namespace: str) -> None:
    name = "a" * 70 + ".v2"  # shortened label value and name
    job = FineTuneJob.model_validate(
        {**job_doc(name), "metadata": {"name": name, "namespace": namespace, "uid": "u-1"}}
    )
    settings = replace(
        BuildSettings(),
        metrics_port=9500,
        operator_namespace="kubetune-system",
        operator_pod_labels=(
            ("app.kubernetes.io/component", "operator"),
            ("app.kubernetes.io/instance", "rel"),
        ),
        metrics_from=(
            {"namespaceSelector": {"matchLabels": {"kubetune.io/metrics-scraper": "true"}}},
            {
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "team", "operator": "In", "values": ["obs", "sre"]}
                    ]
                },
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            },
            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
        ),
    )
    for build in (settings, replace(settings, metrics_from=()), BuildSettings()):
        policy = build_network_policy(job, build)
        del policy["metadata"]["ownerReferences"]  # no such FineTuneJob in the cluster
        out = cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(policy)
        )
        created = yaml.safe_load(out.stdout)
        assert created["spec"]["podSelector"] == {
            "matchLabels": {"kubetune.io/job": label_value(name)}
        }
        assert created["spec"]["ingress"] == policy["spec"]["ingress"]
