"""The Helm chart's files, without helm: values schema and README, CRD copies, dashboards.

The chart's CRD templates are copies of crds/ with Helm labels and the keep annotation
added; after changing the API, refresh them with `python tests/unit/test_chart.py`. What
`helm` itself makes of the chart (lint, renders, schema checks, RBAC) is tested in
tests/integration/test_chart_render.py, since helm comes with the control-plane build.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.scripts import load_script

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


# --------------------------------------------------------------------------- tests


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


def test_crd_templates_match_crds_folder() -> None:
    sources = sorted(CRDS.glob("*.yaml"))
    assert sources
    for source in sources:
        target = crd_template_path(source)
        assert target.exists() and target.read_text() == crd_template(source), (
            f"{target.relative_to(ROOT)} is out of date with crds/{source.name}: "
            "run `python tests/unit/test_chart.py`"
        )


# --------------------------------------------------------------------------- dashboards

DASHBOARDS = CHART / "dashboards"
METRIC = re.compile(r"\b((?:kubetune|process)_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
"""A metric name in front of a label selector, whatever exports it."""
EXTERNAL = {
    "DCGM_FI_DEV_GPU_UTIL": "DCGM",
    "DCGM_FI_DEV_FB_USED": "DCGM",
    "container_memory_working_set_bytes": "cAdvisor",
}
"""The only metrics of other exporters the dashboards may use (GPU utilisation and memory
per GPU from NVIDIA's DCGM exporter, pod memory from the kubelet's cAdvisor), and the
exporter each panel's description must name."""
EXTERNAL_PANELS = {
    "GPU utilisation per GPU (DCGM)",
    "GPU memory used per GPU (DCGM)",
    "Trainer pod memory (cAdvisor)",
}
UNITLESS = {"Phase", "Loss", "DPO reward margin"}
"""Panels whose numbers have no unit (a text stat, a loss, DPO's rewards: β times a
difference of log-probabilities); every other one names its unit."""
RUN_UID = "kubetune-training-run"


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    return [sub for panel in dashboard["panels"] for sub in [panel, *panel.get("panels", [])]]


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets") or []:
            found.append((str(panel.get("title")), str(target["expr"])))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']}", str(annotation["expr"])))
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
                "gpuMemoryGiB": 1,
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
    gen = load_script("hack/gen_dashboards.py")
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
        used = set(METRIC.findall(expr)) | set(SELECTOR.findall(expr))
        assert used, f"{title}: {expr}"
        external = used - exported
        # Other exporters' metrics only on the panels made for them, by name.
        allowed = set(EXTERNAL) if title in EXTERNAL_PANELS else set()
        assert external <= allowed, f"{title}: {sorted(external - allowed)} are not exported"
        assert (
            "$namespace" in expr
            or "kubetune_gpupool" in expr
            or "_total[" in expr
            or ("kubetune_reconcile" in expr or "kubetune_operator_info" in expr)
            or "_bucket[" in expr
        ), f"{title}: not filtered by namespace: {expr}"


def test_panels_of_other_exporters_say_which_exporter_feeds_them() -> None:
    found = set()
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in panels(json.loads(path.read_text())):
            exprs = [str(t["expr"]) for t in panel.get("targets") or []]
            used = {m for e in exprs for m in SELECTOR.findall(e) if m in EXTERNAL}
            if used:
                found.add(panel["title"])
                for metric in used:
                    assert metric in panel["description"], (panel["title"], metric)
                    assert EXTERNAL[metric] in panel["description"], (panel["title"], metric)
                assert "No data" in panel["description"], panel["title"]
                # Joined to this job's pods (every rank and attempt) by the pod label.
                for expr in exprs:
                    if any(m in expr for m in EXTERNAL):
                        assert 'namespace="$namespace", pod=~"$finetunejob-a' in expr, expr
    assert found == EXTERNAL_PANELS


@pytest.mark.parametrize("path", sorted(DASHBOARDS.glob("*.json")), ids=lambda p: p.stem)
def test_every_number_has_a_unit(path: Path) -> None:
    for panel in panels(json.loads(path.read_text())):
        if panel["type"] not in ("timeseries", "stat", "gauge", "bargauge", "table"):
            continue
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit, f"{panel['title']} has no unit"
        if unit == "none":
            assert panel["title"] in UNITLESS or panel["type"] == "table", panel["title"]
        for override in panel["fieldConfig"]["overrides"]:
            for prop in override["properties"]:
                if prop["id"] == "unit":
                    assert prop["value"], panel["title"]


