"""The operator's table of environment variables (controller/settings/table.py) is the one
source of them: docs/configuration.md's table is rendered from it (hack/settings_table.py,
`make docs`), the chart's Deployment sets each variable from the values the table names, and
the operator reads its environment nowhere else."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune.controller.settings import SETTINGS, metrics_port_from_env, settings_from_env
from kubetune.controller.settings.table import GROUPS
from support.scripts import load_script

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"
PAGE = ROOT / "docs/configuration.md"

st = load_script("hack/settings_table.py")
vt = load_script("hack/values_table.py")


def test_the_docs_table_is_the_generated_one() -> None:
    page = PAGE.read_text()
    assert st.replace_table(page, st.markdown()) == page, (
        "docs/configuration.md's settings table is out of date: run `make docs`"
    )


def test_each_variable_sets_one_field_of_a_settings_class() -> None:
    envs = [s.env for s in SETTINGS]
    assert len(set(envs)) == len(envs), "a variable is in the table twice"
    fields = [s.field for s in SETTINGS]
    assert len(set(fields)) == len(fields), "two variables set one field"
    for index, s in enumerate(SETTINGS):
        assert s.env.startswith("KUBETUNE_") and s.group in GROUPS, s
        s.field_default()  # the field exists and has a default
        assert s.help and st.default_text(s)
        if s.default_from:
            earlier = {e.env for e in SETTINGS[:index] if e.group == s.group}
            assert s.default_from in earlier, f"{s.env}: {s.default_from} is not read before it"


def test_an_unset_variable_gives_its_fields_own_default() -> None:
    for s in SETTINGS:
        if s.default_from or s.field in {"build.operator_namespace", "leader.lease_namespace"}:
            continue  # defaults from other variables, below
        assert s.parse({}, s.env, s.field_default()) == s.field_default(), s.env
        assert s.parse({s.env: ""}, s.env, s.field_default()) == s.field_default(), s.env
    build = settings_from_env({}).build
    assert build.cache_max_bytes == int(200 * 2**30 * 0.9)
    assert settings_from_env({"KUBETUNE_CACHE_SIZE": "10Gi"}).build.cache_max_bytes == int(
        10 * 2**30 * 0.9
    )


def test_the_metrics_port() -> None:
    assert metrics_port_from_env({}) == 8000
    assert metrics_port_from_env({"KUBETUNE_METRICS_PORT": "-1"}) == -1
    with pytest.raises(ValueError, match=r"KUBETUNE_METRICS_PORT='http' .*; to fix: set"):
        metrics_port_from_env({"KUBETUNE_METRICS_PORT": "http"})


# --------------------------------------------------------------------------- the chart


def _chart_env() -> dict[str, str]:
    """Each variable the Deployment sets, with the template text its value comes from: its
    line, and the helpers and template variables that line uses, expanded."""
    template = (CHART / "templates/deployment.yaml").read_text()
    helpers = (CHART / "templates/_helpers.tpl").read_text()
    defines = {
        chunk.split('"', 1)[0]: chunk for chunk in helpers.split('define "')[1:]
    }  # each define's text up to the next one
    variables = dict(re.findall(r"\$(\w+) := (.*?)}}", template))
    env = dict(re.findall(r"- name: (KUBETUNE_\w+)\n\s+value: (.*)", template))
    for name, text in env.items():
        for _ in range(3):
            text += "".join(defines[d] for d in re.findall(r'include "([^"]+)"', text))
            text += "".join(variables[v] for v in re.findall(r"\$(\w+)", text) if v in variables)
        env[name] = text
    return env


def _has_value(values: dict[str, Any], path: str) -> bool:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_the_chart_sets_each_variable_from_the_values_the_table_names() -> None:
    chart_env = _chart_env()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for s in SETTINGS:
        if not (s.values or s.chart):
            assert s.env not in chart_env, f"the chart sets {s.env}; the table says it does not"
            continue
        assert s.env in chart_env, f"the table says the chart sets {s.env}; it does not"
        for value in s.values:
            assert _has_value(values, value), f"{s.env}: values.yaml has no {value}"
            assert f".Values.{value}" in chart_env[s.env], f"{s.env} is not set from {value}"
            assert f"`{value}`" in st.helm_text(s), f"{s.env}: the docs do not name {value}"


def test_the_chart_sets_no_variable_the_table_lacks() -> None:
    assert set(_chart_env()) <= {s.env for s in SETTINGS}


def test_values_that_name_a_variable_are_the_ones_that_set_it() -> None:
    """values.yaml's comments say which variable a value becomes (the chart README shows
    them): the table agrees."""
    table, _ = vt.rows((CHART / "values.yaml").read_text())
    by_env = {s.env: s for s in SETTINGS}
    named = 0
    for row in table:
        for env in re.findall(r"KUBETUNE_[A-Z_]+", row.description):
            assert row.key in by_env[env].values, (
                f"{row.key}'s comment names {env}, which the table sets from {by_env[env].values}"
            )
            named += 1
    assert named >= 40


# --------------------------------------------------------------------------- the operator


def test_the_operator_reads_its_environment_only_through_the_table() -> None:
    """Every variable is in the table (and so in the docs): nothing else reads the
    environment, but for the pod's own name and namespace (the Lease's identity)."""
    src = ROOT / "operator/src/kubetune"
    allowed = {src / "controller/settings/__init__.py", src / "controller/leader.py"}
    readers = [
        path.relative_to(src)
        for path in src.rglob("*.py")
        if path not in allowed and re.search(r"os\.environ|getenv\(", path.read_text())
    ]
    assert readers == []
