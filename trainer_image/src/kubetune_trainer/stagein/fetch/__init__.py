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

The modules: `base` (what every source shares: progress, retries, pruning), `hub`, `s3` and
`https` (one source each).
"""

from __future__ import annotations

from kubetune_trainer.stagein.fetch.base import (
    Fetched,
    MiB,
    Progress,
    SourceUnavailable,
    causes,
    prune,
    retrying,
)
from kubetune_trainer.stagein.fetch.https import HTTP_TIMEOUT_S, classify_https, fetch_https
from kubetune_trainer.stagein.fetch.hub import (
    BIN_INDEX,
    DATASET_METADATA,
    HUB_ARRIVING,
    MODEL_FILES,
    SAFETENSORS_INDEX,
    check_hub_access,
    fetch_hub,
    hub_commit,
    select_dataset_files,
    select_model_files,
    select_weights,
)
from kubetune_trainer.stagein.fetch.s3 import (
    S3_AUTH,
    S3_ENV,
    S3_MAX_ATTEMPTS,
    S3_PARALLEL_FILES,
    S3_TRANSIENT,
    check_s3_access,
    classify_s3,
    fetch_s3,
    parse_s3,
    s3_client,
    s3_key,
    s3_versions,
    transfer_config,
)

__all__ = [
    "BIN_INDEX",
    "DATASET_METADATA",
    "HTTP_TIMEOUT_S",
    "HUB_ARRIVING",
    "MODEL_FILES",
    "S3_AUTH",
    "S3_ENV",
    "S3_MAX_ATTEMPTS",
    "S3_PARALLEL_FILES",
    "S3_TRANSIENT",
    "SAFETENSORS_INDEX",
    "Fetched",
    "MiB",
    "Progress",
    "SourceUnavailable",
    "causes",
    "check_hub_access",
    "check_s3_access",
    "classify_https",
    "classify_s3",
    "fetch_https",
    "fetch_hub",
    "fetch_s3",
    "hub_commit",
    "parse_s3",
    "prune",
    "retrying",
    "s3_client",
    "s3_key",
    "s3_versions",
    "select_dataset_files",
    "select_model_files",
    "select_weights",
    "transfer_config",
]
