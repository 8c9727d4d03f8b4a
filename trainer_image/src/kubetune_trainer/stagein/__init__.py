"""Stage-in: fetch, check and measure a job's model and dataset before any GPU is asked for.

    python -m kubetune_trainer.stagein --config /etc/kubetune/stagein.json

runs in a CPU-only pod with the shared cache volume at `StageInConfig.cache_dir`. It fetches
the dataset and the model into the cache (`cache`: once per source and revision, whichever
job asks first; `fetch`: the hub, S3, https, with failures sorted into permanent and
transient), checks them and measures the dataset with the model's tokenizer through the
trainer's own data code (`check`), and writes a `StageInResult` to `result_path` and, as
compact JSON, to the termination message (`__main__`). While it runs, its progress (bytes and
files staged of those to stage) is served as Prometheus gauges on `metrics_port`
(`progress`); once staged, least-recently-used entries other jobs do not read are evicted
down to `cache_max_bytes` (`evict`).

Exit codes: 0 staged; EXIT_CONFIG_ERROR (2) a permanent failure (no access, no such
repository, bucket or object, bad data, another architecture than planned), with what,
where and "To fix:" in the termination message; 1 a transient one after retries (the
batch Job runs the pod again, which resumes the fetch) or a crash.
"""

from __future__ import annotations

from typing import Any

from kubetune_trainer.stagein.cache import CacheEntry, cache_entries, cache_key

__all__ = ["CacheEntry", "cache_entries", "cache_key", "stage_in"]


def __getattr__(name: str) -> Any:
    # `stage_in` on first use: it imports the trainer's data code and torch, which the
    # stage-out and export steps (they use `fetch` and `__main__` of this package) do not need.
    if name == "stage_in":
        from kubetune_trainer.stagein.stage import stage_in

        return stage_in
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
