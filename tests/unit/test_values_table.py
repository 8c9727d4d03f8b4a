"""The chart README's values table is generated from values.yaml's comments (hack/values_table.py).

`make docs` rewrites the table; these tests fail when the README is stale or a value has no
`# --` description. How the generator reads comments: tests/tooling/test_values_table_script.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.scripts import load_script

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kubetune"


vt = load_script("hack/values_table.py")


def _leaves(value: Any, path: str = "") -> Iterator[str]:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _leaves(sub, f"{path}.{key}" if path else str(key))
    else:
        yield path


# --------------------------------------------------------------------------- the chart


def test_every_value_is_documented() -> None:
    _, errors = vt.rows((CHART / "values.yaml").read_text())
    assert not errors, "values.yaml:\n  " + "\n  ".join(errors)


def test_readme_table_is_the_generated_one() -> None:
    table, _ = vt.rows((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    assert vt.replace_table(readme, vt.markdown(table)) == readme, (
        "charts/kubetune/README.md's values table is out of date with values.yaml: run `make docs`"
    )


def test_every_leaf_value_has_a_row() -> None:
    """Each leaf is a row, or inside a mapping documented as one row (podSecurityContext)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table, _ = vt.rows((CHART / "values.yaml").read_text())
    keys = {row.key for row in table}
    readme = (CHART / "README.md").read_text()
    for leaf in _leaves(values):
        parts = leaf.split(".")
        covering = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        assert keys & set(covering), f"{leaf} has no row"
    for key in keys:
        assert f"| `{key}` |" in readme, f"README.md's values table lacks {key}: run `make docs`"


def test_row_types_agree_with_the_schema() -> None:
    """A whole-number default of a value the schema lets be fractional says `(number)`."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    table, _ = vt.rows((CHART / "values.yaml").read_text())
    names = {"string": "string", "int": "integer", "number": "number", "bool": "boolean"}
    names |= {"list": "array", "object": "object"}
    for row in table:
        node = schema
        for part in row.key.split("."):
            node = node["properties"][part]
        if "type" in node:
            assert names[row.type] == node["type"], (
                f"{row.key} is {row.type} in the table and {node['type']} in values.schema.json"
                + (": start its comment with `# -- (number)`" if node["type"] == "number" else "")
            )
