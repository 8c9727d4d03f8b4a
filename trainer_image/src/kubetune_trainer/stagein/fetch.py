"""Fetching a model or a dataset into a folder, with the real clients.

- the hub: `huggingface_hub.snapshot_download`, only what training reads (a model's config,
  tokenizer, chat template and safetensors weights; a dataset's data files of the train
  split). Failures are sorted by `kubetune_trainer.hub` (refused or missing: permanent; 429,
  5xx, timeouts: retried, then transient).
- S3 (`s3://bucket/prefix` or `s3://bucket/key`): boto3, which reads AWS_ACCESS_KEY_ID,
  AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL from the environment (AWS_REGION is passed on).
  Every object under the prefix is downloaded with multipart ranged GETs; botocore retries
  requests (standard mode) and whole files are retried here with backoff.
- https: urllib streams the URL to a file.

Each fetcher writes into `dest` and leaves files a failed try finished in place, so the next
try (a restart of the pod) fetches only what is missing. Each finished file is reported to a
`Progress`, which prints one JSON line per file; the bytes of files still arriving are
reported to it too (S3: the transfer's callback; https: each chunk; the hub: the client's
`.incomplete` files), for the progress gauges.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from kubetune_trainer import hub
from kubetune_trainer.contract import DATA_SUFFIXES as SUFFIXES
from kubetune_trainer.errors import ConfigError, TrainerExit
from kubetune_trainer.hub import hub_call

log = logging.getLogger(__name__)

T = TypeVar("T")

S3_MAX_ATTEMPTS = 5
"""botocore's own tries of one request (standard retry mode)."""
S3_PARALLEL_FILES = 4
MiB = 1024**2
HTTP_TIMEOUT_S = 60.0


class SourceUnavailable(TrainerExit):
    """S3 or an https server could not be reached, or kept failing, after a few tries: a
    restart may find it well again (exit 1)."""


# --------------------------------------------------------------------------- progress


@dataclass
class Progress:
    """Counts finished files and bytes of one source; prints a JSON line per file. `in_flight`
    holds the bytes of files still arriving, by file."""

    what: str
    uri: str
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    downloaded_bytes: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def expect(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.files_total += files
            self.bytes_total += nbytes

    def moving(self, name: str, nbytes: int) -> None:
        """`nbytes` of file `name` have arrived so far (0: none, or none any more)."""
        with self._lock:
            if nbytes > 0:
                self.in_flight[name] = nbytes
            else:
                self.in_flight.pop(name, None)

    def counts(self) -> tuple[int, int, int, int]:
        """(files_done, files_total, bytes_done with the bytes still arriving, bytes_total)."""
        with self._lock:
            arriving = self.bytes_done + sum(self.in_flight.values())
            return self.files_done, self.files_total, arriving, self.bytes_total

    def done(self, name: str, nbytes: int, *, downloaded: bool = True) -> None:
        with self._lock:
            self.in_flight.pop(name, None)
            self.files_done += 1
            self.bytes_done += nbytes
            if downloaded:
                self.downloaded_bytes += nbytes
            line = {
                "event": "stagein_file",
                "what": self.what,
                "uri": self.uri,
                "file": name,
                "file_bytes": nbytes,
                "reused": not downloaded,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total,
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class Fetched:
    """What a fetcher found: the revision it resolved, and what a job reads ("." = all)."""

    commit: str | None = None
    target: str = "."


# --------------------------------------------------------------------------- retries


def causes(e: BaseException) -> list[BaseException]:
    """`e` and the errors it was raised from (clients wrap one another's errors)."""
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return seen


def retrying(
    fn: Callable[[], T],
    classify: Callable[[BaseException], ConfigError | str | None],
    *,
    what: str,
    uri: str,
) -> T:
    """`hub.retrying` for S3 and https: the last transient failure restarts the pod."""

    def gave_up(tries: int, detail: str) -> TrainerExit:
        return SourceUnavailable(
            f"{what} {uri}: failed {tries} times ({detail}); the pod is restarted and tries again"
        )

    return hub.retrying(fn, classify, what=what, uri=uri, gave_up=gave_up)


def _no_room(e: BaseException, what: str, uri: str) -> ConfigError | None:
    for err in causes(e):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return ConfigError(
                f"{what} {uri}: the cache volume is full ({err.strerror}). To fix: give the "
                "stage-in cache volume more room, or remove entries nobody uses"
            )
    return None


def prune(dest: Path, keep: set[str]) -> None:
    """Remove every file under `dest` that is not one of `keep` (relative paths)."""
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_file() and rel not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


# --------------------------------------------------------------------------- the hub

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "*.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""What training reads from a model repository besides the weights (top level only; no
`original/`, `onnx/`, `gguf` copies)."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
DATASET_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "state.json"})
_SPLIT_WORDS = {
    "train": ("train", "training"),
    "other": ("test", "testing", "eval", "evaluation", "validation", "valid", "val", "dev"),
}


