"""What `helm` makes of the chart: lint, renders with default and non-default values, the
values schema's checks, RBAC rules, the CRDs it installs.

Runs the real `helm` binary, which comes with the control-plane build (the `binaries`
fixture); the chart's files on their own are checked by tests/unit/test_chart.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune.controller.settings import leader_settings_from_env
from kubetune_dev.binaries import Binaries
from support.helm import Helm

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"
CRDS = ROOT / "crds"


@pytest.fixture(scope="module")
def helm(binaries: Binaries) -> Helm:
    return Helm(binaries.helm, timeout=120)


def render(
    helm: Helm, *sets: str, values: dict[str, Any] | None = None, tmp: Path | None = None
) -> list[dict]:
    """`helm template` of the chart with `--set`s and a values file."""
    args = ["template", "rel", str(CHART), "--namespace", "kubetune-system"]
    for s in sets:
        args += ["--set", s]
    if values is not None:
        assert tmp is not None
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def env_of(docs: list[dict]) -> dict[str, str]:
    (deploy,) = find(docs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def args_of(docs: list[dict]) -> list[str]:
    (deploy,) = find(docs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kubetune"] and container["args"][0] == "operator"
    return list(container["args"])


def field_refs(docs: list[dict]) -> dict[str, str]:
    (deploy,) = find(docs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    return {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }


def rules(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            for rule in d["rules"]:
                yield d, rule


def operator_rules(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """The rules of the (Cluster)Roles bound to the operator's ServiceAccount."""
    bound = {
        (b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
        for b in docs
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and any(s["kind"] == "ServiceAccount" for s in b["subjects"])
    }
    for role, rule in rules(docs):
        meta = role["metadata"]
        if (role["kind"], meta["name"], meta.get("namespace")) in bound:
            yield role, rule


ALL_ON = {
    "replicaCount": 2,
    "watch": {"namespaces": ["team-a", "team-b"]},
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "podMonitor": {"enabled": True},
    },
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "kubetune"}},
    "prometheusRule": {"enabled": True, "alertLabels": {"team": "ml"}},
    "gpuPools": [
        {
            "name": "l40s",
            "spec": {
                "nodeSelector": {"kubetune.io/pool": "l40s"},
                "gpu": {"product": "NVIDIA-L40S", "memoryGiB": 48, "bf16TFLOPS": 362},
                "gpusPerNode": 8,
                "maxNodes": 4,
                "pricePerGPUHour": 0.79,
            },
        }
    ],
    "operator": {
        "checkpointStorageClass": "fast-rwx",
        "safetyFactor": 1.2,
        "defaultObjective": "time",
        "trainerCPUPerGPU": "1500m",
        "trainerMemoryPerGPU": "2Gi",
        "trainerMemoryLimit": False,
        "logLevel": "verbose",
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
    },
}


# --------------------------------------------------------------------------- tests


def test_helm_lint_default_and_non_default(helm: Helm, tmp_path: Path) -> None:
    helm("lint", "--strict", str(CHART))
    path = tmp_path / "all-on.yaml"
    path.write_text(yaml.safe_dump(ALL_ON))
    helm("lint", "--strict", str(CHART), "-f", str(path))


