"""The pure parts of benchmarks/apiserver_write_cost.py: the CRD variants and the table."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from benchmarks import apiserver_write_cost as bench
from kubetune.api.crdgen import render_all

pytestmark = pytest.mark.tooling


def _rules(node: object) -> int:
    if isinstance(node, dict):
        return ("x-kubernetes-validations" in node) + sum(_rules(v) for v in node.values())
    if isinstance(node, list):
        return sum(_rules(v) for v in node)
    return 0


def _status_schema(docs: list[dict], kind: str) -> dict:
    doc = next(d for d in docs if d["spec"]["names"]["kind"] == kind)
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def test_variants_drop_the_rules_then_open_the_jobs_status_and_leave_the_crds_alone() -> None:
    docs = [yaml.safe_load(text) for text in render_all().values()]
    shipped = copy.deepcopy(docs)
    variants = dict(bench.crd_variants(docs))
    assert list(variants) == ["as shipped", "no CEL rules", "no CEL rules, status open"]
    assert variants["as shipped"] == shipped and docs == shipped  # nothing changed in place
    assert _rules(shipped) > 0
    assert _rules(variants["no CEL rules"]) == 0
    assert _status_schema(variants["no CEL rules"], "FineTuneJob") == _status_schema(
        shipped, "FineTuneJob"
    )
    opened = variants["no CEL rules, status open"]
    assert _rules(opened) == 0
    assert _status_schema(opened, "FineTuneJob") == {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    # GPUPools keep their status schema: only the job's writes are in question.
    assert _status_schema(opened, "GPUPool") == _status_schema(shipped, "GPUPool")


def test_table_has_a_row_per_measurement_and_no_wall_time_for_the_background() -> None:
    rows = [
        bench.Row("as shipped", "–", "none: background, per second", 0, 0, math.nan, 41.5, 9.0),
        bench.Row(
            "as shipped", "as written", "FineTuneJob status PATCH", 5599, 300, 19.94, 25.04, 2.3
        ),
    ]
    lines = bench.table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| as shipped | – | none: background, per second | – | – | – | 41.5 | 9.0 |"
    assert lines[3] == (
        "| as shipped | as written | FineTuneJob status PATCH | 5599 | 300 | 19.9 | 25.0 | 2.3 |"
    )


def test_an_event_about_the_job_is_a_new_object_named_by_the_api_server() -> None:
    job = {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1"},
    }
    at = bench.dt.datetime(2026, 11, 30, 1, 2, 3, tzinfo=bench.dt.UTC)
    first, second = bench.job_event(job, 1, at), bench.job_event(job, 2, at)
    assert first["metadata"] == {"namespace": "team-a", "generateName": "kopf-event-"}
    assert first["involvedObject"] == {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "name": "demo",
        "namespace": "team-a",
        "uid": "u-1",
    }
    assert first["firstTimestamp"] == first["lastTimestamp"] == "2026-11-30T01:02:03Z"
    assert first["message"] != second["message"]  # every POST a new Event, not a repeat