def _matches(path: str, pattern: str) -> bool:
    return path.count("/") == pattern.count("/") and fnmatch(path, pattern)


def _split_of(path: str) -> str | None:
    words = re.split(r"[/_.\-\s]+", path.lower())
    for split, names in _SPLIT_WORDS.items():
        if any(w in names for w in words):
            return split
    return None


def select_model_files(files: dict[str, int]) -> list[str]:
    """The repository's small files a run reads (config, tokenizer, template, indexes)."""
    return sorted(p for p in files if any(_matches(p, pat) for pat in MODEL_FILES))


def select_weights(files: dict[str, int], dest: Path, what: str, uri: str) -> list[str]:
    """The weight files: the shards a safetensors index names, the single safetensors file,
    else every top-level one; only without safetensors the PyTorch `.bin` files."""
    for index, suffix in ((SAFETENSORS_INDEX, ".safetensors"), (BIN_INDEX, ".bin")):
        if index in files:
            try:
                weight_map = json.loads((dest / index).read_text())["weight_map"]
                shards = sorted({str(v) for v in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(
                    f"{what} {uri}: {index} is not a weight index ({e}). To fix: repair the "
                    "repository's index, or point model.uri at another revision"
                ) from e
            missing = [s for s in shards if s not in files]
            if missing:
                raise ConfigError(
                    f"{what} {uri}: {index} names shards the repository lacks ({missing[:3]}). "
                    "To fix: upload them, or point model.uri at another revision"
                )
            if suffix == ".safetensors" or not any(p.endswith(".safetensors") for p in files):
                return shards
    top = [p for p in files if "/" not in p]
    if "model.safetensors" in files:
        return ["model.safetensors"]
    safetensors = sorted(p for p in top if p.endswith(".safetensors"))
    if safetensors:
        return safetensors
    if "pytorch_model.bin" in files:
        return ["pytorch_model.bin"]
    raise ConfigError(
        f"{what} {uri}: no weights in the repository (looked for *.safetensors and "
        "pytorch_model.bin at the top level). To fix: point model.uri at a Hugging Face "
        "model repository with safetensors weights"
    )


def select_dataset_files(files: dict[str, int], what: str, uri: str) -> list[str]:
    """The data files the trainer reads (`contract.DATA_SUFFIXES`): of the train split only
    when file or folder names say which split a file is (as `load_dataset(split="train")`
    reads)."""
    data = [
        p
        for p in files
        if PurePosixPath(p).suffix in SUFFIXES
        and PurePosixPath(p).name not in DATASET_METADATA
        and not any(part.startswith(".") for part in PurePosixPath(p).parts)
    ]
    if not data:
        raise ConfigError(
            f"{what} {uri}: no data files in the repository (looked for "
            f"{', '.join(SUFFIXES)}). To fix: point dataset.uri at a dataset with JSONL, JSON, "
            "Parquet or text files"
        )
    train = [p for p in data if _split_of(p) == "train"]
    return sorted(train if train else [p for p in data if _split_of(p) is None] or data)


HUB_ARRIVING = "<hub downloads in progress>"
"""The `Progress.in_flight` name of the bytes in the hub client's `.incomplete` files."""


class _Watch:
    """Reports the files a hub download finishes: the client renames each into place whole,
    so a file at its final path is done; until then it grows in an `.incomplete` file under
    `dest/.cache/huggingface/download/` (counted as arriving, at most what is pending)."""

    def __init__(self, dest: Path, files: dict[str, int], progress: Progress) -> None:
        self.dest = dest
        self.pending = dict(files)
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagein-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.scan()

    def scan(self) -> None:
        for name, size in list(self.pending.items()):
            if (self.dest / name).is_file():
                del self.pending[name]
                self.progress.done(name, size)
        arriving = 0
        for part in (self.dest / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
            with contextlib.suppress(OSError):  # renamed into place meanwhile
                arriving += part.stat().st_size
        self.progress.moving(HUB_ARRIVING, min(arriving, sum(self.pending.values())))

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self.scan()
        self.progress.moving(HUB_ARRIVING, 0)


def fetch_hub(
    repo_id: str,
    *,
    repo_type: str,
    revision: str | None,
    token: str | None,
    token_env: str | None,
    field: str,
    what: str,
    dest: Path,
    progress: Progress,
    early: Callable[[Path], None] | None = None,
) -> Fetched:
    """Download what training reads of a hub repository into `dest`; a model's `early`
    check runs once its config.json is in, before the weights are fetched."""
    import huggingface_hub
    from huggingface_hub.hf_api import RepoFile

    hub: Any = huggingface_hub
    api = hub.HfApi(token=token)

    def call(fn: Callable[[], T]) -> T:
        try:
            return hub_call(
                fn, what=what, uri=repo_id, field=field, revision=revision, token_env=token_env
            )
        except OSError as e:
            room = _no_room(e, what, repo_id)
            if room is None:
                raise
            raise room from e

    def listing() -> tuple[str, dict[str, int]]:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=revision)
        tree = api.list_repo_tree(repo_id, repo_type=repo_type, revision=info.sha, recursive=True)
        return str(info.sha), {f.path: int(f.size) for f in tree if isinstance(f, RepoFile)}

    commit, files = call(listing)
    meta_dir = dest / ".cache" / "kubetune-hf"

    def complete(name: str) -> bool:
        path = dest / name
        return path.is_file() and path.stat().st_size == files[name]

    def snapshot(names: list[str]) -> None:
        hub.snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=commit,
            token=token,
            local_dir=str(dest),
            cache_dir=str(meta_dir),
            allow_patterns=[_glob_escape(n) for n in names],
        )
        # The client returns a non-empty local_dir as it is when the hub cannot be asked.
        missing = [n for n in names if not complete(n)]
        if missing:
            raise ConnectionError(f"the download stopped short of {missing[:3]}")

    def download(names: list[str]) -> None:
        todo = {n: files[n] for n in names if not complete(n)}
        for name in names:
            if name not in todo:
                progress.done(name, files[name], downloaded=False)  # a previous try's
        if not todo:
            return
        with _Watch(dest, todo, progress):
            call(lambda: snapshot(list(todo)))

    if repo_type == "model":
        small = select_model_files(files)
        progress.expect(len(small), sum(files[n] for n in small))
        download(small)
        if early is not None:
            early(dest)
        weights = select_weights(files, dest, what, repo_id)
        progress.expect(len(weights), sum(files[n] for n in weights))
        download(weights)
        fetched = {*small, *weights}
    else:
        names = select_dataset_files(files, what, repo_id)
        progress.expect(len(names), sum(files[n] for n in names))
        download(names)
        fetched = set(names)
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # the client's bookkeeping
    prune(dest, fetched)
    return Fetched(commit=commit)


def check_hub_access(
    repo_id: str,
    *,
    repo_type: str,
    commit: str | None,
    path: str,
    token: str | None,
    token_env: str | None,
    field: str,
    what: str,
) -> None:
    """Whether this job's token may read `path` of the repository (a HEAD, no download): a
    gated or private repository in the cache is not served to a job that could not fetch it."""
    import huggingface_hub

    hub: Any = huggingface_hub
    url = hub.hf_hub_url(repo_id, path, repo_type=repo_type, revision=commit)
    hub_call(
        lambda: hub.get_hf_file_metadata(url, token=token),
        what=what,
        uri=repo_id,
        field=field,
        revision=commit,
        token_env=token_env,
    )


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


# --------------------------------------------------------------------------- S3

S3_AUTH = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidToken",
        "ExpiredToken",
        "InvalidSecurity",
        "AuthorizationHeaderMalformed",
        "403",
        "Forbidden",
    }
)
S3_TRANSIENT = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ServerBusy",
    }
)


