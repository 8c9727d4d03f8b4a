"""The stage-in cache on the shared volume: one entry per (kind, source, revision).

    <cache_dir>/models/<key>/            a model folder, as fetched
    <cache_dir>/datasets/<key>/          a dataset folder (or the one file it holds)
    <cache_dir>/<models|datasets>/.tmp-<key>/   the fetch in progress (resumed after a restart)
    <cache_dir>/<models|datasets>/.trash-<key>.*/  an evicted entry being deleted (`evict`)
    <cache_dir>/locks/<key>.lock         held (flock) while <key> is fetched, used or evicted

`key` is a readable name and a short sha256 of (kind, source, revision) and, for an S3 or hub
source fetched from an endpoint other than the default, that endpoint: a bucket of the same
name on another store is another source. A fetch goes into
`.tmp-<key>/` on the same volume; `.kubetune-entry.json` is written there last, and the folder
is then renamed to `<key>/` in one step, so an entry either is complete or does not exist.
The entry file lists every file with its size and sha256; a hit is checked against it (the
same files, sizes and hashes, nothing added) before it is handed out, and an entry that
differs (damaged, half-evicted, changed by a pod that mounted the cache) is fetched again.
The lock makes two stage-ins of the same source fetch once: the second waits, then finds the
entry. Every use rewrites `last_used` in the entry file, with the lock held (an eviction by
least recent use takes the lock without waiting, and leaves an entry used since it looked).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubetune_trainer.hashing import file_sha256

log = logging.getLogger(__name__)

ENTRY_FILE = ".kubetune-entry.json"
ENTRY_VERSION = 2
"""2: each file's sha256 is recorded (1: sizes only; such an entry is fetched again)."""
LOCKS = "locks"
CATEGORIES = ("models", "datasets")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
NAME_CHARS = 48


DEFAULT_ORIGINS = {"s3": "https://s3.amazonaws.com", "hub": "https://huggingface.co"}
"""Where an `s3://` or hub source comes from when no endpoint is set."""


def source_origin(kind: str) -> str:
    """The store a source of `kind` is fetched from (the S3 endpoint, the hub's), as this
    process's environment sets it: the same bucket name on two S3 endpoints is two sources,
    one of which may be anyone's."""
    env = {"s3": "AWS_ENDPOINT_URL", "hub": "HF_ENDPOINT"}.get(kind)
    if env is None:
        return ""
    return (os.environ.get(env) or DEFAULT_ORIGINS[kind]).strip().rstrip("/").lower()


def cache_key(kind: str, source: str, revision: str | None, origin: str = "") -> str:
    """`<readable name>-<12 hex digits of sha256(kind, source, revision[, origin])>`: the
    origin is part of the key unless it is the kind's default (so that entries fetched
    before it was keyed stay valid where no endpoint is set)."""
    parts_of_key = [kind, source, revision or ""]
    if origin and origin != DEFAULT_ORIGINS.get(kind):
        parts_of_key.append(origin)
    digest = hashlib.sha256(json.dumps(parts_of_key).encode()).hexdigest()
    parts = [p for p in source.split("://", 1)[-1].split("/") if p]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", "--".join(parts[-2:])).strip(".-")
    return f"{name[:NAME_CHARS] or 'source'}-{digest[:12]}"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_iso(text: object) -> datetime:
    """An ISO time as `now_iso` writes it; the epoch for anything else (used longest ago)."""
    try:
        return datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    except ValueError:
        return datetime.fromtimestamp(0, UTC)


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Entry:
    """A finished cache entry."""

    path: Path
    meta: dict[str, Any]

    @property
    def target(self) -> Path:
        """What a job reads: the folder, or the single file a one-object dataset is."""
        return self.path / str(self.meta.get("target", "."))

    @property
    def bytes(self) -> int:
        return int(self.meta.get("bytes", 0))


