"""Uploading a run's output folder to S3, with boto3.

Every file under `source_dir` becomes the object `<prefix>/<its relative path>`; files larger
than `part_bytes` go up as multipart uploads in parts of that size. Each object carries the
sha256 of its file in its metadata (`x-amz-meta-sha256`), so a later try can tell a complete
object from a missing or different one without downloading it: an object with the file's
size and sha256 is skipped, and a retried upload sends only what is missing.

`UPLOAD_MANIFEST` goes up last, and a stale one (from a try that uploaded other files) is
deleted before anything else is sent: a store that has the manifest has the whole output.

Failures are sorted as the stage-in sorts its S3 fetches (`stagein.fetch.classify_s3`):
refused access or no such bucket is a `ConfigError` (exit 2); 5xx, throttling, timeouts and
broken connections are retried (botocore per request, `hub.retrying` per file), then end
the try with a transient exit that restarts the pod.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from kubetune_trainer.contract import UPLOAD_MANIFEST, StageOutConfig, StageOutResult
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.stagein.fetch import (
    S3_PARALLEL_FILES,
    classify_s3,
    parse_s3,
    retrying,
    s3_client,
)

log = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")

WHAT = "output"
FIELD = "output.uri"
"""The spec field the destination comes from, for "To fix:"."""
MAY = "list, read and write objects in"
"""What the credentials must be allowed to do with the bucket."""
SHA256_META = "sha256"
"""The user metadata key of an object's sha256 (sent as `x-amz-meta-sha256`)."""


@dataclass(frozen=True)
class LocalFile:
    path: str
    """Relative to source_dir, with forward slashes: the key under the destination prefix."""
    local: Path
    bytes: int


@dataclass(frozen=True)
class Planned:
    file: LocalFile
    key: str
    sha256: str
    stored: bool
    """An object with this size and sha256 is already there."""


