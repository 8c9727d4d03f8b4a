"""API models and the CRDs generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kubetune.api.crdgen import render_all
from kubetune.api.v1alpha1 import (
    MESSAGE_LIMIT,
    Condition,
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPool,
    parse_duration,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, sub in (schema.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if "items" in schema:
        out += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _walk(schema["additionalProperties"], f"{path}{{}}")
    return out


def _crd(name: str) -> dict[str, Any]:
    return yaml.safe_load(render_all()[name])


def test_committed_crds_match_models() -> None:
    """Fails when crds/ drifts from kubetune.api.v1alpha1; `make crds` fixes it."""
    for name, text in render_all().items():
        committed = (ROOT / "crds" / name).read_text()
        assert committed == text, f"crds/{name} is stale: run `make crds`"


@pytest.mark.parametrize("name", ["finetunejobs.kubetune.io.yaml", "gpupools.kubetune.io.yaml"])
def test_schema_is_structural(name: str) -> None:
    schema = _crd(name)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            continue
        assert "type" in node, f"{path} has no type"
        if node.get("additionalProperties") is False:
            pytest.fail(f"{path}: additionalProperties false is not structural")
        if node["type"] == "object" and "properties" not in node:
            assert (
                "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
                or path == ".metadata"
            ), path


def test_every_spec_field_documented() -> None:
    """`kubectl explain` shows a description for every knob."""
    for name in ("finetunejobs.kubetune.io.yaml", "gpupools.kubetune.io.yaml"):
        schema = _crd(name)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema["properties"]["spec"], ".spec"):
            if path.endswith("[]") or path.endswith("{}"):
                continue
            assert node.get("description"), f"{name}: {path} lacks a description"


def test_finetunejob_crd_shape() -> None:
    crd = _crd("finetunejobs.kubetune.io.yaml")
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["ftj"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Phase",
        "Model",
        "Method",
        "Pool",
        "GPUs",
        "Progress",
        "Loss",
        "ETA",
        "Cost",
        "Eval-Reward-Acc",
        "Age",
    ]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1]
    assert wide == ["Eval-Reward-Acc"]  # a DPO number: kubectl get -o wide only
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["dataset", "model"]
    assert spec["properties"]["method"]["enum"] == ["auto", "full", "lora", "qlora"]
    assert spec["properties"]["method"]["default"] == "auto"
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("self.method != 'full'" in r for r in rules)
    assert any("duration(self.resources.deadline)" in r for r in rules)
    root_rules = version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert "oldSelf" in root_rules[0]["rule"]
    gpus = spec["properties"]["resources"]["properties"]["gpus"]
    assert gpus["x-kubernetes-int-or-string"] is True
    assert gpus["default"] == "auto"
    budget = spec["properties"]["resources"]["properties"]["maxCostUSD"]
    assert budget["exclusiveMinimum"] is True and budget["minimum"] == 0
    # No default: the apiserver leaves an unset objective unset, so the operator's
    # KUBETUNE_DEFAULT_OBJECTIVE can apply.
    objective = spec["properties"]["resources"]["properties"]["objective"]
    assert "default" not in objective and objective["enum"] == ["cost", "time"]
    # Nested objects default to {} so the apiserver fills their defaults in.
    assert spec["properties"]["training"]["default"] == {}
    assert spec["properties"]["training"]["properties"]["sequenceLength"]["default"] == 2048


def test_gpupool_crd_is_cluster_scoped() -> None:
    crd = _crd("gpupools.kubetune.io.yaml")
    assert crd["spec"]["scope"] == "Cluster"
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["required"]) == {"gpu", "gpusPerNode", "maxNodes", "pricePerGPUHour"}


def _spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"uri": "meta-llama/Llama-3.1-8B"},
        "dataset": {"uri": "pvc://data/train.jsonl"},
    }
    base.update(over)
    return base


def test_defaults_and_aliases_round_trip() -> None:
    spec = FineTuneJobSpec.model_validate(_spec(resources={"maxCostUSD": 50, "gpus": 4}))
    assert spec.method == "auto"
    assert spec.training.sequence_length == 2048
    assert spec.resources.max_cost_usd == 50
    assert spec.resources.gpus == 4
    assert spec.resources.objective is None
    wire = spec.to_wire()
    assert wire["resources"]["maxCostUSD"] == 50
    assert FineTuneJobSpec.model_validate(wire) == spec
    chosen = FineTuneJobSpec.model_validate(_spec(resources={"objective": "time"}))
    assert chosen.resources.objective == "time"
    assert FineTuneJobSpec.model_validate(chosen.to_wire()) == chosen


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"method": "full", "lora": {"rank": 8}}, "spec.lora is set but spec.method is 'full'"),
        ({"resources": {"gpus": 0}}, "greater than or equal to 1"),
        ({"resources": {"gpus": "many"}}, "auto"),
        ({"resources": {"maxCostUSD": 0}}, "greater than 0"),
        ({"resources": {"deadline": "tomorrow"}}, "String should match pattern"),
        ({"training": {"sequenceLenght": 10}}, "Extra inputs are not permitted"),
        ({"method": "dpo"}, "Input should be 'auto', 'full', 'lora' or 'qlora'"),
        ({"resources": {"objective": "fast"}}, "Input should be 'cost' or 'time'"),
        ({"resources": {"gpus": 5000}}, "less than or equal to 4096"),
        ({"trainerImage": " img:1"}, "must not start or end with whitespace"),
        ({"model": {"uri": "x/y", "tokenSecretRef": {"name": "Bad Name"}}}, "should match"),
        ({"checkpoint": {"storage": {"storageClassName": "Bad_Class"}}}, "should match"),
        ({"training": {"maxSteps": 2**63 - 1}}, "less than or equal to 100000000"),
        ({"ttlSecondsAfterFinished": 2**63 - 1}, "less than or equal to 315360000"),
        (
            {"training": {"activationOffloading": True, "gradientCheckpointing": False}},
            "activationOffloading needs gradient checkpointing",
        ),
    ],
)
def test_bad_specs_are_rejected_with_a_reason(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate(_spec(**over))
    assert needle in str(err.value)


def test_uri_pattern_treats_whitespace_like_the_apiserver() -> None:
    """Go's RE2 `\\S` excludes ASCII whitespace only; the model must accept the same URIs."""
    import re

    from kubetune.api.v1alpha1 import URI_PATTERN

    assert re.match(URI_PATTERN, "/data/train\u00a0.jsonl")
    assert not re.match(URI_PATTERN, "/data/train .jsonl")
    FineTuneJobSpec.model_validate(_spec(dataset={"uri": "/data/train\u2003.jsonl"}))


