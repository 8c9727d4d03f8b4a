"""The NetworkPolicy that comes with each job's trainer pods (docs/trainer-pods.md).

Builder: what it selects, whom it admits on which port, that it is left out when the setting
is off. Settings: the environment variables the chart sets. Runtime: it is created with the
other children before the batch Job, an existing one of the job's own is taken as created
(409), and one owned by someone else fails the job like any other child.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kmock
import pytest

from kubetune.api.vocabulary import ConditionType, Reason
from kubetune.control.build.children import build_children
from kubetune.control.build.names import child_names, label_value, owner_reference
from kubetune.control.build.network import build_network_policy
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.trainer import build_indexed_job
from kubetune.controller.kube import Kube
from kubetune.controller.settings import settings_from_env
from support.emulated import NAMESPACE, condition, example_cluster, requests, seed, tiny_job
from support.kmock_apiserver import ApiServerEmulator
from unit import test_jobloop as emulated
from unit.test_builders import full_8b_job, full_8b_plan, h100_pool, tiny_lora_job
from unit.test_jobloop import Loop

# The emulated API server, a Kube client of it and the loops' clock (test_jobloop.py).
apiserver = emulated.apiserver
kube = emulated.kube
clock = emulated.clock

pytestmark = [
    pytest.mark.unit,
    # KMock's bundled resource list is read with a deprecated importlib call.
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

NETPOLS = "networking.k8s.io/v1/networkpolicies"
OPERATOR_LABELS = (("app.kubernetes.io/component", "operator"), ("app.kubernetes.io/name", "kt"))
IN_CLUSTER = replace(
    BuildSettings(), operator_namespace="kubetune-system", operator_pod_labels=OPERATOR_LABELS
)


def _peers(policy: dict[str, Any]) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    return [(rule["from"], rule.get("ports", [])) for rule in policy["spec"]["ingress"]]


# --------------------------------------------------------------------------- builder


def test_policy_selects_the_jobs_trainer_pods_and_restricts_ingress_only() -> None:
    job = full_8b_job()
    policy = build_network_policy(job, IN_CLUSTER)

    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == child_names(job.metadata["name"], 1).network_policy
    assert policy["metadata"]["namespace"] == job.metadata["namespace"]
    assert policy["metadata"]["ownerReferences"] == [owner_reference(job)]
    # Egress stays open: model and data downloads, DNS.
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert "egress" not in policy["spec"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == {"kubetune.io/job": "llama-8b-full"}
    # It selects the pods of every attempt: their labels include the selector.
    for attempt in (1, 2):
        built = build_indexed_job(job, full_8b_plan(), h100_pool(), IN_CLUSTER, attempt)
        pod_labels = built["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()


def test_pods_of_the_same_job_reach_every_port_others_only_metrics() -> None:
    policy = build_network_policy(full_8b_job(), IN_CLUSTER)

    (same_job, same_ports), (scrapers, scrape_ports) = _peers(policy)
    # Rendezvous (29400) and NCCL/gloo's ephemeral ports: every port, from the job's pods in
    # the job's namespace only (a podSelector without namespaceSelector).
    assert same_job == [{"podSelector": {"matchLabels": {"kubetune.io/job": "llama-8b-full"}}}]
    assert same_ports == []
    assert scrape_ports == [{"protocol": "TCP", "port": 9400}]
    assert scrapers == [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "kubetune-system"}
            },
            "podSelector": {"matchLabels": dict(OPERATOR_LABELS)},
        },
        {"namespaceSelector": {"matchLabels": {"kubetune.io/metrics-scraper": "true"}}},
    ]


def test_metrics_port_and_scrapers_follow_the_settings() -> None:
    prometheus = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    settings = replace(IN_CLUSTER, metrics_port=9500, metrics_from=(prometheus,))
    (_, (scrapers, ports)) = _peers(build_network_policy(full_8b_job(), settings))
    assert ports == [{"protocol": "TCP", "port": 9500}]
    assert scrapers[1:] == [prometheus]
    # The manifest holds a copy: changing it leaves the settings alone.
    scrapers[1]["podSelector"]["matchLabels"]["x"] = "y"
    assert "x" not in prometheus["podSelector"]["matchLabels"]


def test_an_operator_outside_the_cluster_is_no_peer() -> None:
    (_, (scrapers, _)) = _peers(build_network_policy(full_8b_job(), BuildSettings()))
    assert scrapers == [
        {"namespaceSelector": {"matchLabels": {"kubetune.io/metrics-scraper": "true"}}}
    ]
    # Nobody to admit to the metrics port: only the same-job rule is left.
    alone = replace(BuildSettings(), metrics_from=())
    assert len(build_network_policy(full_8b_job(), alone)["spec"]["ingress"]) == 1


def test_long_job_names_select_by_the_shortened_label() -> None:
    job = tiny_lora_job()
    job.metadata["name"] = "n" * 80
    policy = build_network_policy(job, IN_CLUSTER)
    value = label_value(job.metadata["name"])
    assert len(value) <= 63
    assert policy["spec"]["podSelector"]["matchLabels"] == {"kubetune.io/job": value}
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
        "kubetune.io/job": value
    }
    assert len(policy["metadata"]["name"]) <= 63


def test_policy_comes_before_the_batch_job_and_not_at_all_when_off() -> None:
    job, plan, pool = full_8b_job(), full_8b_plan(), h100_pool()
    kinds = [c["kind"] for c in build_children(job, plan, pool, IN_CLUSTER, 1)]
    assert kinds == ["PersistentVolumeClaim", "ConfigMap", "Service", "NetworkPolicy", "Job"]
    off = replace(IN_CLUSTER, network_policy=False)
    kinds = [c["kind"] for c in build_children(job, plan, pool, off, 1)]
    assert kinds == ["PersistentVolumeClaim", "ConfigMap", "Service", "Job"]


# --------------------------------------------------------------------------- settings


def test_settings_default_to_policies_for_the_default_scrapers() -> None:
    build = settings_from_env({}).build
    assert build.network_policy is True
    assert build.operator_namespace is None
    assert build.operator_pod_labels == ()
    assert build.metrics_from == BuildSettings.metrics_from


def test_settings_from_the_charts_variables() -> None:
    build = settings_from_env(
        {
            "KUBETUNE_NETWORK_POLICIES": "false",
            "KUBETUNE_OPERATOR_NAMESPACE": "ops",
            "KUBETUNE_OPERATOR_POD_LABELS": '{"b": "2", "a": "1"}',
            "KUBETUNE_METRICS_FROM": '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]',
        }
    ).build
    assert build.network_policy is False
    assert build.operator_namespace == "ops"
    assert build.operator_pod_labels == (("a", "1"), ("b", "2"))
    assert build.metrics_from == ({"ipBlock": {"cidr": "10.0.0.0/8"}},)
    assert settings_from_env({"KUBETUNE_METRICS_FROM": "[]"}).build.metrics_from == ()
    # In a pod without the chart's variable, the pod's namespace.
    assert settings_from_env({"POD_NAMESPACE": "kt"}).build.operator_namespace == "kt"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KUBETUNE_NETWORK_POLICIES": "maybe"}, "not true or false"),
        ({"KUBETUNE_OPERATOR_POD_LABELS": "app=kubetune"}, "is not JSON"),
        ({"KUBETUNE_OPERATOR_POD_LABELS": '["a"]'}, "is not a JSON dict"),
        ({"KUBETUNE_OPERATOR_POD_LABELS": '{"a": 1}'}, "must be strings"),
        ({"KUBETUNE_METRICS_FROM": '{"podSelector": {}}'}, "is not a JSON list"),
        ({"KUBETUNE_METRICS_FROM": '[{"pods": {}}]'}, "is not a NetworkPolicyPeer"),
        ({"KUBETUNE_METRICS_FROM": "[{}]"}, "is not a NetworkPolicyPeer"),
    ],
)
def test_bad_settings_stop_the_operator_with_a_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        settings_from_env(env)
    assert "to fix" in str(err.value)


# --------------------------------------------------------------------------- the job loop


def _network_policies(server: kmock.KubernetesEmulator) -> dict[str, dict[str, Any]]:
    return {
        name: dict(obj)
        for (res, ns, name), obj in server.objects.items()
        if res == kmock.resource(NETPOLS) and ns == NAMESPACE and not obj.deleted
    }


def _loop(server: ApiServerEmulator, kube: Kube, build: BuildSettings) -> Loop:
    return Loop(server, kube, build=build)


async def test_launch_creates_the_policy_before_the_batch_job(
    apiserver: ApiServerEmulator, kube: Kube, clock: Any
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    loop = _loop(apiserver, kube, IN_CLUSTER)

    await loop.look()

    name = child_names("tiny-cpu-lora", 1).network_policy
    (policy,) = _network_policies(apiserver).values()
    assert policy["metadata"]["name"] == name
    assert policy["metadata"]["ownerReferences"][0]["uid"] == tiny_job()["metadata"]["uid"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"kubetune.io/job": "tiny-cpu-lora"}}
    creates = [r.resource for r in requests(apiserver, kmock.action.CREATE)]
    assert creates.index(kmock.resource(NETPOLS)) < creates.index(kmock.resource("batch/v1/jobs"))
    assert loop.status()["phase"] != "Failed"


async def test_no_policy_when_turned_off(
    apiserver: ApiServerEmulator, kube: Kube, clock: Any
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    loop = _loop(apiserver, kube, replace(IN_CLUSTER, network_policy=False))

    await loop.look()

    assert _network_policies(apiserver) == {}
    assert not requests(apiserver, kmock.action.CREATE, NETPOLS)
    assert loop.status()["phase"] != "Failed"


def _existing_policy(uid: str, owner_name: str | None = None) -> dict[str, Any]:
    owner = {**owner_reference_of_tiny_job(), "uid": uid}
    if owner_name is not None:
        owner["name"] = owner_name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": child_names("tiny-cpu-lora", 1).network_policy,
            "namespace": NAMESPACE,
            "resourceVersion": "1",
            "ownerReferences": [owner],
        },
        "spec": {"podSelector": {}},
    }


def owner_reference_of_tiny_job() -> dict[str, Any]:
    meta = tiny_job()["metadata"]
    return {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


async def test_a_policy_of_its_own_is_taken_as_created(
    apiserver: ApiServerEmulator, kube: Kube, clock: Any
) -> None:
    # A launch an earlier operator run began: the policy is there, the create answers 409.
    existing = _existing_policy(tiny_job()["metadata"]["uid"])
    apiserver.objects[NETPOLS, NAMESPACE, existing["metadata"]["name"]] = existing
    seed(apiserver, *example_cluster(), tiny_job())
    loop = _loop(apiserver, kube, IN_CLUSTER)

    await loop.look()

    assert [getattr(e, "status", None) for e in apiserver.errors] == [409]
    assert loop.status()["phase"] != "Failed"
    assert requests(apiserver, kmock.action.CREATE, "batch/v1/jobs")
    # Left as it was: create-if-absent, no update.
    (policy,) = _network_policies(apiserver).values()
    assert policy["spec"] == {"podSelector": {}}
    # Created once: the next look POSTs no policy again.
    before = len(requests(apiserver, kmock.action.CREATE, NETPOLS))
    await loop.look()
    assert len(requests(apiserver, kmock.action.CREATE, NETPOLS)) == before


async def test_a_policy_an_earlier_job_of_the_same_name_left_holds_the_launch(
    apiserver: ApiServerEmulator, kube: Kube, clock: Any
) -> None:
    """Owned by a FineTuneJob of this name and another uid: that job was deleted and the
    garbage collector has yet to remove its policy. No failure, no trainer until it goes."""
    existing = _existing_policy("uid-of-the-deleted-job")
    apiserver.objects[NETPOLS, NAMESPACE, existing["metadata"]["name"]] = existing
    seed(apiserver, *example_cluster(), tiny_job())
    loop = _loop(apiserver, kube, IN_CLUSTER)

    await loop.look()

    assert loop.status()["phase"] != "Failed"
    assert not requests(apiserver, kmock.action.CREATE, "batch/v1/jobs")


async def test_a_policy_owned_by_someone_else_fails_the_job(
    apiserver: ApiServerEmulator, kube: Kube, clock: Any
) -> None:
    existing = _existing_policy("someone-else", owner_name="another-job")
    apiserver.objects[NETPOLS, NAMESPACE, existing["metadata"]["name"]] = existing
    seed(apiserver, *example_cluster(), tiny_job())
    loop = _loop(apiserver, kube, IN_CLUSTER)

    await loop.look()

    status = loop.status()
    assert status["phase"] == "Failed"
    assert condition(status, ConditionType.FAILED)["reason"] == Reason.CHILD_CONFLICT
    assert "a NetworkPolicy named tiny-cpu-lora already exists" in status["message"]
    assert not requests(apiserver, kmock.action.CREATE, "batch/v1/jobs")