def lookup(root: Path, key: str) -> Entry | None:
    """The finished entry `<root>/<key>`, or None."""
    try:
        meta = json.loads((root / key / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Entry(root / key, meta) if isinstance(meta, dict) else None


def touch(entry: Entry) -> Entry:
    """Record a use of the entry (`last_used`); a read-only volume only costs the record."""
    meta = {**entry.meta, "last_used": now_iso()}
    try:
        _write_json_atomic(entry.path / ENTRY_FILE, meta)
    except OSError as e:
        log.warning("%s: could not record its use (%s)", entry.path, e)
    return Entry(entry.path, meta)


def _open_lock(cache_dir: Path, key: str) -> int:
    """A descriptor of `<cache_dir>/locks/<key>.lock`, created if need be."""
    locks = cache_dir / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    return os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o664)


def _lock_now(fd: int) -> bool:
    """Take the lock on `fd` without waiting; False when someone else holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


@contextlib.contextmanager
def locked(cache_dir: Path, key: str, what: str) -> Iterator[None]:
    """Hold `<cache_dir>/locks/<key>.lock` exclusively (waiting for whoever holds it)."""
    fd = _open_lock(cache_dir, key)
    try:
        if not _lock_now(fd):
            log.info("%s: another stage-in is fetching or using it; waiting for it", what)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("%s: the other stage-in finished after %.1fs", what, time.monotonic() - t0)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def try_locked(cache_dir: Path, key: str) -> Iterator[bool]:
    """Hold `<cache_dir>/locks/<key>.lock` if nobody does (True), else do nothing (False)."""
    fd = _open_lock(cache_dir, key)
    try:
        if not _lock_now(fd):
            yield False
            return
        try:
            yield True
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def temp_dir(root: Path, key: str) -> Path:
    """Where `key` is fetched (call with the lock held); what a failed try left is kept, so
    a restart resumes it."""
    tmp = root / f"{TMP_PREFIX}{key}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def retire(path: Path) -> None:
    """Take an entry folder out of the cache (call with its lock held): renamed to
    `.trash-<key>.<pid>.<ns>`, a name no lookup finds, then deleted; files a reader has open
    stay readable, and a half-deleted entry never looks complete."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{os.getpid()}.{time.time_ns()}")
    os.rename(path, trash)
    discard(trash)


HASH_THREADS = 4
"""Files hashed at once (hashlib releases the GIL on large reads)."""


def _files(folder: Path) -> list[Path]:
    return [
        p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() != ENTRY_FILE
    ]


def listing(folder: Path) -> list[dict[str, Any]]:
    """Every file under `folder` but the entry file, as {path, bytes, sha256}."""
    files = _files(folder)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hashes = list(pool.map(file_sha256, files))
    return [
        {"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, "sha256": h}
        for p, h in zip(files, hashes, strict=True)
    ]


def entry_problem(entry: Entry) -> str | None:
    """What differs between the entry's folder and the files its entry file records (None:
    nothing): a file missing, added, of another size or another sha256."""
    recorded = entry.meta.get("files")
    if entry.meta.get("version") != ENTRY_VERSION or not isinstance(recorded, list):
        return f"recorded by an older stage-in (entry version {entry.meta.get('version')})"
    want = {str(f.get("path")): f for f in recorded if isinstance(f, dict)}
    have = {p.relative_to(entry.path).as_posix(): p for p in _files(entry.path)}
    if extra := sorted(set(have) - set(want)):
        return f"{extra[0]} was added"
    if missing := sorted(set(want) - set(have)):
        return f"{missing[0]} is missing"
    for rel, p in have.items():
        if p.stat().st_size != want[rel].get("bytes"):
            return f"{rel} has {p.stat().st_size} bytes, not {want[rel].get('bytes')}"
    names = sorted(have)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hashes = dict(zip(names, pool.map(file_sha256, [have[n] for n in names]), strict=True))
    for rel in names:
        if hashes[rel] != want[rel].get("sha256"):
            return f"{rel} does not match its sha256"
    return None


def publish(tmp: Path, root: Path, key: str, meta: dict[str, Any]) -> Entry:
    """Write the entry file into `tmp` and rename it to `<root>/<key>` (lock held)."""
    files = listing(tmp)
    stamp = now_iso()
    full = {
        "version": ENTRY_VERSION,
        **meta,
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "fetched_at": stamp,
        "last_used": stamp,
    }
    _write_json_atomic(tmp / ENTRY_FILE, full)
    final = root / key
    if final.exists():  # a folder without an entry file: not ours to trust
        discard(final)
    os.rename(tmp, final)
    return Entry(final, full)


def entry_last_used(meta: dict[str, Any]) -> datetime:
    return _parse_iso(meta.get("last_used"))


@dataclass(frozen=True)
class CacheEntry:
    """One entry, as an eviction by least recent use needs it."""

    path: Path
    category: str  # "models" or "datasets"
    source: str
    bytes: int
    last_used: datetime


def cache_entries(cache_dir: str | Path) -> list[CacheEntry]:
    """The finished entries under `cache_dir`, least recently used first."""
    out = []
    for category in CATEGORIES:
        root = Path(cache_dir) / category
        if not root.is_dir():
            continue
        for d in root.iterdir():
            entry = None if d.name.startswith(".") else lookup(root, d.name)
            if entry is None:
                continue
            out.append(
                CacheEntry(
                    path=entry.path,
                    category=category,
                    source=str(entry.meta.get("source", "")),
                    bytes=entry.bytes,
                    last_used=entry_last_used(entry.meta),
                )
            )
    return sorted(out, key=lambda e: (e.last_used, str(e.path)))
