"""How hack/values_table.py, the generator of the chart README's values table, reads
values.yaml's comments, writes the table and checks it (`make docs`; the chart's own table is
checked by tests/unit/test_values_table.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support.scripts import load_script

pytestmark = pytest.mark.tooling

vt = load_script("hack/values_table.py")

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