def parse_s3(uri: str, field: str) -> tuple[str, str]:
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"{field} {uri}: not an s3://bucket/prefix URI. To fix: write it so")
    return parsed.netloc, parsed.path.lstrip("/")


def _s3_fix(bucket: str, may: str = "list and read") -> str:
    return (
        "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the Secret the job names (and "
        "AWS_ENDPOINT_URL and AWS_REGION for an S3-compatible store), and that they may "
        f"{may} bucket {bucket}"
    )


def classify_s3(
    e: BaseException, *, what: str, uri: str, bucket: str, field: str, may: str = "list and read"
) -> ConfigError | str | None:
    """The ConfigError of a permanent failure, what happened in a transient one, or None:
    not S3's doing. `may` is what the credentials must be allowed to do with the bucket (for
    the "To fix:" of a refusal)."""
    from boto3.exceptions import RetriesExceededError as Boto3RetriesExceeded
    from botocore import exceptions as bx
    from s3transfer.exceptions import RetriesExceededError

    room = _no_room(e, what, uri)
    if room is not None:
        return room
    for err in causes(e):
        if isinstance(err, bx.ClientError):
            error = err.response.get("Error", {})
            code = str(error.get("Code", ""))
            message = str(error.get("Message", "")) or code
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            said = f"{code}: {message}" if message != code else code
            if code in S3_AUTH or status in (401, 403):
                return ConfigError(
                    f"{what} {uri}: S3 refused access ({said}). To fix: {_s3_fix(bucket, may)}"
                )
            if code == "NoSuchBucket":
                return ConfigError(
                    f"{what} {uri}: there is no bucket {bucket!r} ({said}). To fix: check the "
                    f"bucket in {field} (and AWS_ENDPOINT_URL for an S3-compatible store)"
                )
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return ConfigError(
                    f"{what} {uri}: an object is missing ({said}; removed while it was "
                    f"fetched?). To fix: check {field} and that the objects under it stay put"
                )
            if code in S3_TRANSIENT or status >= 500 or status == 429:
                return f"S3 error {said} (HTTP {status})"
            return ConfigError(
                f"{what} {uri}: S3 answered {said} (HTTP {status}). To fix: check {field} and "
                "the bucket's settings"
            )
        if isinstance(err, bx.NoCredentialsError | bx.PartialCredentialsError):
            return ConfigError(
                f"{what} {uri}: no S3 credentials ({err}). To fix: {_s3_fix(bucket, may)}"
            )
        if isinstance(err, bx.HTTPClientError | bx.ResponseStreamingError):
            return f"{type(err).__name__}: {err}"
        if isinstance(err, bx.IncompleteReadError | RetriesExceededError | Boto3RetriesExceeded):
            return f"{type(err).__name__}: {err}"
        if isinstance(err, ConnectionError | TimeoutError | socket.timeout):
            return f"{type(err).__name__}: {err}"
    return None


