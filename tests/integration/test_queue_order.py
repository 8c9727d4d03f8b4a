"""The queue for GPUs against the real apiserver and scheduler: 100 jobs, 16 GPUs.

A pool of its own (two kwok nodes × 8 GPUs, priced so that no other test's job picks it)
is first filled by two plain pods holding every GPU, so every job queues. Then the
positions the operator reports must follow the stated order (priority, then creation,
then name); once the pods go, every job must run in that order without the scheduler ever
being asked for a GPU that is not free.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kubetune_dev.cluster import simulated_nodes
from support.cluster import Cluster, job_doc, private_pool
from support.podsecurity import RESTRICTED_CONTAINER
from support.waiting import wait_for

pytestmark = pytest.mark.integration

POOL = "qpool"
JOBS = 100
GPUS = (1, 2, 4, 8)
POSITION = re.compile(r"position (\d+) in the queue of pool " + POOL)


def pool_doc() -> dict[str, Any]:
    return private_pool(POOL, nodes=2)


@pytest.fixture
def qpool(cluster: Cluster) -> Iterator[list[dict[str, Any]]]:
    nodes = simulated_nodes(pool_doc())
    assert cluster.apply(pool_doc(), *nodes).returncode == 0
    yield nodes
    cluster.kubectl("delete", "gpupool", POOL, "--wait=false", check=False)
    for node in nodes:
        cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)


def hog(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"hog-{i}"},
        "spec": {
            "nodeSelector": {"kubetune.io/pool": POOL},
            "containers": [
                {
                    "name": "hog",
                    "image": "busybox",
                    "resources": {"limits": {"nvidia.com/gpu": "8"}},
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
        },
    }


def job(i: int) -> dict[str, Any]:
    doc = job_doc(
        f"q-{i:03d}",
        resources={
            "pools": [POOL],
            "gpus": GPUS[i % len(GPUS)],
            "priority": 5 if i % 10 == 9 else 0,
        },
    )
    return doc


def gpus_asked(pod: dict[str, Any]) -> int:
    return sum(
        int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in pod["spec"]["containers"]
    )


def pod_line(pod: dict[str, Any]) -> str:
    """One pod as a failure message shows it: what it asks, where, since when, in which state."""
    meta, status = pod["metadata"], pod["status"]
    scheduled = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
    )
    return (
        f"{meta['name']} gpus={gpus_asked(pod)} node={pod['spec'].get('nodeName')} "
        f"phase={status.get('phase')} created={meta['creationTimestamp']} "
        f"deleting={meta.get('deletionTimestamp')} scheduled={scheduled.get('status')}/"
        f"{scheduled.get('reason')}@{scheduled.get('lastTransitionTime')}"
    )


def order(obj: dict[str, Any]) -> tuple[int, str, str]:
    meta, spec = obj["metadata"], obj["spec"]
    return (-int(spec["resources"].get("priority", 0)), meta["creationTimestamp"], meta["name"])


def test_jobs_queue_in_order_and_never_ask_for_gpus_that_are_not_free(
    cluster: Cluster, namespace: str, operator: Path, qpool: list[dict[str, Any]]
) -> None:
    assert cluster.apply(hog(0), hog(1), namespace=namespace).returncode == 0
    wait_for(
        "the hogs to hold every GPU of the pool",
        lambda: (
            (cluster.get("gpupool", POOL) or {}).get("status", {}).get("freeGPUs") == 0
            and (cluster.get("gpupool", POOL) or {}).get("status", {}).get("nodes") == 2
        ),
        60,
    )
    assert cluster.apply(*(job(i) for i in range(JOBS)), namespace=namespace).returncode == 0

    def positions() -> dict[str, int] | None:
        items = cluster.list("finetunejob", namespace)
        found = {}
        for obj in items:
            match = POSITION.search((obj.get("status") or {}).get("message") or "")
            if (obj.get("status") or {}).get("phase") != "Queued" or match is None:
                return None
            found[obj["metadata"]["name"]] = int(match.group(1))
        return (
            found
            if len(found) == JOBS and sorted(found.values()) == list(range(1, JOBS + 1))
            else None
        )

    queued = wait_for("all jobs queued with settled positions", positions, 120)
    jobs = sorted(cluster.list("finetunejob", namespace), key=order)
    assert [queued[obj["metadata"]["name"]] for obj in jobs] == list(range(1, JOBS + 1))
    assert cluster.list("job.batch", namespace) == []  # nobody launched into busy GPUs

    cluster.kubectl(
        "delete", "pod", "hog-0", "hog-1", "-n", namespace, "--grace-period=0", "--force"
    )

    demand: list[int] = []
    over: list[str] = []  # the pods asking at the first look that found more than 16

    def all_succeeded() -> bool:
        # GPUs asked for by trainer pods that have not finished, bound or still pending.
        pods = cluster.list("pod", namespace, selector="kubetune.io/job")
        asking = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
        demand.append(sum(gpus_asked(p) for p in asking))
        if demand[-1] > 16 and not over:
            over.extend(pod_line(p) for p in asking)
        phases = [
            (o.get("status") or {}).get("phase") for o in cluster.list("finetunejob", namespace)
        ]
        assert "Failed" not in phases
        return phases.count("Succeeded") == JOBS

    wait_for("every job to succeed", all_succeeded, 300, interval=1)
    print(f"\nqueue: {JOBS} jobs through 16 GPUs; GPUs asked for at once: max {max(demand)}")
    assert max(demand) <= 16, (demand, "\n".join(over))

    # The stated order, as the batch Jobs were created. Creation times have a resolution of
    # one second, and a job admitted first may create its batch Job a moment after the next
    # one (each creates four objects): a job may not launch more than a second before any
    # job ahead of it.
    launched = {
        b["metadata"]["labels"]["kubetune.io/job"]: datetime.fromisoformat(
            b["metadata"]["creationTimestamp"]
        )
        for b in cluster.list("job.batch", namespace)
    }
    names = [o["metadata"]["name"] for o in jobs]
    latest_ahead = launched[names[0]]
    for name in names[1:]:
        assert launched[name] >= latest_ahead - timedelta(seconds=1), (name, launched[name])
        latest_ahead = max(latest_ahead, launched[name])
    assert len(cluster.list("job.batch", namespace)) == JOBS  # one launch each
