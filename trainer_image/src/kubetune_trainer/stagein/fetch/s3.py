"""S3 (`s3://bucket/prefix` or `s3://bucket/key`): boto3, which reads AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL from the environment (AWS_REGION is passed on).
Every object under the prefix is downloaded with multipart ranged GETs; botocore retries
requests (standard mode) and whole files are retried here with backoff. The stage-out's
uploads use the same client and sort their failures the same way."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kubetune_trainer.errors import ConfigError
from kubetune_trainer.stagein.fetch.base import (
    Fetched,
    MiB,
    Progress,
    _no_room,
    causes,
    prune,
    retrying,
)
from kubetune_trainer.uris import Form, UriError, parse_uri

S3_MAX_ATTEMPTS = 5
"""botocore's own tries of one request (standard retry mode)."""
S3_PARALLEL_FILES = 4

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
    """The bucket and the key or prefix of an `s3://` URI; a ConfigError (the job's
    mistake, not retried) when it is not one."""
    try:
        parsed = parse_uri(uri, (Form.S3,), field=field)
    except UriError as e:
        raise ConfigError(str(e)) from None
    assert parsed.bucket is not None
    return parsed.bucket, parsed.path


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


@dataclass(frozen=True)
class _S3Download:
    """Downloads one object of `bucket` into `dest`, unless a previous try finished it."""

    client: Any
    bucket: str
    config: Any
    classify: Callable[[BaseException], ConfigError | str | None]
    what: str
    dest: Path
    progress: Progress

    def __call__(self, name: str, obj: dict[str, Any]) -> None:
        path = self.dest / name
        size = int(obj["Size"])
        if path.is_file() and path.stat().st_size == size:
            self.progress.done(name, size, downloaded=False)  # a previous try finished it
            return
        path.parent.mkdir(parents=True, exist_ok=True)

        arrived = [0]

        def callback(nbytes: int) -> None:  # negative when the transfer retries a part
            arrived[0] += nbytes
            self.progress.moving(name, arrived[0])

        def get() -> None:
            arrived[0] = 0
            self.progress.moving(name, 0)
            self.client.download_file(
                self.bucket, obj["Key"], str(path), Config=self.config, Callback=callback
            )
            got = path.stat().st_size
            if got != size:
                raise ConnectionError(f"s3://{self.bucket}/{obj['Key']}: {got} of {size} bytes")

        retrying(get, self.classify, what=self.what, uri=f"s3://{self.bucket}/{obj['Key']}")
        self.progress.done(name, size)


def _objects(
    found: list[dict[str, Any]], prefix: str, what: str, uri: str
) -> tuple[dict[str, dict[str, Any]], str]:
    """The objects to fetch by file name, and what a job reads: the object `prefix` names
    (its name), or every object under the folder `prefix` (".")."""
    single = [o for o in found if prefix and o["Key"] == prefix]
    if single:
        name = PurePosixPath(prefix).name
        return {name: single[0]}, name
    folder = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    objects = {
        _relative(o["Key"], folder, what, uri): o
        for o in found
        if o["Key"].startswith(folder) and not o["Key"].endswith("/")
    }
    return objects, "."


def _download_all(download: _S3Download, objects: dict[str, dict[str, Any]]) -> None:
    """`download` each object on S3_PARALLEL_FILES threads; the first failure cancels what
    has not started and is raised."""
    with ThreadPoolExecutor(S3_PARALLEL_FILES, thread_name_prefix="stagein-s3") as pool:
        futures = [pool.submit(download, n, o) for n, o in sorted(objects.items())]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in finished if f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            failed[0].result()


def _listed(client: Any, uri: str, *, what: str, field: str) -> tuple[dict[str, Any], str]:
    """The objects `uri` names, by file name, and what a job reads (see `_objects`)."""
    bucket, prefix = parse_s3(uri, field)

    def classify(e: BaseException) -> ConfigError | str | None:
        return classify_s3(e, what=what, uri=uri, bucket=bucket, field=field)

    def listing() -> list[dict[str, Any]]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    return _objects(retrying(listing, classify, what=what, uri=uri), prefix, what, uri)


def s3_versions(uri: str, *, what: str, field: str) -> dict[str, str]:
    """The ETag of each object `uri` names now, by file name (one LIST per 1,000 objects)."""
    objects, _ = _listed(s3_client(), uri, what=what, field=field)
    return {name: str(o.get("ETag", "")) for name, o in objects.items()}


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
    bucket, _ = parse_s3(uri, field)
    client = s3_client()

    def classify(e: BaseException) -> ConfigError | str | None:
        return classify_s3(e, what=what, uri=uri, bucket=bucket, field=field)

    objects, target = _listed(client, uri, what=what, field=field)
    if not objects:
        raise ConfigError(
            f"{what} {uri}: no objects under it in bucket {bucket!r}. To fix: check {field} "
            "(the bucket and the prefix), or upload the files there"
        )
    progress.expect(len(objects), sum(int(o["Size"]) for o in objects.values()))
    download = _S3Download(client, bucket, transfer_config(), classify, what, dest, progress)
    rest = dict(objects)
    if early is not None and "config.json" in rest:
        download("config.json", rest.pop("config.json"))
        early(dest)
    _download_all(download, rest)
    prune(dest, set(objects))  # what a killed try's transfers left half-written
    versions = {name: str(o.get("ETag", "")) for name, o in objects.items()}
    return Fetched(target=target, versions=versions)