def test_parse_duration() -> None:
    assert parse_duration("1h30m").total_seconds() == 5400
    assert parse_duration("2.5h").total_seconds() == 9000
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("3 days")


def test_examples_validate() -> None:
    jobs = sorted((ROOT / "examples").glob("*.yaml"))
    assert len(jobs) >= 5
    kinds = set()
    for path in jobs:
        for doc in yaml.safe_load_all(path.read_text()):
            kinds.add(doc["kind"])
            model = FineTuneJob if doc["kind"] == "FineTuneJob" else GPUPool
            model.model_validate(doc)
    assert kinds == {"FineTuneJob", "GPUPool"}


def test_example_catalog_matches_builtin() -> None:
    builtin = ROOT / "operator/src/kubetune/planning/data/gpupools.yaml"
    assert (ROOT / "examples/gpupools.yaml").read_text() == builtin.read_text()


def test_no_integer_default_meets_a_fractional_exclusive_bound() -> None:
    """The API server checks an integer-valued default (`0.0` reads as 0) against a bound as
    integers, truncating the bound: `default: 0` under `maximum: 0.5, exclusiveMaximum` reads
    as 0 < 0 and the whole CRD is refused at install."""
    found = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            default = node.get("default")
            for bound, exclusive in (
                ("maximum", "exclusiveMaximum"),
                ("minimum", "exclusiveMinimum"),
            ):
                limit = node.get(bound)
                if (
                    node.get(exclusive)
                    and isinstance(limit, float | int)
                    and not float(limit).is_integer()
                    and isinstance(default, float | int)
                    and float(default).is_integer()
                ):
                    found.append(f"{path}: default {default}, {bound} {limit} (exclusive)")
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    for name, text in render_all().items():
        walk(yaml.safe_load(text), name)
    assert not found, found


def test_status_messages_are_bounded_and_keep_their_fix() -> None:
    """User strings quoted into a message (20,000 target modules, say) never grow a status
    past etcd's limit: a message is cut to MESSAGE_LIMIT in its middle, its "To fix:" kept."""
    long = "spec.lora.targetModules " + ", ".join(f"m{i}" for i in range(20_000))
    status = FineTuneJobStatus(message=f"{long}. To fix: name fewer modules")
    assert status.message is not None and len(status.message) == MESSAGE_LIMIT
    assert status.message.startswith("spec.lora.targetModules m0, m1")
    assert status.message.endswith("To fix: name fewer modules")
    status.conditions = [
        Condition(type="Failed", status="True", reason="InvalidSpec", message=long,
                  last_transition_time="2026-12-02T00:00:00Z"),
    ]  # fmt: skip
    assert len(status.conditions[0].message) == MESSAGE_LIMIT
    short = "short and whole"
    assert FineTuneJobStatus(message=short).message == short


def test_a_spec_too_large_for_its_status_is_refused_by_the_crd_and_the_model() -> None:
    crd = _crd("finetunejobs.kubetune.io.yaml")
    lora = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    modules = lora["properties"]["spec"]["properties"]["lora"]["properties"]["targetModules"]
    assert (modules["maxItems"], modules["items"]["maxLength"]) == (256, 128)
    with pytest.raises(ValidationError, match="at most 256 items"):
        FineTuneJobSpec.model_validate(
            {
                "model": {"uri": "org/m"},
                "dataset": {"uri": "org/d"},
                "lora": {"targetModules": [f"m{i}" for i in range(20_000)]},
            }
        )
