"""The tokenized-data cache: rows written once per node, memory-mapped by every rank.

Without it every rank reads and tokenizes the whole dataset into lists of Python ints (an int
above 256 is a 28-byte object of its own), so an 8-GPU node holds eight copies of the data
and pays the tokenization eight times at every start; a large dataset puts the node under
memory pressure, and an evicted pod is a preemption.

With it, local rank 0 of each node builds the exact `PreparedData` the ranks would have built
(templating, tokenizing, truncation, split, packing) and writes its rows as flat numpy arrays
(int32 tokens and labels, int64 offsets and lengths) to `<checkpoint.dir>/.data/<key>/`, in a
temporary folder renamed into place once a manifest with every file's size and hash is
written last. The other ranks wait at a barrier and memory-map the arrays, so the node holds
one copy in its page cache. A restart (resume, re-plan) finds the folder and tokenizes
nothing.

The key hashes everything that shapes the rows: the dataset (source, kind, revision, format,
and for files their names, sizes and modification times), the tokenizer (its full
serialisation, chat template and special tokens), sequence_length, packing,
validation_split, seed, the objective and the trainer's version. A folder whose manifest is
missing, unreadable, of another key, or whose files do not match it is rebuilt, never
trusted; folders of other keys are removed, so the volume holds one cache.

Nodes may share the checkpoint volume or not: each node's local rank 0 checks for itself.
On a shared volume, nodes building at once each write their own temporary folder and the
first rename wins. If the cache cannot be written (read-only or full volume), every rank
falls back to preparing the data in memory, as before, and says so.

`KUBETUNE_DATA_CACHE=off` turns the cache off (every rank prepares its own copy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kubetune_trainer import __version__
from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.data import (
    DataStats,
    PairRows,
    PreparedData,
    Ragged,
    Rows,
    _files,
    ensure_chat_template,
    renders_chat,
)
from kubetune_trainer.distributed import DistEnv, barrier
from kubetune_trainer.errors import TrainerExit

log = logging.getLogger(__name__)

CACHE_ENV = "KUBETUNE_DATA_CACHE"
"""`off` (or `0`, `false`) turns the cache off."""
CACHE_FOLDER = ".data"
"""Under checkpoint.dir; a dot-folder, so the checkpointer's step-N handling never sees it."""
MANIFEST = "manifest.json"
FORMAT = 1
"""The layout's version: part of the key, so a trainer that lays rows out differently never
reads an older folder."""
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600.0
"""A temporary folder this old belongs to a writer that died; younger ones may belong to
another node writing the same key right now."""


@dataclass(frozen=True)
class CacheOutcome:
    source: str
    """`built` (this node tokenized and wrote it), `read` (found it), `off` (turned off or
    not writable: this rank prepared its own copy)."""
    folder: Path | None
    seconds: float


# --------------------------------------------------------------------------- key


