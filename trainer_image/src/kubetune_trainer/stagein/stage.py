"""One stage-in: the dataset, then the model, into the cache; checked, then measured; then
the least recently used entries evicted down to the cache's cap. Its progress is served as
gauges (`progress`) while it runs."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubetune_trainer.contract import StageInConfig, StageInResult
from kubetune_trainer.data import HUB_TOKEN_ENV
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.stagein.cache import (
    Entry,
    cache_key,
    discard,
    entry_problem,
    locked,
    lookup,
    publish,
    retire,
    source_origin,
    temp_dir,
)
from kubetune_trainer.stagein.cache import touch as touch_entry
from kubetune_trainer.stagein.check import (
    Renames,
    check_config,
    check_model,
    measure,
    read_dataset,
)
from kubetune_trainer.stagein.evict import evict, report
from kubetune_trainer.stagein.fetch import (
    Fetched,
    Progress,
    check_hub_access,
    check_s3_access,
    fetch_https,
    fetch_hub,
    fetch_s3,
    hub_commit,
    s3_key,
    s3_versions,
)
from kubetune_trainer.stagein.progress import StageProgress

log = logging.getLogger(__name__)

EarlyCheck = Callable[[Path], None]
"""Run on a model's folder once config.json is in, before the weights are fetched."""


@dataclass(frozen=True)
class Staged:
    path: str  # what a job reads: the folder, or a dataset's single file
    downloaded_bytes: int
    reused_bytes: int
    renames: Renames  # the cache's path → the source, for messages


def _hub_token(token_env: str | None, what: str, uri: str) -> str | None:
    if not token_env:
        return None
    token = os.environ.get(token_env)
    if not token:
        raise ConfigError(
            f"{what} {uri}: model.token_env {token_env} is not set or empty. To fix: put the "
            "hub token in the Secret model.tokenSecretRef names"
        )
    return token


def _hub_credentials(
    what: str, source: str, token_env: str | None
) -> tuple[str | None, str | None]:
    """(token, the env var it came from) for a hub model (model.token_env) or dataset (HF_TOKEN)."""
    if what == "model":
        return _hub_token(token_env, what, source), token_env
    token = os.environ.get(HUB_TOKEN_ENV) or None
    return token, HUB_TOKEN_ENV if token else None


def _check_access(what: str, kind: str, source: str, token_env: str | None, entry: Entry) -> None:
    """A cache hit is served only to a job whose own credentials may read the source: the
    cache volume is shared, the access rights are not."""
    files = [str(f["path"]) for f in entry.meta.get("files", [])]
    if not files:
        return
    field = f"{what}.uri"
    if kind == "hub":
        token, env = _hub_credentials(what, source, token_env)
        check_hub_access(
            source,
            repo_type=what,
            commit=entry.meta.get("commit"),
            path="config.json" if "config.json" in files else files[0],
            token=token,
            token_env=env,
            field=field,
            what=what,
        )
    elif kind == "s3":
        key = s3_key(source, str(entry.meta.get("target", ".")), files[0], field)
        check_s3_access(source, key, what=what, field=field)


def _changed(
    what: str,
    kind: str,
    source: str,
    revision: str | None,
    token_env: str | None,
    entry: Entry,
) -> str | None:
    """How the source differs from the entry now (the hub: the branch or tag moved to
    another commit; S3: an object changed, added or removed, by its ETag); None when it does
    not, or the entry recorded nothing to compare."""
    if kind == "hub":
        recorded_commit = entry.meta.get("commit")
        if not recorded_commit or (revision and re.fullmatch(r"[0-9a-f]{40}", revision)):
            return None  # a pinned commit never moves
        token, env = _hub_credentials(what, source, token_env)
        commit = hub_commit(
            source,
            repo_type=what,
            revision=revision,
            token=token,
            token_env=env,
            field=f"{what}.uri",
            what=what,
        )
        if commit == recorded_commit:
            return None
        branch = revision or "the default branch"
        return f"{branch} moved from commit {recorded_commit[:12]} to {commit[:12]}"
    recorded = entry.meta.get("source_versions")
    if kind != "s3" or not isinstance(recorded, dict):
        return None
    now = s3_versions(source, what=what, field=f"{what}.uri")
    if now == recorded:
        return None
    changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    return f"{changed[0]} changed at the source since it was fetched"


