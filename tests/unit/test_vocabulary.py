"""One vocabulary: the CRDs, the metrics and the code name every closed set the same way.

The sets are defined once (kubetune.api.vocabulary, kubetune_trainer.contract). These tests
compare each place that shows them — the committed CRDs, the operator's metric label
values — with that definition, and scan the source for a second definition.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import (
    TERMINAL_PHASES,
    ConditionType,
    Phase,
    PlanReason,
    QueueWait,
    Reason,
    RecoveryReason,
)
from kubetune.controller.metrics import OperatorMetrics
from kubetune_trainer.contract import (
    DATASET_FORMATS,
    METHODS,
    OPTIMIZERS,
    PRECISIONS,
    SHARDINGS,
)
from support.statuses import plan

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "operator/src/kubetune", ROOT / "trainer_image/src/kubetune_trainer"]
DEFINED_IN = {
    "kubetune_trainer/contract.py": (METHODS, PRECISIONS, OPTIMIZERS, SHARDINGS, DATASET_FORMATS),
    "kubetune/api/vocabulary.py": (
        tuple(Phase),
        tuple(ConditionType),
        tuple(Reason),
        tuple(RecoveryReason),
        tuple(PlanReason),
        tuple(QueueWait),
    ),
}


OTHER_SETS = {
    # Other sets that share words with one of ours, each named with why it is another set.
    ("kubetune/planning/estimator.py", "BaseDtype"): "BaseDtype: dtypes of frozen base weights",
    ("kubetune/control/pods.py", "PodPhase"): "Kubernetes' own pod phases",
}


def _crd(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / f"{name}.kubetune.io.yaml").read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"])


def _at(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    node: dict[str, Any] = schema
    for key in path:
        node = node["items"] if key == "[]" else node["properties"][key]
    return node


@pytest.mark.parametrize(
    ("path", "values"),
    [
        (("status", "phase"), tuple(Phase)),
        (("status", "plan", "reason"), tuple(PlanReason)),
        (("status", "recoveries", "[]", "reason"), tuple(RecoveryReason)),
        (("status", "queue", "waitingFor"), tuple(QueueWait)),
        (("spec", "method"), ("auto", *METHODS)),
        (("status", "plan", "method"), METHODS),
        (("status", "plan", "sharding"), SHARDINGS),
        (("spec", "training", "precision"), PRECISIONS),
        (("status", "plan", "precision"), PRECISIONS),
        (("spec", "training", "optimizer"), OPTIMIZERS),
        (("spec", "dataset", "format"), DATASET_FORMATS),
    ],
    ids=lambda v: ".".join(v) if isinstance(v[0], str) and "." not in v[0] else None,
)
def test_crd_enums_are_the_vocabulary(path: tuple[str, ...], values: tuple[str, ...]) -> None:
    schema = {"properties": _crd("finetunejobs")}
    assert _at(schema, *path)["enum"] == list(values)


def _label_values(m: OperatorMetrics, family: str, label: str) -> set[str]:
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    return {
        sample.labels[label]
        for fam in text_string_to_metric_families(text)
        for sample in fam.samples
        if fam.name == family and sample.name in (family, f"{family}_total")
    }


def test_metric_label_values_are_the_vocabulary_and_exist_from_the_start() -> None:
    m = OperatorMetrics(runtime=False)
    assert _label_values(m, "kubetune_finetunejobs", "phase") == set(Phase)
    assert _label_values(m, "kubetune_recoveries", "reason") == set(RecoveryReason)
    assert _label_values(m, "kubetune_finetunejobs_finished", "phase") == set(TERMINAL_PHASES)


def test_plan_reasons_stay_a_closed_label_set_whatever_the_details() -> None:
    """Re-plans name pods, pools and seconds in their message; the `reason` label of
    kubetune_plans_total takes only the closed set, however many re-plans happen."""
    m = OperatorMetrics(runtime=False)
    meta = {"namespace": "ns", "name": "j", "creationTimestamp": "2026-01-01T00:00:00Z"}
    before: dict[str, Any] = {}
    for revision in range(1, 40):
        reason = list(PlanReason)[revision % len(PlanReason)]
        after = FineTuneJobStatus.model_validate(
            {
                "plan": plan(
                    revision=revision,
                    reason=reason,
                    message=f"pod p-{revision} waited {revision * 7}s",
                )
            }
        ).to_wire()
        m.observe_job({"metadata": meta, "spec": {}, "status": before}, after)
        before = after
    assert _label_values(m, "kubetune_plans", "reason") == set(PlanReason)


def test_plan_reasons_written_as_text_by_earlier_versions_are_read() -> None:
    legacy = plan(revision=2, reason="OutOfMemory: lora 1×l40s micro-batch 4 ran out of memory")
    status = FineTuneJobStatus.model_validate({"plan": legacy})
    assert status.plan is not None
    assert status.plan.reason == PlanReason.OUT_OF_MEMORY
    assert status.plan.message == "lora 1×l40s micro-batch 4 ran out of memory"
    recovery = {"reason": "Preemption", "time": "2026-01-01T00:00:00Z", "message": "pod p-0 x"}
    old = FineTuneJobStatus.model_validate({"recoveries": [recovery]})
    assert old.recoveries[0].pod == "p-0"


# ---------------------------------------------------------------------- defined once


def _literal(node: ast.AST) -> set[str] | None:
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Literal"
    ):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return None


def _string_sets(tree: ast.Module) -> Iterator[tuple[str, set[str]]]:
    """Every `Literal[...]`, Enum class body and module-level tuple, list or set of strings
    in a module, named by what it is assigned to (or by its line)."""
    named: dict[int, str] = {}
    for stmt in tree.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        value = getattr(stmt, "value", None)
        if not isinstance(target, ast.Name) or value is None:
            continue
        named[id(value)] = target.id
        if isinstance(value, ast.Tuple | ast.List | ast.Set):
            yield (
                target.id,
                {
                    e.value
                    for e in value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                },
            )
    for node in ast.walk(tree):
        strings = _literal(node)
        if strings is not None:
            yield named.get(id(node), f"Literal at line {getattr(node, 'lineno', 0)}"), strings
        elif isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in ("StrEnum", "Enum") for b in node.bases
        ):
            yield (
                node.name,
                {
                    stmt.value.value
                    for stmt in node.body
                    if isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                },
            )


def _python_files() -> Iterable[tuple[str, Path]]:
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            yield str(path.relative_to(base.parent)), path


def test_no_closed_set_is_defined_twice() -> None:
    second: list[str] = []
    for rel, path in _python_files():
        for where, strings in _string_sets(ast.parse(path.read_text())):
            if (rel, where) in OTHER_SETS:
                continue
            for home, sets in DEFINED_IN.items():
                if rel == home:
                    continue
                for values in sets:
                    if len(strings & set(values)) >= 2:
                        shared = sorted(strings & set(values))
                        second.append(f"{rel} ({where}) repeats {shared}")
    assert not second, "\n".join(second)


def test_the_scan_finds_a_second_definition() -> None:
    """The scan above would catch the copies it exists to prevent."""
    copy = "\n".join(
        [
            'Phase = Literal["Pending", "Running"]',
            "class M(StrEnum):",
            '    A = "lora"',
            '    B = "full"',
            'REASONS = ("OOM", "Preemption", "NodeLost")',
            'def f(x: Literal["qlora", "full"]) -> None: ...',
        ]
    )
    found = dict(_string_sets(ast.parse(copy)))
    assert found["Phase"] == {"Pending", "Running"}
    assert found["M"] == {"lora", "full"}
    assert found["REASONS"] == {"OOM", "Preemption", "NodeLost"}
    assert {"qlora", "full"} in found.values()


# ---------------------------------------------------------------------- label and annotation keys

_KEY = re.compile(
    r"^(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?\.)+[a-z]{2,}/[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""A prefixed Kubernetes key: `kubetune.io/job`, `batch.kubernetes.io/job-completion-index`."""
