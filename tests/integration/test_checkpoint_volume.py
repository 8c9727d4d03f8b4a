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
        "metadata": {
            "name": name,
            "labels": {"kubetune.io/job": job},
            "annotations": {
                "kubetune.io/job-uid": f"uid-of-an-earlier-{job}",
                "kubetune.io/retention": "retain",
            },
        },
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


def events_of(cluster: Cluster, namespace: str, name: str) -> str:
    return cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    ).stdout


def test_a_checkpoint_volume_too_small_for_the_plan_grows_where_its_class_allows(
    cluster: Cluster, namespace: str, operator: Path, tmp_path: Path
) -> None:
    """Claims of 1Gi kept from earlier jobs of the same names; the plan needs more (the hub
    model's cache lives on the volume). On a class that allows expansion the operator raises
    the claim's request; on one that does not (the local provisioner's) it warns."""
    storage_class = f"expandable-{namespace}"
    volume = f"grow-{namespace}"
    try:
        out = cluster.apply(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": storage_class},
                "provisioner": "kubernetes.io/no-provisioner",
                "allowVolumeExpansion": True,
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": storage_class,
                    "hostPath": {"path": str(tmp_path / "grow")},
                    "claimRef": {"namespace": namespace, "name": "grow-ckpt"},
                },
            },
        )
        assert out.returncode == 0, out.stderr
        grow = claim("grow-ckpt", "grow", "ReadWriteOnce")
        grow["spec"]["storageClassName"] = storage_class
        small = claim("small-ckpt", "small", "ReadWriteOnce")
        out = cluster.apply(grow, small, namespace=namespace)
        assert out.returncode == 0, out.stderr

        def pvc(name: str) -> dict[str, Any]:
            return cluster.get("pvc", name, namespace) or {"spec": {}, "status": {}}

        for name in ("grow-ckpt", "small-ckpt"):
            wait_for(f"{name} bound", lambda n=name: pvc(n)["status"].get("phase") == "Bound", 30)
        out = cluster.apply(job_doc("grow"), job_doc("small"), namespace=namespace)
        assert out.returncode == 0, out.stderr

        def request(name: str) -> str:
            return str(pvc(name)["spec"]["resources"]["requests"]["storage"])

        def volume_event(job: str) -> str:
            text = events_of(cluster, namespace, job)
            return text if "CheckpointVolume" in text else ""

        wait_for("grow-ckpt's request raised", lambda: request("grow-ckpt") != "1Gi", 60)
        assert "CheckpointVolumeExpanded" in wait_for("the event", lambda: volume_event("grow"))
        warned = wait_for("the warning about small-ckpt", lambda: volume_event("small"))
        assert "CheckpointVolumeMayBeTooSmall" in warned
        assert request("small-ckpt") == "1Gi"
    finally:
        cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)
        cluster.kubectl("delete", "storageclass", storage_class, check=False)