S3_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
)
"""What an S3 client's credentials, region and endpoint come from."""


@functools.lru_cache(maxsize=4)
def _s3_session(env: tuple[str | None, ...]) -> Any:
    """A boto3 session for these settings (boto3's default session keeps the credentials it
    read first, even after the environment changes)."""
    import boto3

    region = dict(zip(S3_ENV, env, strict=True))["AWS_REGION"]
    return boto3.session.Session(region_name=region or None)


def s3_client() -> Any:
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS},
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=32,
    )
    session = _s3_session(tuple(os.environ.get(k) for k in S3_ENV))
    return session.client("s3", config=config)


def transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=16 * MiB,
        multipart_chunksize=16 * MiB,
        max_concurrency=8,
        use_threads=True,
    )


def _relative(key: str, folder: str, what: str, uri: str) -> str:
    rel = key[len(folder) :]
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or ".." in parts:
        raise ConfigError(
            f"{what} {uri}: object key {key!r} cannot be a file name. To fix: rename the object"
        )
    return rel


def check_s3_access(uri: str, key: str, *, what: str, field: str) -> None:
    """Whether this job's credentials may read object `key` of the bucket (a HEAD, no
    download): an object in the cache is not served to a job that could not fetch it."""
    bucket, _ = parse_s3(uri, field)
    client = s3_client()
    retrying(
        lambda: client.head_object(Bucket=bucket, Key=key),
        lambda e: classify_s3(e, what=what, uri=uri, bucket=bucket, field=field),
        what=what,
        uri=uri,
    )


def s3_key(uri: str, target: str, first_file: str, field: str) -> str:
    """The key of an entry's file: the object itself, or the first one under the prefix."""
    _, prefix = parse_s3(uri, field)
    if target != ".":
        return prefix
    folder = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    return folder + first_file