def test_default_render_is_a_standalone_cluster_wide_operator(helm: Helm) -> None:
    docs = render(helm)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "NetworkPolicy",
        "Pod",
        "Service",
        "ServiceAccount",
    ]
    args = args_of(docs)
    assert not [a for a in args if a.startswith("--namespace")]  # all namespaces
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    (deploy,) = find(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # `helm test`: `kubetune check` as the operator, against its metrics Service; a pod
    # the operator's ReplicaSet must not adopt.
    (check,) = find(docs, "Pod")
    assert check["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert check["spec"]["serviceAccountName"] == pod["serviceAccountName"]
    assert check["spec"]["containers"][0]["args"] == [
        "check",
        "--operator-url=http://rel-kubetune-metrics.kubetune-system.svc:8000/metrics",
    ]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= check["metadata"]["labels"].items()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert container["image"] == "kubetune/operator:0.1.0"
    env = env_of(docs)
    assert env["KUBETUNE_LEADER_ELECTION"] == "false"
    assert field_refs(docs) == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert env["KUBETUNE_SAFETY_FACTOR"] == "1.1"
    assert env["KUBETUNE_DEFAULT_OBJECTIVE"] == "cost"
    assert env["KUBETUNE_METRICS_PORT"] == "8000"
    assert env["KUBETUNE_CHECKPOINT_STORAGE_CLASS"] == ""
    (svc,) = find(docs, "Service")
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # The operator's /metrics (every tenant's jobs and costs) reaches metricsFrom only.
    (policy,) = find(docs, "NetworkPolicy")
    check_labels = {
        k: check["metadata"]["labels"][k]
        for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")
    }
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [
                {"podSelector": {"matchLabels": check_labels}},  # `helm test`
                {"namespaceSelector": {"matchLabels": {"kubetune.io/metrics-scraper": "true"}}},
            ],
        }
    ]
    digest = "sha256:" + "ab" * 32
    (pinned,) = find(render(helm, f"image.digest={digest}"), "Deployment")
    image = pinned["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"kubetune/operator@{digest}"


def test_every_operator_setting_reaches_the_container(helm: Helm) -> None:
    """Each KUBETUNE_* variable the settings table says the chart sets is in the rendered
    Deployment's environment, and the chart sets no other (the table is what the operator
    reads: tests/unit/test_settings_table.py). The Lease's namespace is the release's: the
    operator reads it from POD_NAMESPACE, so the chart leaves KUBETUNE_LEASE_NAMESPACE out."""
    from kubetune.controller.settings.table import SETTINGS

    set_by_chart = {s.env for s in SETTINGS if s.values or s.chart}
    assert "KUBETUNE_LEASE_NAMESPACE" not in set_by_chart
    rendered = {name for name in env_of(render(helm)) if name.startswith("KUBETUNE_")}
    assert set_by_chart <= rendered, set_by_chart - rendered
    assert rendered <= {s.env for s in SETTINGS}, rendered - {s.env for s in SETTINGS}


def test_non_default_values(helm: Helm, tmp_path: Path) -> None:
    docs = render(helm, values=ALL_ON, tmp=tmp_path)
    args = args_of(docs)
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--verbose" in args
    (deploy,) = find(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = env_of(docs)
    assert env["KUBETUNE_LEADER_ELECTION"] == "true"
    assert env["KUBETUNE_LEASE_NAME"] == "rel-kubetune"
    assert env["KUBETUNE_CHECKPOINT_STORAGE_CLASS"] == "fast-rwx"
    assert env["KUBETUNE_SAFETY_FACTOR"] == "1.2"
    assert env["KUBETUNE_DEFAULT_OBJECTIVE"] == "time"
    assert env["KUBETUNE_TRAINER_CPU_PER_GPU"] == "1500m"
    assert env["KUBETUNE_TRAINER_MEMORY_PER_GPU"] == "2Gi"
    assert env["KUBETUNE_TRAINER_MEMORY_LIMIT"] == "false"
    assert env["EXTRA"] == "1"
    # Namespaced RBAC: a Role + RoleBinding per watched namespace, a small ClusterRole,
    # and the leader election's Role in the release namespace.
    roles = find(docs, "Role", "rel-kubetune")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert len(find(docs, "RoleBinding", "rel-kubetune")) == 2
    (lease_role,) = find(docs, "Role", "rel-kubetune-leader-election")
    assert lease_role["metadata"]["namespace"] == "kubetune-system"
    (cluster_role,) = find(docs, "ClusterRole", "rel-kubetune-cluster")
    cluster_resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert "finetunejobs" not in cluster_resources and "jobs" not in cluster_resources
    assert {"gpupools", "nodes", "customresourcedefinitions"} <= cluster_resources
    assert not [d for d in docs if "KopfPeering" in d["kind"]]
    assert {c["metadata"]["name"] for c in find(docs, "CustomResourceDefinition")} == {
        "finetunejobs.kubetune.io",
        "gpupools.kubetune.io",
    }
    # Monitoring objects.
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    (pm,) = find(docs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kubetune-trainer"}
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (rule,) = find(docs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) >= {
        "KubetuneJobStuckQueued",
        "KubetuneRepeatedOOMRecoveries",
        "KubetuneBudgetNearlySpent",
        "KubetuneNoProgress",
    }
    assert all(a["labels"]["team"] == "ml" for a in alerts.values())
    dashboards = find(docs, "ConfigMap")
    assert len(dashboards) == len(list((CHART / "dashboards").glob("*.json")))
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "kubetune"
        for text in cm["data"].values():
            assert json.loads(text)["uid"].startswith("kubetune")
    (pool,) = find(docs, "GPUPool")
    assert pool["metadata"]["name"] == "l40s" and pool["spec"]["pricePerGPUHour"] == 0.79
    # Without a cluster to look the GPUPool CRD up in (as on a first install into a cluster
    # without it), the pools are a post-install hook that carries the release's ownership,
    # so that the next upgrade adopts them instead of creating them again;
    # tests/integration/test_helm.py upgrades them in place.
    annotations = pool["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
    assert annotations["helm.sh/resource-policy"] == "keep"
    assert annotations["meta.helm.sh/release-name"] == "rel"
    assert annotations["meta.helm.sh/release-namespace"] == "kubetune-system"
    assert pool["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


LEASE_RULES = {
    ("create", None),
    ("get", ("ops-lease",)),
    ("update", ("ops-lease",)),
}


def test_leader_election_gets_its_lease_settings_and_a_role_for_the_lease(helm: Helm) -> None:
    docs = render(
        helm,
        "leaderElection.enabled=true",
        "leaderElection.leaseName=ops-lease",
        "leaderElection.leaseDurationSeconds=30",
        "leaderElection.renewDeadlineSeconds=20",
        "leaderElection.retryPeriodSeconds=4",
    )
    (deploy,) = find(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    env = env_of(docs)
    assert env["KUBETUNE_LEADER_ELECTION"] == "true"
    assert env["KUBETUNE_LEASE_NAME"] == "ops-lease"
    assert env["KUBETUNE_LEASE_DURATION_SECONDS"] == "30"
    assert env["KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS"] == "20"
    assert env["KUBETUNE_LEASE_RETRY_SECONDS"] == "4"
    assert "KUBETUNE_LEASE_NAMESPACE" not in env  # POD_NAMESPACE: the release's
    assert field_refs(docs)["POD_NAMESPACE"] == "metadata.namespace"
    # The operator accepts the settings the chart renders.
    settings = leader_settings_from_env(
        {**{k: v for k, v in env.items() if v is not None}, "POD_NAMESPACE": "kubetune-system"}
    )
    assert (settings.lease_duration_s, settings.renew_deadline_s) == (30, 20.0)
    (role,) = find(docs, "Role", "rel-kubetune-leader-election")
    assert role["metadata"]["namespace"] == "kubetune-system"
    granted = {
        (verb, tuple(rule["resourceNames"]) if "resourceNames" in rule else None)
        for rule in role["rules"]
        for verb in rule["verbs"]
    }
    assert granted == LEASE_RULES
    assert all(
        rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
        for rule in role["rules"]
    )
    (binding,) = find(docs, "RoleBinding", "rel-kubetune-leader-election")
    assert binding["roleRef"]["name"] == "rel-kubetune-leader-election"
    assert binding["subjects"][0]["name"] == "rel-kubetune"
    assert binding["subjects"][0]["namespace"] == "kubetune-system"
    # One replica without leader election gets no Lease rights.
    assert not find(render(helm), "Role")


def test_lease_timings_that_cannot_fence_are_refused(helm: Helm) -> None:
    for sets in (
        ["replicaCount=2", "leaderElection.renewDeadlineSeconds=15"],
        ["replicaCount=2", "leaderElection.retryPeriodSeconds=10"],
    ):
        args = ["template", "rel", str(CHART)]
        for s in sets:
            args += ["--set", s]
        out = helm(*args, check=False)
        assert out.returncode != 0, f"{sets} was accepted"
        assert "retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds" in out.stderr
        assert "To fix" in out.stderr


def test_toggles_turn_objects_off(helm: Helm) -> None:
    docs = render(
        helm,
        "crds.install=false",
        "rbac.create=false",
        "serviceAccount.create=false",
        "serviceAccount.name=existing",
        "metrics.enabled=false",
        "tenantRoles.enabled=false",
        "networkPolicy.operator=false",
    )
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Pod"]
    (deploy,) = find(docs, "Deployment")
    # Without metrics, `helm test` checks the CRDs only.
    assert find(docs, "Pod")[0]["spec"]["containers"][0]["args"] == ["check"]
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "existing"
    assert env_of(docs)["KUBETUNE_METRICS_PORT"] == "-1"
    docs = render(helm, "crds.keep=false")
    for crd in find(docs, "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_gpu_pool_catalog_example_in_values_is_valid(helm: Helm, tmp_path: Path) -> None:
    """The commented catalog in values.yaml renders to the same pools as examples/."""
    lines = (CHART / "values.yaml").read_text().split("\ngpuPools: []\n", 1)[1].splitlines()
    uncommented = "\n".join(line.removeprefix("  # ") for line in lines if line.startswith("  #"))
    pools = yaml.safe_load(uncommented)
    docs = find(render(helm, values={"gpuPools": pools}, tmp=tmp_path), "GPUPool")
    example = [d for d in yaml.safe_load_all((ROOT / "examples/gpupools.yaml").read_text()) if d]
    assert [(d["metadata"]["name"], d["spec"]) for d in docs] == [
        (d["metadata"]["name"], d["spec"]) for d in example
    ]
    from kubetune.api.v1alpha1 import GPUPool

    for doc in docs:
        GPUPool.model_validate(doc)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["replicaCount=0"], "replicaCount"),
        (["image.pullPolicy=Sometimes"], "pullPolicy"),
        (["json:operator.safetyFactor=0.5"], "minimum"),
        (["operator.pollSeconds=0"], "pollSeconds"),
        (["operator.logFormat=xml"], "logFormat"),
        (["operator.defaultObjective=fast"], "defaultObjective"),
        (["operator.defaultObjective=Time"], "defaultObjective"),
        (["operator.trainerCPUPerGPU=four"], "trainerCPUPerGPU"),
        (["operator.trainerCPUPerGPU=0"], "trainerCPUPerGPU"),
        (["operator.trainerMemoryPerGPU=16GB"], "trainerMemoryPerGPU"),
        (["operator.trainerMemoryLimit=maybe"], "trainerMemoryLimit"),
        (["watch.namespaces[0]=Not_A_Namespace"], "namespaces"),
        (["metrics.port=70000"], "port"),
        (["metrics.serviceMonitor.interval=soon"], "interval"),
        (["json:prometheusRule.budgetRatio=1.5"], "budgetRatio"),
        (["unknownKey=1"], "unknownKey"),
        (["operator.trainerImag=x"], "trainerImag"),
        (["gpuPools[0].name=x"], "spec"),
        (["gpuPools[0].name=x", "gpuPools[0].spec.gpusPerNode=1"], "maxNodes"),
        (["gpuPools[0].name=BAD", "gpuPools[0].spec.gpusPerNode=1"], "name"),
        (["peering.enabled=true"], "peering"),
        (["leaderElection.leaseDurationSeconds=1"], "leaseDurationSeconds"),
        (["leaderElection.leaseDurationSeconds=7.5"], "leaseDurationSeconds"),
        (["leaderElection.renewDeadlineSeconds=0"], "renewDeadlineSeconds"),
        (["leaderElection.leaseName=Bad_Name"], "leaseName"),
        (["tenantRoles.enabled=maybe"], "enabled"),
        (["tenantRoles.poolReaderGroups=everyone"], "poolReaderGroups"),
    ],
)
def test_schema_rejects_bad_values(helm: Helm, sets: list[str], message: str) -> None:
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set-json", s.removeprefix("json:")] if s.startswith("json:") else ["--set", s]
    out = helm(*args, check=False)
    assert out.returncode != 0, f"{sets} was accepted"
    assert "schema" in out.stderr.lower() or "values don't meet" in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


def test_rbac_has_no_wildcards_and_reads_secrets_only_by_name(helm: Helm, tmp_path: Path) -> None:
    for docs, secret_get in (
        (render(helm), True),
        (render(helm, values=ALL_ON, tmp=tmp_path), True),
        (render(helm, "leaderElection.enabled=true"), True),
        (render(helm, "rbac.secretPreflight=false"), False),
    ):
        secret_rules = []
        for role, rule in rules(docs):
            where = f"{role['kind']} {role['metadata']['name']}: {rule}"
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], where
            assert "*" not in rule.get("apiGroups", []), where
            if "secrets" in rule["resources"]:
                # The launch preflight's read by name: never list or watch (which would
                # hand the operator every Secret), never a write.
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get"], where
                secret_rules.append(rule)
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate"}, where
            assert "nonResourceURLs" not in rule, where
        assert bool(secret_rules) == secret_get


def test_rbac_rules_are_the_documented_set(helm: Helm) -> None:
    """The granted rules, flattened; a change here must be deliberate (and documented)."""
    granted = {
        (g, r, v)
        for _, rule in operator_rules(render(helm))
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    expected = {
        ("kubetune.io", "finetunejobs", v)
        for v in ("get", "list", "watch", "patch", "delete")  # get: a chained job's upstream
    } | {
        ("kubetune.io", "finetunejobs/status", "patch"),
        ("kubetune.io", "finetunejobs/finalizers", "update"),
        ("kubetune.io", "gpupools", "list"),
        ("kubetune.io", "gpupools", "watch"),
        ("kubetune.io", "gpupools", "patch"),
        ("kubetune.io", "gpupools/status", "patch"),
        *(("batch", "jobs", v) for v in ("get", "list", "watch", "create", "delete")),
        *(
            ("", r, v)
            for r in ("persistentvolumeclaims", "configmaps", "services")
            for v in ("get", "create")
        ),
        # The claims labelled with a job: the checkpoint volume's access modes.
        ("", "persistentvolumeclaims", "list"),
        ("", "persistentvolumeclaims", "watch"),
        ("", "persistentvolumeclaims", "patch"),  # expanding a checkpoint volume
        ("storage.k8s.io", "storageclasses", "list"),
        ("storage.k8s.io", "storageclasses", "watch"),
        # Where a zonal checkpoint volume can be mounted (its node affinity).
        ("", "persistentvolumes", "list"),
        ("", "persistentvolumes", "watch"),
        ("", "events", "create"),
        ("", "secrets", "get"),  # the launch preflight (rbac.secretPreflight)
        ("networking.k8s.io", "networkpolicies", "get"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        # What each namespace allows its jobs (pools by label, Secrets by annotation).
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    assert granted == expected
    with_lease = {
        (g, r, v)
        for _, rule in operator_rules(render(helm, "replicaCount=2"))
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    lease = {("coordination.k8s.io", "leases", v) for v in ("create", "get", "update")}
    assert with_lease == expected | lease
    readme = (CHART / "README.md").read_text()
    for _, resource, _ in expected | lease:
        assert f"`{resource}`" in readme, f"README.md does not explain {resource}"


def granted_by(role: dict) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


TENANT_EDIT = {
    *(
        ("kubetune.io", "finetunejobs", v)
        for v in ("get", "list", "watch", "create", "update", "patch", "delete")
    ),
    ("kubetune.io", "finetunejobs/status", "get"),
    *(("kubetune.io", "gpupools", v) for v in ("get", "list", "watch")),
}
TENANT_VIEW = {
    *(
        ("kubetune.io", r, v)
        for r in ("finetunejobs", "gpupools")
        for v in ("get", "list", "watch")
    ),
    ("kubetune.io", "finetunejobs/status", "get"),
}
POOL_READER = {("kubetune.io", "gpupools", v) for v in ("get", "list", "watch")}


def test_tenant_roles_aggregate_into_admin_edit_and_view(helm: Helm, tmp_path: Path) -> None:
    """Users bound to admin/edit manage FineTuneJobs, view reads them; GPUPools, which a
    namespace's RoleBinding cannot grant, are read through the pool-reader binding; no tenant
    role writes a job's status or a pool. tests/integration/test_helm.py checks what a user
    with these roles may do in a real API server."""
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    for docs in (render(helm), render(helm, values=ALL_ON, tmp=tmp_path)):
        (edit,) = find(docs, "ClusterRole", "rel-kubetune-tenant-edit")
        (view,) = find(docs, "ClusterRole", "rel-kubetune-tenant-view")
        (reader,) = find(docs, "ClusterRole", "rel-kubetune-pool-reader")
        aggregates = {
            name: {k for k, v in role["metadata"]["labels"].items() if k.startswith(aggregate)}
            for name, role in (("edit", edit), ("view", view), ("reader", reader))
        }
        assert aggregates == {
            "edit": {f"{aggregate}admin", f"{aggregate}edit"},
            "view": {f"{aggregate}view"},
            "reader": set(),
        }
        assert all(edit["metadata"]["labels"][k] == "true" for k in aggregates["edit"])
        assert view["metadata"]["labels"][f"{aggregate}view"] == "true"
        assert (granted_by(edit), granted_by(view), granted_by(reader)) == (
            TENANT_EDIT,
            TENANT_VIEW,
            POOL_READER,
        )
        (binding,) = find(docs, "ClusterRoleBinding", "rel-kubetune-pool-reader")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "rel-kubetune-pool-reader",
        }
        assert binding["subjects"] == [
            {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Group",
                "name": "system:authenticated",
            }
        ]
    # Other groups; none (the ClusterRole stays, to bind by hand); no tenant roles at all.
    docs = render(
        helm, values={"tenantRoles": {"poolReaderGroups": ["ml-team", "data"]}}, tmp=tmp_path
    )
    (binding,) = find(docs, "ClusterRoleBinding", "rel-kubetune-pool-reader")
    assert [s["name"] for s in binding["subjects"]] == ["ml-team", "data"]
    docs = render(helm, values={"tenantRoles": {"poolReaderGroups": []}}, tmp=tmp_path)
    assert find(docs, "ClusterRole", "rel-kubetune-pool-reader")
    assert not find(docs, "ClusterRoleBinding", "rel-kubetune-pool-reader")
    docs = render(helm, "tenantRoles.enabled=false")
    assert not [d for d in docs if "tenant" in d["metadata"]["name"]]
    assert not [d for d in docs if "pool-reader" in d["metadata"]["name"]]
    # The operator's own RBAC does not depend on them.
    assert find(docs, "ClusterRole", "rel-kubetune")


def test_installed_crds_are_the_crds_folder(helm: Helm) -> None:
    """The chart installs crds/ as they are, with only the keep annotation added."""
    sources = sorted(CRDS.glob("*.yaml"))
    assert sources
    rendered = {d["metadata"]["name"]: d for d in find(render(helm), "CustomResourceDefinition")}
    for source in sources:
        original = yaml.safe_load(source.read_text())
        copy = rendered[original["metadata"]["name"]]
        assert copy["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        copy["metadata"] = {"name": copy["metadata"]["name"]}
        assert copy == original