def _fetch(
    what: str,
    kind: str,
    source: str,
    revision: str | None,
    token_env: str | None,
    dest: Path,
    progress: Progress,
    early: EarlyCheck | None,
) -> Fetched:
    field = f"{what}.uri"
    if kind == "hub":
        token, token_env = _hub_credentials(what, source, token_env)
        return fetch_hub(
            source,
            repo_type=what,
            revision=revision,
            token=token,
            token_env=token_env,
            field=field,
            what=what,
            dest=dest,
            progress=progress,
            early=early,
        )
    if kind == "s3":
        return fetch_s3(source, what=what, field=field, dest=dest, progress=progress, early=early)
    if kind == "https" and what == "dataset":
        return fetch_https(source, what=what, field=field, dest=dest, progress=progress)
    raise ConfigError(
        f"{what} {source}: a {what} cannot come from {kind}. To fix: use the hub, s3:// or a "
        "volume (pvc://)"
    )


def _renames(what: str, kind: str, source: str, entry_path: Path, target: Path) -> Renames:
    if what != "dataset":
        return None
    if target != entry_path:
        return str(target), source  # one object or one URL: the file is the source
    if kind == "hub":
        return str(entry_path), f"hf://datasets/{source}"
    return str(entry_path), source.rstrip("/")


def _fetch_into(
    cache_dir: Path,
    what: str,
    kind: str,
    source: str,
    revision: str | None,
    token_env: str | None,
    early: EarlyCheck | None,
    progress: Progress,
) -> Staged:
    """Fetch into `.tmp-<key>/` and publish it as the entry (the key's lock held)."""
    root = cache_dir / f"{what}s"
    key = cache_key(kind, source, revision, source_origin(kind))
    tmp = temp_dir(root, key)
    t0 = time.monotonic()
    try:
        fetched = _fetch(what, kind, source, revision, token_env, tmp, progress, early)
    except ConfigError:
        discard(tmp)  # nothing worth resuming
        raise
    entry = publish(
        tmp,
        root,
        key,
        {
            "kind": kind,
            "source": source,
            "revision": revision,
            "commit": fetched.commit,
            "target": fetched.target,
            "source_versions": fetched.versions,
        },
    )
    log.info(
        "%s %s: fetched %d files, %.1f MB (%.1f MB downloaded) in %.1fs into %s",
        what,
        source,
        len(entry.meta["files"]),
        entry.bytes / 1e6,
        progress.downloaded_bytes / 1e6,
        time.monotonic() - t0,
        entry.path,
    )
    return Staged(
        str(entry.target),
        progress.downloaded_bytes,
        max(0, entry.bytes - progress.downloaded_bytes),
        _renames(what, kind, source, entry.path, entry.target),
    )


def stage_source(
    cache_dir: Path,
    what: str,
    kind: str,
    source: str,
    *,
    revision: str | None = None,
    token_env: str | None = None,
    early: EarlyCheck | None = None,
    tracker: StageProgress | None = None,
) -> Staged:
    """The model or dataset (`what`) in the cache: found there, or fetched into it once;
    `tracker` counts what is fetched and found."""
    if kind == "path":
        if not Path(source).exists():
            raise ConfigError(
                f"{what} {source}: no such file or directory. To fix: check {what}.uri (the "
                "volume claim and the path in it)"
            )
        return Staged(source, 0, 0, None)
    root = cache_dir / f"{what}s"
    key = cache_key(kind, source, revision, source_origin(kind))
    entry = lookup(root, key)
    checked = entry is not None
    if entry is not None:  # before the lock, which a fetch of this source holds for long
        _check_access(what, kind, source, token_env, entry)
    # The use is recorded with the lock held: an eviction, which takes the lock and then
    # checks `last_used`, either removed the entry before (it is fetched again) or keeps it.
    with locked(cache_dir, key, f"{what} {source}"):
        entry = lookup(root, key)
        # The source first: one call, where the entry's check hashes every file.
        problem = None
        if entry is not None:
            problem = _changed(what, kind, source, revision, token_env, entry)
            problem = problem or entry_problem(entry)
        if entry is not None and problem is not None:
            log.warning(
                "%s %s: the cache entry %s differs from its record (%s): fetched again",
                what,
                source,
                entry.path,
                problem,
            )
            retire(entry.path)
            entry = None
        if entry is None:  # not there, evicted since, or changed on the volume
            progress = Progress(what, source) if tracker is None else tracker.source(what, source)
            return _fetch_into(cache_dir, what, kind, source, revision, token_env, early, progress)
        if not checked:  # another stage-in fetched it meanwhile
            _check_access(what, kind, source, token_env, entry)
        entry = touch_entry(entry)
    if tracker is not None:
        tracker.found(len(entry.meta.get("files", [])), entry.bytes)
    log.info("%s %s: in the cache (%s, %.1f MB)", what, source, entry.path, entry.bytes / 1e6)
    return Staged(
        str(entry.target),
        0,
        entry.bytes,
        _renames(what, kind, source, entry.path, entry.target),
    )


