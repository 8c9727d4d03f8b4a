"""The chart's values table, generated from the comments in charts/kubetune/values.yaml.

    python hack/values_table.py                    # print the table
    python hack/values_table.py --write README.md  # replace the table in that README
    python hack/values_table.py --check README.md  # exit 1 when that README's table is stale

`make docs` writes charts/kubetune/README.md; tests/unit/test_values_table.py fails when it
is stale or when a value has no description.

The comments follow helm-docs: `# -- text` right above a key describes it, and the comment
lines after it (up to the key) continue the text. `# -- (number) text` sets the type column
where the value alone would say otherwise (a whole-number default of a value that may be
fractional); `# @default -- text` in the block replaces the default column. A mapping with
its own `# --` comment is one row; a mapping without one is described key by key. Lists and
empty mappings are single rows. Every row needs a description: a value without one, or a
`# --` comment that belongs to no row, is an error.

The README holds the table between the START and END markers; nothing else in it changes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "charts/kubetune/values.yaml"
README = ROOT / "charts/kubetune/README.md"
START = "<!-- values-table:start -->"
END = "<!-- values-table:end -->"
STALE = "run `make docs`"

_KEY = re.compile(r"(?P<key>\"[^\"]*\"|'[^']*'|[^\s#'\"\-][^:#]*?)\s*:(?:\s|$)")
_TYPE = re.compile(r"\((?P<type>[a-z]+)\)\s*")

Path_ = tuple[str, ...]


@dataclass
class Doc:
    """A `# --` comment block and the key it sits above."""

    line: int
    text: list[str]
    default: str | None = None


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str


def _lookup(data: Any, path: Path_) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def comments(text: str, data: Any) -> tuple[dict[Path_, Doc], list[str]]:
    """The `# --` comment of each key (by path), and the comments that sit above no key.

    Lines are read one by one: the indentation of a key line says which mapping it is in.
    The lines under a key whose value is not a mapping (a list's items, a block scalar)
    belong to that value and are skipped.
    """
    docs: dict[Path_, Doc] = {}
    errors: list[str] = []
    stack: list[tuple[int, str]] = []
    block: Doc | None = None
    skip: int | None = None

    def orphan() -> None:
        nonlocal block
        if block is not None:
            errors.append(f"line {block.line}: `# --` comment is not directly above a key")
        block = None

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if not stripped or stripped == "---":
            orphan()
            continue
        if stripped.startswith("#"):
            body = stripped[1:].removeprefix(" ")
            if body.startswith("-- ") or body == "--":
                orphan()
                block = Doc(number, [body[3:].strip()])
            elif body.startswith("@default -- ") and block is not None:
                block.default = body.removeprefix("@default -- ").strip()
            elif block is not None:
                block.text.append(body.strip())
            continue
        if skip is not None and (indent > skip or (indent == skip and stripped[0] == "-")):
            orphan()
            continue
        skip = None
        match = _KEY.match(stripped)
        if match is None:
            orphan()
            continue
        key = match["key"]
        if key[0] in "'\"":
            key = key[1:-1]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        path = tuple(k for _, k in stack)
        if block is not None:
            docs[path] = block
            block = None
        if not isinstance(_lookup(data, path), dict):
            skip = indent
    orphan()
    return docs, errors


def type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    if value is None:
        return "null"
    return "string"


def _cell(text: str) -> str:
    """Text for a table cell: `|` escaped, and `<` outside code spans, which Markdown would
    take for the start of an HTML tag (`<name>` would vanish)."""
    parts = text.replace("|", "\\|").split("`")
    parts[::2] = [part.replace("<", "&lt;") for part in parts[::2]]
    return "`".join(parts)


def rows(text: str) -> tuple[list[Row], list[str]]:
    """The table's rows in values.yaml's order, and what keeps the table from being complete."""
    data = yaml.safe_load(text) or {}
    docs, errors = comments(text, data)
    table: list[Row] = []
    used: set[Path_] = set()

    def walk(value: dict[Any, Any], path: Path_) -> None:
        for key, sub in value.items():
            here = (*path, str(key))
            dotted = ".".join(here)
            doc = docs.get(here)
            if isinstance(sub, dict) and sub and doc is None:
                walk(sub, here)
                continue
            description = " ".join(t for t in doc.text if t) if doc else ""
            kind = type_of(sub)
            if typed := _TYPE.match(description):
                kind, description = typed["type"], description[typed.end() :]
            if doc is None or not description:
                errors.append(f"{dotted} has no description (a `# -- ...` comment above it)")
            if doc is not None and doc.default is not None:
                default = doc.default
            else:
                compact = json.dumps(sub, separators=(",", ":"), ensure_ascii=False, default=str)
                default = f"`{compact}`"
            used.add(here)
            table.append(Row(dotted, kind, default, description))

    if isinstance(data, dict):
        walk(data, ())
    for path, doc in sorted(docs.items(), key=lambda item: item[1].line):
        if path not in used:
            parent = next(
                (".".join(path[:n]) for n in range(1, len(path)) if path[:n] in used), None
            )
            where = f"{parent} is one row" if parent else "no such value"
            errors.append(f"line {doc.line}: the comment of {'.'.join(path)} is unused ({where})")
    return table, errors


def markdown(table: list[Row]) -> str:
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    lines += [
        f"| `{r.key}` | {r.type} | {_cell(r.default)} | {_cell(r.description)} |" for r in table
    ]
    return "\n".join(lines) + "\n"


def replace_table(readme: str, table: str) -> str:
    """The README with the text between the markers replaced by the table."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {START} ... {END} markers")
    return readme[: start + len(START)] + "\n" + table + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=Path, default=VALUES, help="default: %(default)s")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="replace its table")
    action.add_argument("--check", type=Path, metavar="README", help="exit 1 when it is stale")
    args = parser.parse_args(argv)

    table, errors = rows(args.values.read_text())
    if errors:
        print(f"{args.values}: the values table is incomplete:", file=sys.stderr)
        for error in errors:
            print(f"  {error}", file=sys.stderr)
        return 1
    text = markdown(table)
    target: Path | None = args.write or args.check
    if target is None:
        sys.stdout.write(text)
        return 0
    current = target.read_text()
    try:
        wanted = replace_table(current, text)
    except ValueError as err:
        print(f"{target}: {err}", file=sys.stderr)
        return 1
    if args.check:
        if wanted == current:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            f"{target} (committed)",
            f"{target} (from {args.values.name})",
        )
        sys.stderr.writelines(diff)
        print(f"{target}: the values table is out of date: {STALE}", file=sys.stderr)
        return 1
    if wanted != current:
        target.write_text(wanted)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
