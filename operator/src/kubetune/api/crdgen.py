"""Render the CustomResourceDefinitions from the pydantic models in `kubetune.api.v1alpha1`.

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no `$ref`, no
`additionalProperties: false`, nullable unions flattened. pydantic emits JSON Schema
2020-12, so this module rewrites it. `kubetune crds --out crds/` (`make crds`) writes
`crds/*.yaml`; `tests/unit/test_api_crds.py` fails when the committed files drift.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from kubetune.api.v1alpha1 import (
    FINETUNEJOB_ROOT_RULES,
    FINETUNEJOB_SPEC_RULES,
    GROUP,
    VERSION,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPoolSpec,
    GPUPoolStatus,
)

Schema = dict[str, Any]

_DROP_KEYS = {"title", "additionalProperties", "$defs"}


class _CallFactories(GenerateJsonSchema):
    """Put `default_factory` results into the schema so the apiserver applies them.

    Nested objects default to `{}`: the apiserver then fills their own defaults in, which
    keeps the CRD compact while `kubectl get -o yaml` shows every effective value.
    """

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().default_schema(schema)
        inner = self.generate_inner(schema["schema"])
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            inner["default"] = {}
        elif value:
            inner["default"] = value
        return inner


def _resolve(node: Any, defs: Schema) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        target.update(node)  # field-level description/default win over the model's
        node = target
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = node.pop("allOf")[0]
        node = {**_resolve(inner, defs), **node}
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: Any) -> Any:
    """Rewrite one resolved JSON Schema node into structural OpenAPI v3."""
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if node.get("default", ...) is None:
            node.pop("default")
        if len(branches) == 1:
            node = {**branches[0], **node}
        else:
            raise ValueError(f"cannot express union in a structural schema: {branches}")
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS or k == "additionalProperties"}

    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True

    extra = node.pop("additionalProperties", None)
    if node.get("type") == "object" and "properties" not in node:
        if isinstance(extra, dict) and extra:
            node["additionalProperties"] = _structural(extra)
        else:
            node["x-kubernetes-preserve-unknown-fields"] = True
    if "properties" in node:
        node["type"] = "object"
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        required = node.get("required")
        if required:
            node["required"] = sorted(required)
    if "items" in node:
        node["items"] = _structural(node["items"])
    if node.get("type") == "array" and node.get("uniqueItems"):
        node.pop("uniqueItems")
        node["x-kubernetes-list-type"] = "set"
    return node


def openapi_schema(model: type[BaseModel]) -> Schema:
    raw = model.model_json_schema(by_alias=True, schema_generator=_CallFactories)
    defs = raw.get("$defs", {})
    return dict(_structural(_resolve(raw, defs)))


def _top_level(spec_schema: Schema, status_schema: Schema, spec_required: bool) -> Schema:
    schema: Schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    if spec_required:
        schema["required"] = ["spec"]
    return schema


def _column(name: str, path: str, kind: str = "string", **extra: Any) -> Schema:
    return {"name": name, "jsonPath": path, "type": kind, **extra}


def finetunejob_crd() -> Schema:
    spec = openapi_schema(FineTuneJobSpec)
    spec["x-kubernetes-validations"] = FINETUNEJOB_SPEC_RULES
    status = openapi_schema(FineTuneJobStatus)
    root = _top_level(spec, status, spec_required=True)
    root["x-kubernetes-validations"] = FINETUNEJOB_ROOT_RULES
    return _crd(
        kind="FineTuneJob",
        plural="finetunejobs",
        singular="finetunejob",
        short_names=["ftj"],
        scope="Namespaced",
        schema=root,
        columns=[
            _column("Phase", ".status.phase"),
            _column("Model", ".spec.model.uri", priority=0),
            _column("Method", ".status.plan.method"),
            _column("Pool", ".status.plan.pool"),
            _column("GPUs", ".status.plan.totalGPUs", "integer"),
            _column("Progress", ".status.progress.summary"),
            _column("Loss", ".status.progress.loss", "number"),
            _column("ETA", ".status.progress.eta"),
            _column("Cost", ".status.cost.accruedUSD", "number", description="USD accrued"),
            _column(
                "Eval-Reward-Acc",
                ".status.progress.evalDpoRewardAccuracy",
                "number",
                priority=1,
                description="DPO jobs: held-out reward accuracy (kubectl get -o wide)",
            ),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def gpupool_crd() -> Schema:
    root = _top_level(openapi_schema(GPUPoolSpec), openapi_schema(GPUPoolStatus), True)
    return _crd(
        kind="GPUPool",
        plural="gpupools",
        singular="gpupool",
        short_names=["gpool"],
        scope="Cluster",
        schema=root,
        columns=[
            _column("GPU", ".spec.gpu.product"),
            _column("Mem(GiB)", ".status.gpuMemoryGiB", "number"),
            _column("GPUs/Node", ".spec.gpusPerNode", "integer"),
            _column("$/GPU-h", ".spec.pricePerGPUHour", "number"),
            _column("Spot", ".spec.spot", "boolean"),
            _column("Nodes", ".status.nodes", "integer"),
            _column("Free", ".status.freeGPUs", "integer"),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: list[str],
    scope: str,
    schema: Schema,
    columns: list[Schema],
) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
                "categories": ["kubetune"],
            },
            "scope": scope,
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def render_all() -> dict[str, str]:
    """File name → YAML text for every CRD."""
    header = "# Generated by `make crds` from kubetune.api.v1alpha1. Do not edit.\n"
    out: dict[str, str] = {}
    for crd in (finetunejob_crd(), gpupool_crd()):
        name = f"{crd['metadata']['name']}.yaml"
        out[name] = header + yaml.safe_dump(crd, sort_keys=False, width=100, allow_unicode=True)
    return out
