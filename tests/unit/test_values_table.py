"""The chart README's values table is generated from values.yaml's comments (hack/values_table.py).

`make docs` rewrites the table; these tests fail when the README is stale, when a value has
no `# --` description, and pin down how the generator reads comments.
"""

from __future__ import annotations

import json
import textwrap
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


# --------------------------------------------------------------------------- the generator

SAMPLE = """\
# A header comment describes nothing.

# -- The chart's name.
name: demo
nested:
  deeper:
    # -- (number) Seconds between looks; may be fractional,
    # so the type is number though the default is whole.
    seconds: 5
    # -- Whether it runs | or not.
    enabled: true
  # -- Items, one row for the whole list.
  items:
    - name: a
      size: 1
    - name: b
      size: 2
  # -- A mapping with its own comment is one row.
  # @default -- the release's labels
  labels:
    app: demo
    tier: web
undocumented: {}
# -- A ratio <1 of `<the budget>`.
ratio: 0.5
"""


def test_rows_of_nested_keys_lists_and_multiline_comments() -> None:
    table, errors = vt.rows(SAMPLE)
    assert [(r.key, r.type, r.default, r.description) for r in table] == [
        ("name", "string", '`"demo"`', "The chart's name."),
        (
            "nested.deeper.seconds",
            "number",
            "`5`",
            "Seconds between looks; may be fractional, so the type is number though the "
            "default is whole.",
        ),
        ("nested.deeper.enabled", "bool", "`true`", "Whether it runs | or not."),
        (
            "nested.items",
            "list",
            '`[{"name":"a","size":1},{"name":"b","size":2}]`',
            "Items, one row for the whole list.",
        ),
        (
            "nested.labels",
            "object",
            "the release's labels",
            "A mapping with its own comment is one row.",
        ),
        ("undocumented", "object", "`{}`", ""),
        ("ratio", "number", "`0.5`", "A ratio <1 of `<the budget>`."),
    ]
    assert errors == ["undocumented has no description (a `# -- ...` comment above it)"]
    markdown = vt.markdown(table)
    assert markdown.splitlines()[:2] == [
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    assert "| `nested.deeper.enabled` | bool | `true` | Whether it runs \\| or not. |" in markdown
    assert "| A ratio &lt;1 of `<the budget>`. |" in markdown


def test_comments_that_describe_nothing_are_errors() -> None:
    text = textwrap.dedent("""\
        # -- Separated from its key by a blank line.

        # -- The pod's security context, one row.
        podSecurityContext:
          # -- Hidden inside a documented mapping.
          runAsNonRoot: true
        pools:
          # -- Inside a list's items.
          - name: a
        """)
    _, errors = vt.rows(text)
    assert errors == [
        "line 1: `# --` comment is not directly above a key",
        "line 8: `# --` comment is not directly above a key",
        "pools has no description (a `# -- ...` comment above it)",
        "line 5: the comment of podSecurityContext.runAsNonRoot is unused "
        "(podSecurityContext is one row)",
    ]


def test_write_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(SAMPLE.replace("undocumented: {}", "# -- Now documented.\nundocumented: {}"))
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# Chart\n\n## Values\n\nProse.\n\n{vt.START}\n| old |\n{vt.END}\n\n## After\n"
    )

    assert vt.main(["--values", str(values), "--check", str(readme)]) == 1
    assert "run `make docs`" in capsys.readouterr().err
    assert vt.main(["--values", str(values), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Chart\n\n## Values\n\nProse.\n\n" + vt.START + "\n| key |")
    assert text.endswith(
        f"| `ratio` | number | `0.5` | A ratio &lt;1 of `<the budget>`. |\n{vt.END}\n\n## After\n"
    )
    assert vt.main(["--values", str(values), "--check", str(readme)]) == 0

    values.write_text(SAMPLE)  # an undocumented value fails, and nothing is written
    assert vt.main(["--values", str(values), "--write", str(readme)]) == 1
    assert "undocumented has no description" in capsys.readouterr().err
    assert readme.read_text() == text

    readme.write_text("# Chart without markers\n")
    values.write_text("# -- Documented.\nname: demo\n")
    assert vt.main(["--values", str(values), "--check", str(readme)]) == 1
    assert "no <!-- values-table:start -->" in capsys.readouterr().err