@dataclass
class Progress:
    """Counts finished files; prints one JSON line per file to stdout."""

    destination: str
    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    uploaded_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def done(self, file: LocalFile, *, uploaded: bool) -> None:
        with self._lock:
            self.files_done += 1
            self.bytes_done += file.bytes
            if uploaded:
                self.uploaded_bytes += file.bytes
            line = {
                "event": "stageout_file",
                "destination": self.destination,
                "file": file.path,
                "file_bytes": file.bytes,
                "skipped": not uploaded,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total,
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()


def local_files(source: Path) -> list[LocalFile]:
    """Every file under `source` (symbolic links to files followed, to folders not: a link
    such as `latest -> step-N` would upload the folder twice), but a top-level
    UPLOAD_MANIFEST, sorted by path."""
    found: list[LocalFile] = []
    for root, dirs, names in os.walk(source):
        for name in dirs:
            if (Path(root) / name).is_symlink():
                log.warning("not following %s: a link to a folder", Path(root) / name)
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(source).as_posix()
            if rel == UPLOAD_MANIFEST:
                continue
            if not path.is_file():
                log.warning("skipping %s: not a regular file (a broken link?)", path)
                continue
            found.append(LocalFile(rel, path, path.stat().st_size))
    return sorted(found, key=lambda f: f.path)


def sha256_of(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _nothing_to_upload(destination: str, source: str, why: str) -> ConfigError:
    return ConfigError(
        f"{WHAT} {destination}: nothing to upload: {source} {why}. To fix: check the trainer's "
        "log for why the run wrote no output there, and that the stage-out mounts the volume "
        "it wrote to"
    )


def _run_all(fn: Callable[[A], R], items: list[A], name: str) -> list[R]:
    """`fn(item)` for each item on S3_PARALLEL_FILES threads, in order; the first failure
    cancels what has not started and is raised."""
    with ThreadPoolExecutor(S3_PARALLEL_FILES, thread_name_prefix=name) as pool:
        futures: list[Future[R]] = [pool.submit(fn, item) for item in items]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in finished if f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            failed[0].result()
    return [f.result() for f in futures]


@dataclass(frozen=True)
class _Destination:
    """The bucket and folder a run's output goes to, each call retried and its failures
    sorted as the stage-in sorts its S3 fetches."""

    uri: str
    bucket: str
    folder: str
    client: Any

    def key_of(self, rel: str) -> str:
        return f"{self.folder}/{rel}" if self.folder else rel

    def classify(self, e: BaseException) -> ConfigError | str | None:
        return classify_s3(e, what=WHAT, uri=self.uri, bucket=self.bucket, field=FIELD, may=MAY)

    def retried(self, fn: Callable[[], R], key: str | None = None) -> R:
        """`fn` retried; failures name the object `key`, else the destination."""
        uri = self.uri if key is None else f"s3://{self.bucket}/{key}"
        return retrying(fn, self.classify, what=WHAT, uri=uri)

    def stored(self) -> dict[str, int]:
        """The objects under the destination and their sizes: the bucket's existence and the
        credentials are checked here, before any file is read."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.folder}/" if self.folder else ""
        )
        return {o["Key"]: int(o["Size"]) for page in pages for o in page.get("Contents", [])}

    def stored_sha256(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) == 404:
                return None  # removed since the listing
            raise
        meta = head.get("Metadata") or {}
        return str(meta.get(SHA256_META) or "") or None

    def plan(self, file: LocalFile, stored: dict[str, int]) -> Planned:
        key = self.key_of(file.path)
        sha256 = sha256_of(file.local)
        there = stored.get(key) == file.bytes and (
            self.retried(lambda: self.stored_sha256(key), key) == sha256
        )
        return Planned(file, key, sha256, there)

    def upload(self, item: Planned, transfer: Any, progress: Progress) -> None:
        if item.stored:
            progress.done(item.file, uploaded=False)
            return

        def put() -> None:
            self.client.upload_file(
                str(item.file.local),
                self.bucket,
                item.key,
                ExtraArgs={"Metadata": {SHA256_META: item.sha256}},
                Config=transfer,
            )

        self.retried(put, item.key)
        progress.done(item.file, uploaded=True)

    def put_manifest(self, key: str, body: bytes) -> None:
        self.retried(
            lambda: self.client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=body,
                ContentType="application/json",
                Metadata={SHA256_META: hashlib.sha256(body).hexdigest()},
            ),
            key,
        )


def _files_to_upload(cfg: StageOutConfig) -> list[LocalFile]:
    """The files of `cfg.source_dir`; a ConfigError when there are none to upload."""
    source = Path(cfg.source_dir)
    if not source.is_dir():
        why = "is not a folder" if source.exists() else "does not exist"
        raise _nothing_to_upload(cfg.destination, cfg.source_dir, why)
    files = local_files(source)
    if not files:
        raise _nothing_to_upload(cfg.destination, cfg.source_dir, "holds no files")
    return files


def _manifest(cfg: StageOutConfig, planned: list[Planned], total: int) -> bytes:
    manifest = {
        "destination": cfg.destination,
        "job": cfg.job.model_dump(mode="json"),
        "files": [
            {"path": p.file.path, "bytes": p.file.bytes, "sha256": p.sha256} for p in planned
        ],
        "bytes": total,
        "uploaded": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return (json.dumps(manifest, indent=2) + "\n").encode()


def stage_out(cfg: StageOutConfig) -> StageOutResult:
    """Upload `cfg.source_dir` to `cfg.destination`, then the manifest."""
    from boto3.s3.transfer import TransferConfig

    t0 = time.monotonic()
    destination = cfg.destination
    bucket, prefix = parse_s3(destination, FIELD)
    files = _files_to_upload(cfg)
    total = sum(f.bytes for f in files)
    log.info("uploading %d files (%.1f MB) to %s", len(files), total / 1e6, destination)

    store = _Destination(destination, bucket, prefix.strip("/"), s3_client())
    stored = store.retried(store.stored)
    planned = _run_all(lambda file: store.plan(file, stored), files, "stageout-plan")
    manifest_key = store.key_of(UPLOAD_MANIFEST)
    if manifest_key in stored and not all(p.stored for p in planned):
        # A manifest must never describe a store that lacks its files.
        store.retried(
            lambda: store.client.delete_object(Bucket=bucket, Key=manifest_key), manifest_key
        )
        log.info("deleted the manifest of an earlier upload, %s", manifest_key)

    progress = Progress(destination, len(files), total)
    transfer = TransferConfig(
        multipart_threshold=cfg.part_bytes + 1,  # larger than part_bytes: in parts
        multipart_chunksize=cfg.part_bytes,
        max_concurrency=8,
        use_threads=True,
    )
    _run_all(lambda item: store.upload(item, transfer, progress), planned, "stageout-upload")
    store.put_manifest(manifest_key, _manifest(cfg, planned, total))
    return StageOutResult(
        destination=destination,
        files=len(files),
        bytes=total,
        uploaded_bytes=progress.uploaded_bytes,
        skipped_bytes=total - progress.uploaded_bytes,
        seconds=round(time.monotonic() - t0, 3),
    )