def tokenizer_identity(tokenizer: Any) -> str:
    """A hash of everything of the tokenizer that decides token ids."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary and how it was configured
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        h.update(json.dumps(getattr(tokenizer, "init_kwargs", {}), default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        h.update(f"{name}={getattr(tokenizer, name, None)};".encode())
    return h.hexdigest()


def dataset_identity(cfg: TrainerConfig) -> dict[str, Any]:
    ds = cfg.dataset
    out: dict[str, Any] = {"source": ds.source, "kind": ds.kind, "revision": ds.revision}
    if ds.kind == "path":
        root = Path(ds.source)
        files = []
        for p in _files(root):
            st = p.stat()
            rel = str(p.relative_to(root)) if root.is_dir() else p.name
            files.append([rel, st.st_size, st.st_mtime_ns])
        out["files"] = files
    return out


def cache_identity(cfg: TrainerConfig, tokenizer: Any) -> dict[str, Any]:
    t = cfg.training
    dpo = t.objective == "dpo"
    return {
        "format": FORMAT,
        "trainer": __version__,
        "dataset": dataset_identity(cfg),
        # DPO reads the record's shape, never dataset.format, and never packs.
        "dataset_format": None if dpo else cfg.dataset.format,
        "packing": False if dpo else t.packing,
        "objective": t.objective,
        "tokenizer": tokenizer_identity(tokenizer),
        "sequence_length": t.sequence_length,
        "validation_split": cfg.dataset.validation_split,
        "seed": t.seed,
    }


def cache_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- write / read


def _side_arrays(rows: Rows) -> dict[str, np.ndarray[Any, Any]]:
    ids = Ragged.from_rows(rows.input_ids)
    out = {
        "input_ids": ids.flat,
        "labels": Ragged.from_rows(rows.labels).flat,
        "offsets": ids.offsets,
        "lengths": np.asarray(rows.lengths, dtype=np.int64),
    }
    if rows.position_ids is not None:
        out["position_ids"] = Ragged.from_rows(rows.position_ids).flat
    return out


def _arrays(data: PreparedData) -> dict[str, np.ndarray[Any, Any]]:
    out: dict[str, np.ndarray[Any, Any]] = {}
    for split, rows in (("train", data.train), ("validation", data.validation)):
        if rows is None:
            continue
        sides = (
            {"chosen": rows.chosen, "rejected": rows.rejected}
            if isinstance(rows, PairRows)
            else {"rows": rows}
        )
        for side, side_rows in sides.items():
            for name, arr in _side_arrays(side_rows).items():
                out[f"{split}.{side}.{name}"] = arr
    return out


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_cache(root: Path, key: str, identity: dict[str, Any], data: PreparedData) -> Path:
    """Write `data` as `root/key` atomically; returns the folder. If another writer renamed
    its folder into place first, theirs stays and ours is dropped."""
    final = root / key
    tmp = root / f"{TMP_PREFIX}{key}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files: dict[str, dict[str, Any]] = {}
        for name, arr in _arrays(data).items():
            path = tmp / f"{name}.npy"
            np.save(path, arr, allow_pickle=False)
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size, "blake2b": _digest(path)}
        manifest = {
            "key": key,
            "identity": identity,
            "kind": "pairs" if isinstance(data.train, PairRows) else "rows",
            "splits": [s for s in ("train", "validation") if getattr(data, s) is not None],
            "stats": dataclasses.asdict(data.stats),
            "files": files,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # Written last: a folder without it (or with a short one) is incomplete.
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            log.info("data cache %s: another writer finished first; using theirs", final)
        _fsync(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _damage(folder: Path, key: str, verify: bool) -> tuple[str | None, dict[str, Any]]:
    """What is wrong with the folder (None when nothing), and its manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (an unfinished or damaged write)", {}
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})", {}
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "manifest of another key", {}
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files", {}
    for name, want in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} missing", {}
        if size != want.get("bytes"):
            return f"{name} is {size} bytes, the manifest says {want.get('bytes')}", {}
        if verify and _digest(path) != want.get("blake2b"):
            return f"{name} does not match its hash", {}
    return None, manifest


def _side(folder: Path, prefix: str) -> Rows:
    def load(name: str) -> np.ndarray[Any, Any]:
        arr: np.ndarray[Any, Any] = np.load(
            folder / f"{prefix}.{name}.npy", mmap_mode="r", allow_pickle=False
        )
        return arr

    offsets = load("offsets")
    pos = folder / f"{prefix}.position_ids.npy"
    return Rows(
        input_ids=Ragged(load("input_ids"), offsets),
        labels=Ragged(load("labels"), offsets),
        lengths=load("lengths"),
        position_ids=Ragged(load("position_ids"), offsets) if pos.is_file() else None,
    )