_API_VERSION = re.compile(r"/v[0-9]+(?:(?:alpha|beta)[0-9]+)?$")
VOCABULARY = "kubetune/api/vocabulary.py"


def _keys(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every string constant of a module that is a prefixed label, annotation or resource key,
    docstrings aside (an API version such as `kubetune.io/v1alpha1` is no key)."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _KEY.match(node.value)
            and not _API_VERSION.search(node.value)
        ):
            yield node.lineno, node.value


def test_label_and_annotation_keys_are_spelled_only_in_the_vocabulary() -> None:
    """A key spelled twice drifts: a selector that no longer matches what the builders
    label finds nothing, and nothing fails."""
    spelled = [
        f"{rel}:{line} spells {key!r}; name it from {VOCABULARY}"
        for rel, path in _python_files()
        if rel != VOCABULARY
        for line, key in _keys(ast.parse(path.read_text()))
    ]
    assert not spelled, "\n".join(spelled)


def test_the_vocabulary_spells_each_key_once() -> None:
    keys = [key for _, key in _keys(ast.parse((SOURCES[0].parent / VOCABULARY).read_text()))]
    assert {"kubetune.io/job", "batch.kubernetes.io/job-completion-index"} <= set(keys)
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_the_key_scan_finds_a_second_spelling() -> None:
    copy = "\n".join(
        [
            '"""Selects kubetune.io/job."""',
            'LABEL = "kubetune.io/job"',
            'meta = {"labels": {"app.kubernetes.io/name": "x"}}',
            'API = "kubetune.io/v1alpha1"',
            'why = f"see kubetune.io/job"',
        ]
    )
    assert [key for _, key in _keys(ast.parse(copy))] == [
        "kubetune.io/job",
        "app.kubernetes.io/name",
    ]


def test_dashboards_and_alerts_query_only_words_of_the_vocabulary() -> None:
    """A phase or reason spelled in PromQL that the operator never writes would be a panel
    or an alert that can never fire."""
    texts = [p.read_text() for p in sorted((ROOT / "charts/kubetune/dashboards").glob("*.json"))]
    texts.append((ROOT / "charts/kubetune/templates/prometheusrule.yaml").read_text())
    texts.append((ROOT / "hack/gen_dashboards.py").read_text())
    phases = {m for t in texts for m in re.findall(r'phase\s*=~?\s*\\?"(\w+)', t)}
    reasons = {m for t in texts for m in re.findall(r'reason\s*=~?\s*\\?"(\w+)', t)}
    assert phases, "the dashboards query phases"
    assert phases <= set(Phase), phases - set(Phase)
    assert reasons <= set(RecoveryReason) | set(PlanReason), reasons