def stage_in(cfg: StageInConfig, *, progress: StageProgress | None = None) -> StageInResult:
    """Fetch (or find), check and measure, then evict down to the cache's cap; ConfigError
    for what retrying cannot fix. `progress` counts what is staged (by default one of its
    own, served on `cfg.metrics_port` while this runs)."""
    tracker = progress if progress is not None else StageProgress()
    if progress is None and cfg.metrics_port is not None:
        try:
            tracker.serve(cfg.metrics_port)
        except OSError as e:  # progress is for watching; staging goes on without it
            log.warning("cannot serve the progress on port %d: %s", cfg.metrics_port, e)
    try:
        result = _stage(cfg, tracker)
    finally:
        if progress is None:
            tracker.close()
    if cfg.cache_max_bytes is not None:
        _evict(cfg, cfg.cache_max_bytes, result)
    done = result.model_dump(mode="json", exclude={"model_config_json"})
    sys.stdout.write(json.dumps({"event": "stagein_done", **done}) + "\n")
    sys.stdout.flush()
    return result


def _stage(cfg: StageInConfig, tracker: StageProgress) -> StageInResult:
    t0 = time.monotonic()
    cache_dir = Path(cfg.cache_dir)
    ds = cfg.dataset
    # The dataset first: it is small, and a line that is not JSON fails the job before the
    # model's gigabytes are fetched.
    dataset = stage_source(
        cache_dir, "dataset", ds.kind, ds.source, revision=ds.revision, tracker=tracker
    )
    records = read_dataset(dataset.path, uri=ds.source, renames=dataset.renames)
    ref = cfg.model

    def early(folder: Path) -> None:  # a different architecture fails before the weights
        check_config(str(folder), uri=ref.source, model_type=cfg.model_type)

    model = stage_source(
        cache_dir,
        "model",
        ref.kind,
        ref.source,
        revision=ref.revision,
        token_env=ref.token_env,
        early=early,
        tracker=tracker,
    )
    config, tokenizer = check_model(model.path, uri=ref.source, model_type=cfg.model_type)
    counts = measure(records, cfg, tokenizer, renames=dataset.renames)
    return StageInResult(
        model_path=model.path,
        dataset_path=dataset.path,
        model_config_json=config,
        examples=counts.examples,
        tokens=counts.tokens,
        packed_sequences=counts.packed_sequences,
        downloaded_bytes=model.downloaded_bytes + dataset.downloaded_bytes,
        reused_bytes=model.reused_bytes + dataset.reused_bytes,
        seconds=round(time.monotonic() - t0, 3),
    )


def _evict(cfg: StageInConfig, max_bytes: int, result: StageInResult) -> None:
    """The cache down to `max_bytes`, sparing what jobs read and what this run hands out.
    The job is staged already: a failure here is only logged."""
    try:
        removed = evict(
            cfg.cache_dir,
            max_bytes,
            keep=cfg.keep_paths,
            used=[result.model_path, result.dataset_path],
        )
    except OSError as e:
        log.warning("eviction stopped: %s", e)
        return
    report(removed)
