"""Stage-out: upload a finished run's output to S3.

    python -m kubetune_trainer.stageout --config /etc/kubetune/stageout.json

runs in a CPU-only pod once training succeeded, with the volume that holds the output mounted
read-only at `StageOutConfig.source_dir`. It uploads every file under it to the destination
(`upload`: boto3, large files in parts, each object's sha256 in its metadata), skipping the
objects a previous try left complete, and writes `UPLOAD_MANIFEST` last; the termination
message is the `StageOutResult` as compact JSON (`__main__`).

Exit codes: 0 uploaded; EXIT_CONFIG_ERROR (2) a permanent failure (no access, no such
bucket, nothing to upload), with what, where and "To fix:" in the termination message; 1 a
transient one after retries (the batch Job runs the pod again, which sends only what is
missing) or a crash.
"""

from __future__ import annotations

from kubetune_trainer.stageout.upload import stage_out

__all__ = ["stage_out"]