def read_cache(folder: Path, key: str, *, verify: bool) -> PreparedData | None:
    """The cached rows, memory-mapped; None if the folder is missing or damaged (`verify`
    also compares every file's hash, which reads it all once)."""
    if not folder.is_dir():
        return None
    problem, manifest = _damage(folder, key, verify)
    if problem is None:
        try:
            splits: dict[str, Rows | PairRows] = {}
            for split in manifest["splits"]:
                if manifest["kind"] == "pairs":
                    splits[split] = PairRows(
                        chosen=_side(folder, f"{split}.chosen"),
                        rejected=_side(folder, f"{split}.rejected"),
                    )
                else:
                    splits[split] = _side(folder, f"{split}.rows")
            stats = DataStats(**manifest["stats"])
            return PreparedData(
                train=splits["train"], validation=splits.get("validation"), stats=stats
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"unreadable ({type(e).__name__}: {e})"
    log.warning("data cache %s: %s; not used", folder, problem)
    return None


def remove_others(root: Path, key: str) -> list[str]:
    """Drop caches of other keys (and dead writers' temporary folders): one cache per
    volume. Returns the names removed."""
    removed = []
    now = time.time()
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.name == key:
            continue
        if p.name.startswith(TMP_PREFIX):
            try:
                age = now - p.stat().st_mtime
            except OSError:
                continue
            if age < STALE_TMP_SECONDS:
                continue  # perhaps another node writing right now
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed


# --------------------------------------------------------------------------- the rows a rank uses


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _tokenizer_as_prepared(cfg: TrainerConfig, tokenizer: Any) -> None:
    """A rank that read the cache must leave the tokenizer as preparing would have: a
    template-less tokenizer gets ChatML for chat data (and is saved with the output so)."""
    if cfg.training.objective == "dpo" or renders_chat(cfg.dataset.format):
        ensure_chat_template(tokenizer)


class _PrepareFailed(Exception):
    def __init__(self, error: BaseException) -> None:
        self.error = error


def tokenized_data(
    cfg: TrainerConfig,
    env: DistEnv,
    tokenizer: Any,
    prepare: Callable[[], PreparedData],
) -> tuple[PreparedData, CacheOutcome]:
    """This rank's `PreparedData`: from the cache if there is one, built by this node's local
    rank 0 if not. Every rank must call it (it holds a barrier)."""
    t0 = time.monotonic()
    if not enabled():
        return prepare(), CacheOutcome("off", None, time.monotonic() - t0)
    identity = cache_identity(cfg, tokenizer)
    key = cache_key(identity)
    root = Path(cfg.checkpoint.dir) / CACHE_FOLDER
    folder = root / key
    source = "read"
    failure: BaseException | None = None
    built: PreparedData | None = None  # kept only while it is not on the volume
    cached: PreparedData | None = None  # what local rank 0 found and verified
    if env.local_rank == 0:
        try:
            cached = read_cache(folder, key, verify=True)
            if cached is None:
                source = "built"
                shutil.rmtree(folder, ignore_errors=True)  # damaged, or absent
                try:
                    built = prepare()
                except (TrainerExit, Exception) as e:
                    raise _PrepareFailed(e) from e
                # Another node sharing the volume may have written it meanwhile: keep theirs.
                if _damage(folder, key, verify=False)[0] is not None:
                    root.mkdir(parents=True, exist_ok=True)
                    write_cache(root, key, identity, built)
                built = None  # every rank maps the written copy, this one too
            removed = remove_others(root, key)
            if removed:
                log.info("data cache: removed %d folder(s) of other keys", len(removed))
        except _PrepareFailed as e:
            failure = e.error
        except (OSError, ValueError) as e:
            log.warning("data cache %s cannot be written (%s); preparing in memory", folder, e)
    # The other ranks wait for the node's copy. A bad dataset fails local rank 0 here; the
    # others find no cache, prepare for themselves and fail with the same error.
    barrier()
    if failure is not None:
        raise failure
    if cached is None:
        cached = read_cache(folder, key, verify=False)
    if cached is None:
        data = built if built is not None else prepare()
        return data, CacheOutcome("off", None, time.monotonic() - t0)
    _tokenizer_as_prepared(cfg, tokenizer)
    return cached, CacheOutcome(source, folder, time.monotonic() - t0)
