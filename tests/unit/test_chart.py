"""The Helm chart: lint, render with default and non-default values, schema, RBAC, CRD drift.

Runs the real `helm` binary (built with the control-plane binaries). The chart's CRD
templates are copies of crds/ with Helm labels and the keep annotation added; after
changing the API, refresh them with `python tests/unit/test_chart.py`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"
CRDS = ROOT / "crds"
CRD_TEMPLATES = CHART / "templates/crds"

# --------------------------------------------------------------------------- CRD copies

_META = """metadata:
  name: {name}
  labels:
    {{{{- include "kubetune.labels" . | nindent 4 }}}}
  {{{{- if .Values.crds.keep }}}}
  annotations:
    # helm uninstall leaves the CRDs, and with them every FineTuneJob and GPUPool.
    helm.sh/resource-policy: keep
  {{{{- end }}}}
"""


def crd_template(source: Path) -> str:
    """The chart template for one file of crds/: the same CRD, wrapped for Helm."""
    text = source.read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"
    name = yaml.safe_load(body)["metadata"]["name"]
    plain = f"metadata:\n  name: {name}\n"
    assert plain in body, f"{source}: unexpected metadata layout"
    assert "{{" not in body, f"{source}: contains '{{{{', which Helm would evaluate"
    return (
        "{{- if .Values.crds.install }}\n"
        f"# Copied from crds/{source.name} by `python tests/unit/test_chart.py`. Do not edit.\n"
        + body.replace(plain, _META.format(name=name), 1)
        + "{{- end }}\n"
    )


def crd_template_path(source: Path) -> Path:
    return CRD_TEMPLATES / f"{source.name.split('.')[0]}.yaml"


def openapi_to_jsonschema(node: Any) -> Any:
    """A CRD's OpenAPI v3.0 schema as JSON Schema (draft-07): boolean exclusive bounds."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items()}
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            del out[exclusive]
    return out


def pool_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / "gpupools.kubetune.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return dict(openapi_to_jsonschema(spec))


def sync_values_schema() -> bool:
    """values.schema.json validates gpuPools[].spec with the GPUPool CRD's own schema."""
    path = CHART / "values.schema.json"
    schema = json.loads(path.read_text())
    if schema["definitions"]["gpuPoolSpec"] == pool_spec_schema():
        return False
    schema["definitions"]["gpuPoolSpec"] = pool_spec_schema()
    path.write_text(json.dumps(schema, indent=2) + "\n")
    return True


def sync_crd_templates() -> list[Path]:
    written = []
    for source in sorted(CRDS.glob("*.yaml")):
        target = crd_template_path(source)
        text = crd_template(source)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            written.append(target)
    return written


# --------------------------------------------------------------------------- helm


@cache
def helm_binary() -> str:
    from kubetune_dev.binaries import ensure_binaries

    return str(ensure_binaries(lambda msg: print(msg, file=sys.stderr)).helm)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}:\n{out.stdout}\n{out.stderr}")
    return out


def render(*sets: str, values: dict[str, Any] | None = None, tmp: Path | None = None) -> list[dict]:
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
    return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


def rules(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            for rule in d["rules"]:
                yield d, rule


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
        "logLevel": "verbose",
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
    },
}

# --------------------------------------------------------------------------- tests


def test_helm_lint_default_and_non_default(tmp_path: Path) -> None:
    helm("lint", "--strict", str(CHART))
    path = tmp_path / "all-on.yaml"
    path.write_text(yaml.safe_dump(ALL_ON))
    helm("lint", "--strict", str(CHART), "-f", str(path))


