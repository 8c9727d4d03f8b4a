"""docs/configuration.md's table of environment variables, rendered from the operator's own
table of them (`kubetune.controller.settings.SETTINGS`).

    python hack/settings_table.py                                # print the table
    python hack/settings_table.py --write docs/configuration.md  # replace the table there
    python hack/settings_table.py --check docs/configuration.md  # exit 1 when it is stale

`make docs` writes docs/configuration.md; tests/unit/test_settings_table.py fails when it is
stale, and when the chart's Deployment does not set a variable from the values the table
names. The page holds the table between the START and END markers; nothing else in it
changes.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

from kubetune.controller.settings import SETTINGS, Setting

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs/configuration.md"
START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"
STALE = "run `make docs`"


def default_text(setting: Setting) -> str:
    """The default column: the row's own words, else the field's default as it is."""
    if setting.default:
        return setting.default
    value = setting.field_default()
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int | float):
        return f"`{value:g}`"
    if isinstance(value, str) and value:
        return f"`{value}`"
    raise ValueError(f"{setting.env}: say its default {value!r} in words (Setting.default)")


def helm_text(setting: Setting) -> str:
    """The Helm column: how the chart sets the variable, or a dash where it does not."""
    if setting.chart:
        return setting.chart
    return ", ".join(f"`{value}`" for value in setting.values) or "—"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(settings: Sequence[Setting] = SETTINGS) -> str:
    lines = [
        "| variable | default | Helm value | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for s in settings:
        cells = (f"`{s.env}`", default_text(s), helm_text(s), s.help)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def replace_table(page: str, table: str) -> str:
    """The page with the text between the markers replaced by the table."""
    start, end = page.find(START), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {START} ... {END} markers")
    return page[: start + len(START)] + "\n" + table + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="PAGE", help="replace its table")
    action.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 when it is stale")
    args = parser.parse_args(argv)

    table = markdown()
    if args.write is None and args.check is None:
        sys.stdout.write(table)
        return 0
    path: Path = args.write or args.check
    page = path.read_text()
    try:
        new = replace_table(page, table)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if args.check is not None:
        if new != page:
            diff = difflib.unified_diff(
                page.splitlines(), new.splitlines(), str(path), "generated", lineterm=""
            )
            print("\n".join(diff), file=sys.stderr)
            print(f"{path}'s settings table is out of date: {STALE}", file=sys.stderr)
            return 1
        return 0
    if new != page:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
