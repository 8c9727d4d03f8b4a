"""A job spans nodes only where its checkpoint volume can follow it (real apiserver, kwok).

The integration operator runs with KUBETUNE_CHECKPOINT_READ_WRITE_MANY unset (false), as
the chart by default: a job with `accessMode: auto` stays on one node. The checkpoint claim
the operator reads comes from its watch of claims labelled with a job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.cluster import Cluster, job_doc, wait_phase
from support.waiting import wait_for

pytestmark = pytest.mark.integration

# Sixteen GPUs of the h100 pool: two 8-GPU nodes.
WIDE: dict[str, Any] = {
    "resources": {"pools": ["h100"], "gpus": 16},
    "training": {"globalBatchSize": 16},
}


def claim(name: str, job: str, mode: str) -> dict[str, Any]:
    """A checkpoint claim as one kept (`retention: retain`) from an earlier job of the
    same name: named and labelled as the operator names and labels it."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": {"kubetune.io/job": job}},
        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}},
    }


def test_a_job_spans_nodes_only_where_its_checkpoint_volume_can_follow(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    rwx = {"checkpoint": {"storage": {"accessMode": "ReadWriteMany"}}}
    # A retained ReadWriteOnce volume of an earlier job of the same name: the new job
    # would mount it, so it may not span nodes even though its spec asks for ReadWriteMany.
    out = cluster.apply(claim("kept-ckpt", "kept", "ReadWriteOnce"), namespace=namespace)
    assert out.returncode == 0, out.stderr
    wait_for("the kept claim", lambda: cluster.get("pvc", "kept-ckpt", namespace), 30)
    out = cluster.apply(
        job_doc("wide", **WIDE, **rwx),
        job_doc("kept", **WIDE, **rwx),
        job_doc("auto", **WIDE),
        namespace=namespace,
    )
    assert out.returncode == 0, out.stderr

    wide = wait_phase(cluster, "wide", namespace, "Running", "Succeeded")
    assert wide["status"]["plan"]["nodes"] == 2
    pvc = wait_for("wide-ckpt", lambda: cluster.get("pvc", "wide-ckpt", namespace), 30)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

    kept = wait_phase(cluster, "kept", namespace, "Failed")
    message = kept["status"]["message"]
    assert "h100: spans 2 nodes, but its checkpoint volume kept-ckpt is ReadWriteOnce" in message
    assert "To fix:" in message and "new name" in message
    assert cluster.get("job.batch", "kept-a1", namespace) is None

    auto = wait_phase(cluster, "auto", namespace, "Failed")
    message = auto["status"]["message"]
    assert "spans 2 nodes, but its checkpoint volume would be ReadWriteOnce" in message
    assert "operator.checkpointReadWriteMany" in message
    assert cluster.get("pvc", "auto-ckpt", namespace) is None
