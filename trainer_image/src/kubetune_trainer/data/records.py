"""Reading a dataset into records: JSONL, JSON, Parquet and text files (a file or a folder of
them), or a hub dataset's train split. Each record keeps where it came from, so that an error
can point at the file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import DATA_SUFFIXES
from kubetune_trainer.errors import ConfigError, DataError, TrainerExit
from kubetune_trainer.hub import hub_call

HUB_TOKEN_ENV = "HF_TOKEN"
"""The hub client reads its token from here; a hub dataset is read with it."""


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from, so errors can point at it."""

    where: str  # "train.jsonl:17" or "data.parquet row 3"
    value: Any


def _hidden(path: Path, source: Path) -> bool:
    """A dot-file or dot-folder inside the dataset folder (`.git/`, a cache's bookkeeping such
    as the stage-in's `.kubetune-entry.json`): never data."""
    return any(part.startswith(".") for part in path.relative_to(source).parts)


def _files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(
            p
            for p in source.rglob("*")
            if p.is_file() and p.suffix in DATA_SUFFIXES and not _hidden(p, source)
        )
        if not files:
            raise DataError(
                f"{source}: no data files (looked for {', '.join(DATA_SUFFIXES)}); to fix: point "
                "dataset.source at a file or a folder holding them"
            )
        return files
    if not source.exists():
        raise DataError(f"{source}: no such file or directory")
    if source.suffix not in DATA_SUFFIXES:
        raise DataError(f"{source}: unknown file type {source.suffix!r}; expected {DATA_SUFFIXES}")
    return [source]


def _decode(path: Path, raw: bytes, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8-sig" if line in (None, 1) else "utf-8")
    except UnicodeDecodeError as e:
        if line is None:
            line = raw.count(b"\n", 0, e.start) + 1
        where = f"{path}:{line}"
        raise DataError(
            f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); to fix: re-encode the "
            "file as UTF-8"
        ) from None


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            text = _decode(path, raw, lineno).strip()
            if not text:
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                msg = f"{path}:{lineno}: not valid JSON: {e.msg} (column {e.colno})"
                raise DataError(msg) from None
            yield Record(f"{path}:{lineno}", value)


def _read_json(path: Path) -> Iterator[Record]:
    text = _decode(path, path.read_bytes())
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})"
        raise DataError(msg) from None
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"data": [...]} / {"train": [...]}
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(value).__name__}")
    for i, item in enumerate(value, start=1):
        yield Record(f"{path} record {i}", item)


def _read_parquet(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow ships with the trainer extra
        raise ConfigError(f"{path}: reading Parquet needs pyarrow ({e})") from e
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e
    for i, row in enumerate(table.to_pylist(), start=1):
        yield Record(f"{path} row {i}", row)


def _read_text(path: Path) -> Iterator[Record]:
    """A .txt file: documents separated by blank lines."""
    text = _decode(path, path.read_bytes())
    start = 1
    buf: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not buf:
                start = lineno
            buf.append(line)
        elif buf:
            yield Record(f"{path}:{start}", {"text": "\n".join(buf)})
            buf = []
    if buf:
        yield Record(f"{path}:{start}", {"text": "\n".join(buf)})


def _read_hub(source: str, revision: str | None = None) -> Iterator[Record]:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"dataset {source!r} is a hub id, which needs the `datasets` package; to fix: "
            "install it in the trainer image, or put the data on a volume as JSONL/Parquet"
        ) from e
    try:
        ds = hub_call(
            lambda: datasets.load_dataset(source, split="train", revision=revision),
            what="dataset",
            uri=source,
            field="dataset.uri",
            revision=revision,
            token_env=os.environ.get(HUB_TOKEN_ENV) and HUB_TOKEN_ENV,
        )
    except TrainerExit:
        raise  # refused, missing (config error) or unreachable (restart)
    except Exception as e:
        raise DataError(f"hub dataset {source!r}: {e}") from e
    for i, row in enumerate(ds, start=1):
        yield Record(f"hub:{source} row {i}", row)


def read_records(source: str, kind: str = "path", revision: str | None = None) -> list[Record]:
    """All records of a dataset, in file order (a hub dataset at `revision`); raises
    DataError on unreadable input."""
    if kind == "hub":
        rows = list(_read_hub(source, revision))
        if not rows:
            raise DataError(f"hub dataset {source!r}: empty")
        return rows
    if kind == "s3":
        raise ConfigError(
            f"dataset {source}: s3 sources are not read by the trainer; to fix: copy the data "
            "to a volume (pvc://) and point dataset.uri there"
        )
    records: list[Record] = []
    for path in _files(Path(source)):
        readers = {
            ".jsonl": _read_jsonl,
            ".json": _read_json,
            ".parquet": _read_parquet,
            ".txt": _read_text,
        }
        before = len(records)
        records.extend(readers[path.suffix](path))
        if len(records) == before:
            raise DataError(f"{path}: empty (no records); to fix: remove it or fill it")
    return records