@pytest.mark.parametrize("path", sorted(DASHBOARDS.glob("*.json")), ids=lambda p: p.stem)
def test_tables_have_one_row_per_job(path: Path) -> None:
    """Instant queries in table format, merged into one frame (one row per job, one column
    per query) and organised; the job's name links to its Training run dashboard."""
    tables = [p for p in panels(json.loads(path.read_text())) if p["type"] == "table"]
    for panel in tables:
        for target in panel["targets"]:
            assert target["format"] == "table" and target["instant"] is True, panel["title"]
            # By job only: the scrape's job/instance labels would become columns.
            by_job = ("sum by (namespace, finetunejob", "max by (namespace, finetunejob")
            assert target["expr"].startswith(by_job), panel["title"]
        ids = [t["id"] for t in panel["transformations"]]
        assert ids[:2] == ["merge", "organize"], panel["title"]
        organize = panel["transformations"][1]["options"]
        assert organize["excludeByName"]["Time"] is True
        values = {"Value"} if len(panel["targets"]) == 1 else {
            f"Value #{t['refId']}" for t in panel["targets"]
        }  # fmt: skip
        # Every value column is renamed or hidden, and ordered by its name before renaming.
        assert values <= set(organize["renameByName"]) | set(organize["excludeByName"])
        assert set(organize["indexByName"]) <= values | {"namespace", "finetunejob"}
        (link,) = [
            o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == "finetunejob"
        ]
        (prop,) = link["properties"]
        (url,) = [x["url"] for x in prop["value"]]
        assert url.startswith(f"/d/{RUN_UID}/")
        assert "var-namespace=${__data.fields.namespace}" in url
        assert "var-finetunejob=${__value.raw}" in url
    if path.stem == "jobs-overview":
        assert len(tables) >= 3


def test_links_go_to_the_training_run_dashboard_and_its_variables() -> None:
    run = json.loads((DASHBOARDS / "training-run.json").read_text())
    assert run["uid"] == RUN_UID
    names = {v["name"] for v in run["templating"]["list"]}
    assert {"datasource", "namespace", "finetunejob"} <= names
    overview = (DASHBOARDS / "jobs-overview.json").read_text()
    for var in re.findall(r"var-(\w+)=", overview):
        assert var in names, var
    for path in sorted(DASHBOARDS.glob("*.json")):
        (link,) = json.loads(path.read_text())["links"]
        assert link["type"] == "dashboards" and link["tags"] == ["kubetune"]
        assert link["keepTime"] and link["includeVars"]


def test_the_training_run_charts_every_dpo_number_train_and_eval() -> None:
    """Reward accuracy and margin of the last step and of the last evaluation, and the
    rewards of chosen and rejected answers: each DPO gauge of the trainer in one panel."""
    from kubetune_trainer.metrics import DPO_GAUGES

    run = json.loads((DASHBOARDS / "training-run.json").read_text())
    charted = {
        target["expr"]: panel for panel in panels(run) for target in panel.get("targets") or []
    }
    for gauge in DPO_GAUGES:
        (panel,) = [p for expr, p in charted.items() if f"kubetune_trainer_{gauge}{{" in expr]
        assert panel["title"].startswith("DPO reward"), (gauge, panel["title"])
    accuracy = next(p for p in panels(run) if p["title"] == "DPO reward accuracy")
    assert accuracy["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert (
        accuracy["fieldConfig"]["defaults"]["min"],
        accuracy["fieldConfig"]["defaults"]["max"],
    ) == (0, 1)
    legends = [t["legendFormat"] for t in accuracy["targets"]]
    assert legends == ["train", "eval"]


def test_annotations_mark_recoveries_and_checkpoints() -> None:
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        queries = {a["name"]: a for a in dashboard["annotations"]["list"] if "expr" in a}
        wanted = {"Recoveries", "Checkpoints"} if path.stem == "training-run" else {"Recoveries"}
        assert set(queries) == wanted, path.stem
        for a in queries.values():
            assert a["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert a["enable"] is True and a["titleFormat"]
            # Windows overlap the step, so a change between two scrapes is never missed.
            assert a["step"] == "1m" and "[2m])" in a["expr"] and a["expr"].endswith(" > 0")
        assert "kubetune_finetunejob_recoveries_total" in queries["Recoveries"]["expr"]
        if "Checkpoints" in queries:
            assert "kubetune_finetunejob_checkpoint_step" in queries["Checkpoints"]["expr"]


def test_every_panel_is_described_in_the_docs() -> None:
    docs = (ROOT / "docs/observability.md").read_text()
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        assert dashboard["title"] in docs
        for panel in panels(dashboard):
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
