"""Evicting least-recently-used cache entries down to a size cap, after a stage-in.

An entry is never removed while someone may read it or write it: one a job still reads (the
operator's `keep_paths`), one this stage-in just handed out, one whose lock is held (a fetch,
or a stage-in recording a use of it), one used since it was listed. The entry folder is
renamed to `.trash-<key>.<pid>.<ns>` (a name no lookup finds) with its lock held, then
deleted: a half-deleted entry never looks complete, and what a killed eviction left is
removed by the next one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from kubetune_trainer.stagein.cache import (
    CATEGORIES,
    TRASH_PREFIX,
    CacheEntry,
    cache_entries,
    entry_last_used,
    lookup,
    retire,
    try_locked,
)

log = logging.getLogger(__name__)


def entry_folder(cache_dir: str | Path, path: str | Path) -> Path | None:
    """The entry folder `path` is, or is inside (`<cache_dir>/<models|datasets>/<key>`);
    None for a path outside the cache."""
    root = Path(os.path.normpath(cache_dir))
    try:
        parts = Path(os.path.normpath(path)).relative_to(root).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[0] not in CATEGORIES or parts[1].startswith("."):
        return None
    return root / parts[0] / parts[1]


def _sweep_trash(cache_dir: Path) -> None:
    """Delete what an eviction killed halfway left (nobody reads a trash folder)."""
    for category in CATEGORIES:
        root = cache_dir / category
        if root.is_dir():
            for trash in root.glob(f"{TRASH_PREFIX}*"):
                shutil.rmtree(trash, ignore_errors=True)


def _remove(entry: CacheEntry) -> bool | None:
    """Remove one entry: True removed; False left (its lock is held, or it was used since it
    was listed); None already gone."""
    root, key = entry.path.parent, entry.path.name
    with try_locked(root.parent, key) as held:
        if not held:
            log.info("%s: its lock is held (a fetch or a use); not evicted", entry.path)
            return False
        current = lookup(root, key)
        if current is None:
            return None
        if entry_last_used(current.meta) != entry.last_used:
            log.info("%s: used since it was listed; not evicted", entry.path)
            return False
        retire(entry.path)
    return True


def evict(
    cache_dir: str | Path, max_bytes: int, *, keep: Iterable[str], used: Iterable[str] = ()
) -> list[CacheEntry]:
    """Remove least-recently-used entries until the cache's entries hold at most `max_bytes`;
    never those `keep` (paths jobs read) or `used` (what this stage-in handed out) name, nor
    a busy one. Returns the entries removed, least recently used first."""
    cache_dir = Path(cache_dir)
    _sweep_trash(cache_dir)
    entries = cache_entries(cache_dir)
    total = sum(e.bytes for e in entries)
    if total <= max_bytes:
        return []
    kept = {f for f in (entry_folder(cache_dir, p) for p in keep) if f is not None}
    in_use = {f for f in (entry_folder(cache_dir, p) for p in used) if f is not None}
    removed: list[CacheEntry] = []
    for entry in entries:
        if total <= max_bytes:
            break
        folder = Path(os.path.normpath(entry.path))
        if folder in kept or folder in in_use:
            continue
        outcome = _remove(entry)
        if outcome is None:  # another eviction was first
            total -= entry.bytes
        elif outcome:
            total -= entry.bytes
            removed.append(entry)
            log.info(
                "evicted %s (%s, %.1f MB, last used %s)",
                entry.path.name,
                entry.source,
                entry.bytes / 1e6,
                entry.last_used.isoformat(),
            )
    if total > max_bytes:
        log.warning(
            "the cache holds %.1f MB, over its cap of %.1f MB: what is left is in use (jobs "
            "read it, this stage-in handed it out, or another stage-in holds it)",
            total / 1e6,
            max_bytes / 1e6,
        )
    return removed


def report(removed: list[CacheEntry]) -> None:
    """One JSON line on stdout, as the per-file progress lines: what was evicted."""
    line = {
        "event": "stagein_evicted",
        "evicted": [
            {
                "path": str(e.path),
                "source": e.source,
                "bytes": e.bytes,
                "last_used": e.last_used.isoformat(),
            }
            for e in removed
        ],
        "bytes": sum(e.bytes for e in removed),
    }
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