def fetch_s3(
    uri: str,
    *,
    what: str,
    field: str,
    dest: Path,
    progress: Progress,
    early: Callable[[Path], None] | None = None,
) -> Fetched:
    """Download the object `uri` names, or every object under it (a folder), into `dest`;
    `early` runs once a top-level config.json is in, before the other objects."""
    bucket, prefix = parse_s3(uri, field)
    client = s3_client()

    def classify(e: BaseException) -> ConfigError | str | None:
        return classify_s3(e, what=what, uri=uri, bucket=bucket, field=field)

    def listing() -> list[dict[str, Any]]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    found = retrying(listing, classify, what=what, uri=uri)
    single = [o for o in found if prefix and o["Key"] == prefix]
    target = "."
    if single:
        name = PurePosixPath(prefix).name
        objects = {name: single[0]}
        target = name
    else:
        folder = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        objects = {
            _relative(o["Key"], folder, what, uri): o
            for o in found
            if o["Key"].startswith(folder) and not o["Key"].endswith("/")
        }
    if not objects:
        raise ConfigError(
            f"{what} {uri}: no objects under it in bucket {bucket!r}. To fix: check {field} "
            "(the bucket and the prefix), or upload the files there"
        )
    progress.expect(len(objects), sum(int(o["Size"]) for o in objects.values()))
    config = transfer_config()

    def one(name: str, obj: dict[str, Any]) -> None:
        path = dest / name
        size = int(obj["Size"])
        if path.is_file() and path.stat().st_size == size:
            progress.done(name, size, downloaded=False)  # a previous try finished it
            return
        path.parent.mkdir(parents=True, exist_ok=True)

        arrived = [0]

        def callback(nbytes: int) -> None:  # negative when the transfer retries a part
            arrived[0] += nbytes
            progress.moving(name, arrived[0])

        def get() -> None:
            arrived[0] = 0
            progress.moving(name, 0)
            client.download_file(bucket, obj["Key"], str(path), Config=config, Callback=callback)
            got = path.stat().st_size
            if got != size:
                raise ConnectionError(f"s3://{bucket}/{obj['Key']}: {got} of {size} bytes")

        retrying(get, classify, what=what, uri=f"s3://{bucket}/{obj['Key']}")
        progress.done(name, size)

    rest = dict(objects)
    if early is not None and "config.json" in rest:
        one("config.json", rest.pop("config.json"))
        early(dest)
    with ThreadPoolExecutor(S3_PARALLEL_FILES, thread_name_prefix="stagein-s3") as pool:
        futures = [pool.submit(one, n, o) for n, o in sorted(rest.items())]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in finished if f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            failed[0].result()
    prune(dest, set(objects))  # what a killed try's transfers left half-written
    return Fetched(target=target)


# --------------------------------------------------------------------------- https


def classify_https(
    e: BaseException, *, what: str, uri: str, field: str
) -> ConfigError | str | None:
    room = _no_room(e, what, uri)
    if room is not None:
        return room
    for err in causes(e):
        if isinstance(err, urllib.error.HTTPError):
            if err.code in (408, 425, 429) or err.code >= 500:
                return f"HTTP {err.code} {err.reason}"
            fix = {
                401: "the URL needs credentials: put the data where the job can read it "
                "(a signed URL, S3, the hub or a volume)",
                403: "the server refuses to serve it: use a URL the job may read",
                404: f"check {field}",
                410: f"check {field}",
            }.get(err.code, f"check {field}")
            return ConfigError(
                f"{what} {uri}: the server answered HTTP {err.code} {err.reason}. To fix: {fix}"
            )
        if isinstance(err, urllib.error.URLError | http.client.HTTPException):
            return f"{type(err).__name__}: {err}"
        if isinstance(err, ConnectionError | TimeoutError | socket.timeout):
            return f"{type(err).__name__}: {err}"
    return None


def fetch_https(uri: str, *, what: str, field: str, dest: Path, progress: Progress) -> Fetched:
    """Stream the file at `uri` into `dest/<its name>`."""
    parsed = urllib.parse.urlsplit(uri)
    name = urllib.parse.unquote(PurePosixPath(parsed.path).name)
    if parsed.scheme not in ("https", "http") or not parsed.netloc:
        raise ConfigError(f"{what} {uri}: not an https:// URL. To fix: correct {field}")
    if PurePosixPath(name).suffix not in SUFFIXES or name.startswith("."):
        raise ConfigError(
            f"{what} {uri}: the URL's path does not end in a data file name ({', '.join(SUFFIXES)})"
            f", so its format is unknown. To fix: point {field} at a URL ending in one"
        )
    path = dest / name
    part = dest / f".{name}.part"

    def get() -> int:
        request = urllib.request.Request(uri, headers={"User-Agent": "kubetune-stagein"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            if length is not None and progress.bytes_total == 0:
                progress.expect(0, int(length))
            got = 0
            progress.moving(name, 0)
            with part.open("wb") as fh:
                while chunk := response.read(MiB):
                    fh.write(chunk)
                    got += len(chunk)
                    progress.moving(name, got)
        got = part.stat().st_size
        if length is not None and got != int(length):
            raise ConnectionError(f"{got} of {length} bytes arrived")
        os.replace(part, path)
        return got

    progress.expect(1, 0)
    size = retrying(
        get,
        lambda e: classify_https(e, what=what, uri=uri, field=field),
        what=what,
        uri=uri,
    )
    progress.done(name, size)
    prune(dest, {name})
    return Fetched(target=name)