def test_default_render_is_a_standalone_cluster_wide_operator() -> None:
    docs = render()
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "ServiceAccount",
    ]
    args = args_of(docs)
    assert "--standalone" in args and "--all-namespaces" in args
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    (deploy,) = find(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    assert container["image"] == "kubetune/operator:0.1.0"
    env = env_of(docs)
    assert env["KUBETUNE_SAFETY_FACTOR"] == "1.1"
    assert env["KUBETUNE_DEFAULT_OBJECTIVE"] == "cost"
    assert env["KUBETUNE_METRICS_PORT"] == "8000"
    assert env["KUBETUNE_CHECKPOINT_STORAGE_CLASS"] == ""
    (svc,) = find(docs, "Service")
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_every_operator_setting_reaches_the_container() -> None:
    """Each KUBETUNE_* variable the operator reads is set by the chart."""
    text = (ROOT / "operator/src/kubetune/controller/settings.py").read_text()
    read = set(re.findall(r"KUBETUNE_[A-Z_]+", text))
    assert read, "no settings found"
    assert read <= set(env_of(render()))


def test_non_default_values(tmp_path: Path) -> None:
    docs = render(values=ALL_ON, tmp=tmp_path)
    args = args_of(docs)
    assert "--peering=kubetune" in args and "--standalone" not in args
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args and "--verbose" in args
    (deploy,) = find(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2 and "strategy" not in deploy["spec"]
    env = env_of(docs)
    assert env["KUBETUNE_CHECKPOINT_STORAGE_CLASS"] == "fast-rwx"
    assert env["KUBETUNE_SAFETY_FACTOR"] == "1.2"
    assert env["KUBETUNE_DEFAULT_OBJECTIVE"] == "time"
    assert env["KUBETUNE_TRAINER_CPU_PER_GPU"] == "1500m"
    assert env["KUBETUNE_TRAINER_MEMORY_PER_GPU"] == "2Gi"
    assert env["EXTRA"] == "1"
    # Namespaced RBAC: a Role + RoleBinding per watched namespace, a small ClusterRole.
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert len(find(docs, "RoleBinding")) == 2
    (cluster_role,) = find(docs, "ClusterRole")
    cluster_resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert "finetunejobs" not in cluster_resources and "jobs" not in cluster_resources
    assert {"gpupools", "nodes", "customresourcedefinitions"} <= cluster_resources
    assert any("kopfpeerings" in rule["resources"] for r in roles for rule in r["rules"])
    peerings = find(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {c["metadata"]["name"] for c in find(docs, "CustomResourceDefinition")} >= {
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
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


def test_cluster_wide_peering_uses_a_cluster_peering() -> None:
    docs = render("peering.enabled=true")
    assert "--peering=kubetune" in args_of(docs)
    (peering,) = find(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "kubetune"
    assert any("clusterkopfpeerings" in rule["resources"] for _, rule in rules(docs))


def test_toggles_turn_objects_off() -> None:
    docs = render(
        "crds.install=false",
        "rbac.create=false",
        "serviceAccount.create=false",
        "serviceAccount.name=existing",
        "metrics.enabled=false",
    )
    assert sorted(d["kind"] for d in docs) == ["Deployment"]
    (deploy,) = docs
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "existing"
    assert env_of(docs)["KUBETUNE_METRICS_PORT"] == "-1"
    docs = render("crds.keep=false")
    for crd in find(docs, "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_gpu_pool_catalog_example_in_values_is_valid(tmp_path: Path) -> None:
    """The commented catalog in values.yaml renders to the same pools as examples/."""
    lines = (CHART / "values.yaml").read_text().split("\ngpuPools: []\n", 1)[1].splitlines()
    uncommented = "\n".join(line.removeprefix("  # ") for line in lines if line.startswith("  #"))
    pools = yaml.safe_load(uncommented)
    docs = find(render(values={"gpuPools": pools}, tmp=tmp_path), "GPUPool")
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
        (["watch.namespaces[0]=Not_A_Namespace"], "namespaces"),
        (["metrics.port=70000"], "port"),
        (["metrics.serviceMonitor.interval=soon"], "interval"),
        (["json:prometheusRule.budgetRatio=1.5"], "budgetRatio"),
        (["unknownKey=1"], "unknownKey"),
        (["operator.trainerImag=x"], "trainerImag"),
        (["gpuPools[0].name=x"], "spec"),
        (["gpuPools[0].name=x", "gpuPools[0].spec.gpusPerNode=1"], "maxNodes"),
        (["gpuPools[0].name=BAD", "gpuPools[0].spec.gpusPerNode=1"], "name"),
    ],
)
def test_schema_rejects_bad_values(sets: list[str], message: str) -> None:
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set-json", s.removeprefix("json:")] if s.startswith("json:") else ["--set", s]
    out = helm(*args, check=False)
    assert out.returncode != 0, f"{sets} was accepted"
    assert "schema" in out.stderr.lower() or "values don't meet" in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


def test_schema_covers_every_value() -> None:
    """Every key in values.yaml has a schema entry, and the schema forbids unknown keys."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(value, dict) or not value or "properties" not in node:
            return
        assert node.get("additionalProperties") is False, f"{path or '.'} allows unknown keys"
        for key, sub in value.items():
            assert key in node["properties"], f"{path}.{key} has no schema"
            walk(sub, node["properties"][key], f"{path}.{key}")

    walk(values, schema, "")
    missing = [
        key
        for key, node in schema["properties"].items()
        if "description" not in node and "$ref" not in node
    ]
    assert not missing, f"top-level values without description: {missing}"


def test_readme_documents_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def leaves(value: Any, node: dict[str, Any], path: str) -> Iterator[str]:
        if isinstance(value, dict) and value and "properties" in node:
            for key, sub in value.items():
                yield from leaves(sub, node["properties"][key], f"{path}.{key}" if path else key)
        else:
            yield path

    missing = [key for key in leaves(values, schema, "") if f"`{key}`" not in readme]
    assert not missing, f"README.md values table lacks {missing}"


def test_rbac_has_no_wildcards_and_no_secrets(tmp_path: Path) -> None:
    for docs in (render(), render(values=ALL_ON, tmp=tmp_path), render("peering.enabled=true")):
        for role, rule in rules(docs):
            where = f"{role['kind']} {role['metadata']['name']}: {rule}"
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], where
            assert "*" not in rule.get("apiGroups", []), where
            assert "secrets" not in rule["resources"], where
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate"}, where
            assert "nonResourceURLs" not in rule, where


def test_rbac_rules_are_the_documented_set() -> None:
    """The granted rules, flattened; a change here must be deliberate (and documented)."""
    granted = {
        (g, r, v)
        for _, rule in rules(render())
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    expected = {
        ("kubetune.io", "finetunejobs", v) for v in ("list", "watch", "patch", "delete")
    } | {
        ("kubetune.io", "finetunejobs/status", "patch"),
        ("kubetune.io", "finetunejobs/finalizers", "update"),
        ("kubetune.io", "gpupools", "list"),
        ("kubetune.io", "gpupools", "watch"),
        ("kubetune.io", "gpupools", "patch"),
        ("kubetune.io", "gpupools/status", "patch"),
        ("batch", "jobs", "list"),
        ("batch", "jobs", "create"),
        ("batch", "jobs", "delete"),
        ("", "persistentvolumeclaims", "create"),
        ("", "configmaps", "create"),
        ("", "services", "create"),
        ("", "events", "create"),
        ("", "nodes", "list"),
        ("", "pods", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    assert granted == expected
    readme = (CHART / "README.md").read_text()
    for _, resource, _ in expected:
        assert f"`{resource}`" in readme, f"README.md does not explain {resource}"


def test_crd_templates_match_crds_folder() -> None:
    sources = sorted(CRDS.glob("*.yaml"))
    assert sources
    for source in sources:
        target = crd_template_path(source)
        assert target.exists() and target.read_text() == crd_template(source), (
            f"{target.relative_to(ROOT)} is out of date with crds/{source.name}: "
            "run `python tests/unit/test_chart.py`"
        )
    rendered = {d["metadata"]["name"]: d for d in find(render(), "CustomResourceDefinition")}
    for source in sources:
        original = yaml.safe_load(source.read_text())
        copy = rendered[original["metadata"]["name"]]
        assert copy["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        copy["metadata"] = {"name": copy["metadata"]["name"]}
        assert copy == original


# --------------------------------------------------------------------------- dashboards

DASHBOARDS = CHART / "dashboards"
METRIC = re.compile(r"\b((?:kubetune|process)_[a-z0-9_]+)\b")


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            for target in sub.get("targets") or []:
                found.append((str(sub.get("title")), str(target["expr"])))
    return found


def exported_metric_names() -> set[str]:
    """Every series name the operator and the trainer expose."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kubetune.controller.metrics import OperatorMetrics
    from kubetune_trainer.metrics import TrainerMetrics

    operator = OperatorMetrics()
    operator.observe_job(
        {"metadata": {"namespace": "n", "name": "j"}, "spec": {}},
        {
            "phase": "Running",
            "plan": {
                "pool": "p",
                "totalGPUs": 1,
                "perGPUMemoryGiB": 1,
                "estimatedTokensPerSecond": 1,
            },
        },
    )
    trainer = TrainerMetrics(enabled=False, port=None, log_path=None, labels={})
    names: set[str] = set()
    for registry in (operator.registry, trainer.registry):
        text = generate_latest(registry).decode()
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
            names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names


def test_dashboards_match_their_generator() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="dev extra grafana-foundation-sdk")
    spec = importlib.util.spec_from_file_location("gen_dashboards", ROOT / "hack/gen_dashboards.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up there
    spec.loader.exec_module(gen)
    files = gen.render()
    assert sorted(files) == sorted(p.name for p in DASHBOARDS.glob("*.json"))
    for name, text in files.items():
        assert (DASHBOARDS / name).read_text() == text, (
            f"dashboards/{name} is out of date: run `python hack/gen_dashboards.py`"
        )


@pytest.mark.parametrize("path", sorted(DASHBOARDS.glob("*.json")), ids=lambda p: p.stem)
def test_dashboard_is_templated_and_uses_only_exported_metrics(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["title"].startswith("kubetune / ")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "namespace" in variables
    if path.stem == "training-run":
        assert "finetunejob" in variables
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    exported = exported_metric_names()
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel.get("description"), panel["title"]
    for title, expr in queries:
        used = set(METRIC.findall(expr))
        assert used, f"{title}: {expr}"
        assert used <= exported, f"{title}: {sorted(used - exported)} are not exported"
        assert (
            "$namespace" in expr
            or "kubetune_gpupool" in expr
            or "_total[" in expr
            or ("kubetune_reconcile" in expr or "kubetune_operator_info" in expr)
            or "_bucket[" in expr
        ), f"{title}: not filtered by namespace: {expr}"


def test_every_panel_is_described_in_the_docs() -> None:
    docs = (ROOT / "docs/observability.md").read_text()
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        assert dashboard["title"] in docs
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                assert f"**{panel['title']}**" in docs, f"{panel['title']} is not in the docs"


def test_values_schema_checks_pools_with_the_crd_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["gpuPoolSpec"] == pool_spec_schema(), (
        "values.schema.json is out of date with crds/: run `python tests/unit/test_chart.py`"
    )


if __name__ == "__main__":
    for path in sync_crd_templates():
        print(f"wrote {path.relative_to(ROOT)}")
    if sync_values_schema():
        print("wrote charts/kubetune/values.schema.json")
