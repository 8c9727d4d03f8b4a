"""End to end on two nodes: a FineTuneJob planned as 2 nodes × 2 GPUs runs as two trainer
pods on two nodes that rendezvous through the job's headless Service (c10d) and train as one
FSDP2 world over gloo, with the checkpoint volume (ReadWriteMany) shared by both. One pod is
preempted mid-run: every rank checkpoints, both pods end, the operator starts the next attempt
and the run resumes on two nodes at the same step.

Then the same job on one node (2 GPUs, two micro-batches accumulated): the two loss curves
agree within the tolerance of a different data-parallel split.

On the local target the pool's two nodes are two more local pod runners (distinct pod IPs);
on kind, both workers (labelled for the pool while the test runs), with the checkpoint and
data claims on the ReadWriteMany class kubetune-shared (hack/kind-e2e.sh).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from support.e2e_jobs import delete_job, job_doc, status, train_log, wait_phase, wait_step
from support.e2e_targets import (
    NAMESPACE,
    POOL,
    POOL_NAME,
    REPORT,
    LocalTarget,
    Target,
)
from support.waiting import wait_for

# One worker runs both: a two-node job's rendezvous (c10d's TCPStore) listens on a fixed port
# (BuildSettings.rendezvous_port) on every address of the machine, which the local targets of
# one run (one per pytest-xdist worker) share.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("two-nodes")]

POOL_2N_NAME = "local-cpu-2n"
POOL_2N_LABEL = "kubetune.io/two-node-pool"
POOL_2N: dict[str, Any] = {
    **POOL,
    "metadata": {"name": POOL_2N_NAME},
    "spec": {
        **POOL["spec"],
        "nodeSelector": {POOL_2N_LABEL: "true"},
        "maxNodes": 2,
        # Dearer than the other pools: no other scenario's job is planned here.
        "pricePerGPUHour": 14.4,
    },
}
NODES_2N = ("local-2", "local-3")
STEPS, INTERVAL = 40, 10
CROSS_LAYOUT_TOLERANCE = 2e-3
"""fp32, 40 steps: four ranks sum gradients in another order than two ranks accumulating two
micro-batches each. The difference starts at rounding (7e-7 at step 2) and grows while Adam
normalises the tiny early gradients of the LoRA matrices (measured: 5.7e-4 at step 40 on
losses of 6.2); the trainer tier holds 10 steps to 1e-4. A wrong split of the data would show
at step 1, a wrong gradient scaling at step 2: those two are held to EARLY_TOLERANCE."""
EARLY_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_node_pool(target: Target) -> Iterator[list[str]]:
    """The pool's nodes: two more local pod runners, or kind's two workers."""
    if isinstance(target, LocalTarget):
        bases = {node: target.pod_ip_base(2 + i) for i, node in enumerate(NODES_2N)}
        target.cluster.add_local_pool(POOL_2N, nodes=bases)
        nodes = list(NODES_2N)
    else:
        nodes = list(target.nodes)
        for node in nodes:
            target.kubectl("label", "node", node, f"{POOL_2N_LABEL}=true", "--overwrite")
        target.kubectl("apply", "-f", "-", input=yaml.safe_dump(POOL_2N))

    def ready() -> bool:
        for node in nodes:
            obj = target.get("node", node) or {}
            conds = (obj.get("status") or {}).get("conditions") or []
            taints = (obj.get("spec") or {}).get("taints") or []
            if not any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                return False
            if any(t["key"].startswith("node.kubernetes.io/") for t in taints):
                return False
        return True

    wait_for("the two-node pool's nodes Ready", ready, 90)
    yield nodes
    target.kubectl("delete", "gpupool", POOL_2N_NAME, check=False)
    for node in nodes:
        if isinstance(target, LocalTarget):
            target.cluster.stop_component(f"podrunner-{node}")
            target.kubectl("delete", "node", node, "--wait=false", check=False)
        else:
            target.kubectl("label", "node", node, f"{POOL_2N_LABEL}-", check=False)


def two_node_job(name: str, pool: str, gpus: int) -> dict[str, Any]:
    return job_doc(
        name,
        steps=STEPS,
        interval=INTERVAL,
        training={"microBatchSize": 2, "precision": "fp32"},
        resources={"gpus": gpus, "pools": [pool]},
    )


def losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in records if r.get("event") == "step"}


def trainer_pods(target: Target, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in target.list("pods", f"kubetune.io/job={name}")
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


@pytest.mark.kubelet
def test_two_nodes_train_as_one_and_survive_a_preempted_pod(
    target: Target, two_node_pool: list[str]
) -> None:
    two, one = "two-nodes", "one-node"
    started = time.monotonic()
    target.apply(two_node_job(two, POOL_2N_NAME, 4))
    plan = wait_for("the two-node plan", lambda: status(target, two).get("plan"), 60)
    assert (plan["pool"], plan["nodes"], plan["gpusPerNode"]) == (POOL_2N_NAME, 2, 2), plan
    claim = target.get("persistentvolumeclaim", f"{two}-ckpt") or {}
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], claim["spec"]

    pods = wait_for(
        "two trainer pods running", lambda: len(p := trainer_pods(target, two)) == 2 and p, 120
    )
    nodes = {p["spec"]["nodeName"] for p in pods}
    ips = {p["status"]["podIP"] for p in pods}
    assert nodes == set(two_node_pool) and len(ips) == 2, (nodes, ips)

    def trained(step: int) -> bool:
        return max(losses(train_log(target, two)), default=0) >= step

    wait_for(f"{two} to train step {INTERVAL + 3}", lambda: trained(INTERVAL + 3), 300)
    # One node's pod preempted (deleted with a grace period): its SIGTERM reaches every rank.
    index = "batch.kubernetes.io/job-completion-index"
    victim = next(p for p in pods if p["metadata"]["annotations"].get(index) == "1")
    target.kubectl(
        "delete", "pod", victim["metadata"]["name"], "-n", NAMESPACE, "--grace-period=60",
        "--wait=false",
    )  # fmt: skip
    s = wait_phase(target, two, "Succeeded", timeout=600)
    seconds = time.monotonic() - started
    records = train_log(target, two)
    starts = [r for r in records if r.get("event") == "start"]
    assert len(starts) == 2, starts
    preempted = [int(r["step"]) for r in records if r.get("event") == "preempted"]
    match = re.search(r"step-(\d+)", starts[1].get("resumed_from") or "")
    assert preempted and match and int(match.group(1)) == preempted[0], (preempted, starts[1])
    # Every rank checkpointed and exited with the preemption code: each pod's end is
    # recorded, the two count as one preemption (reconcile.preemptions_without_progress),
    # and the next attempt starts once both have ended.
    recs = s["recoveries"]
    assert [r["reason"] for r in recs] == ["Preemption", "Preemption"], recs
    assert {r["pod"].rsplit("-", 2)[1] for r in recs} == {"0", "1"}, recs
    assert {r["attempt"] for r in recs} == {1} and s["attempt"] == 2 and s["plan"]["nodes"] == 2
    # The next attempt's pods ran on the two nodes again (2 GPUs a pod, 2 a node).
    done = [
        p
        for p in target.list("pods", f"kubetune.io/job={two}")
        if (p.get("status") or {}).get("phase") == "Succeeded"
    ]
    assert sorted(p["spec"]["nodeName"] for p in done) == sorted(two_node_pool), [
        (p["metadata"]["name"], p["spec"]["nodeName"]) for p in done
    ]

    # The same job on one node; after the first, as on kind the pools share the workers.
    target.apply(two_node_job(one, POOL_NAME, 2))
    wait_phase(target, one, "Succeeded", timeout=600)
    curve_two, curve_one = losses(records), losses(train_log(target, one))
    assert sorted(curve_two) == sorted(curve_one) == list(range(1, STEPS + 1))
    diff = max(abs(curve_two[k] - curve_one[k]) for k in curve_one)
    early = max(abs(curve_two[k] - curve_one[k]) for k in (1, 2))
    REPORT.append(
        f"two nodes × 2 ranks (pod IPs {sorted(ips)}): preempted at step {preempted[0]}, resumed "
        f"there on two nodes, 0 steps lost, {seconds:.0f}s; |loss diff| vs one node: steps 1-2 "
        f"{early:.1e}, max {diff:.1e}"
    )
    assert early <= EARLY_TOLERANCE, (early, curve_two, curve_one)
    assert diff <= CROSS_LAYOUT_TOLERANCE, (diff, curve_two, curve_one)
    delete_job(target, two)
    delete_job(target, one)


@pytest.mark.kubelet
def test_a_lost_node_is_reported_and_the_job_resumes_on_another_once_it_is_removed(
    target: Target, two_node_pool: list[str]
) -> None:
    """A node dies with its trainer (local: its pod runner SIGKILLed; kind: its container
    killed): nothing reports the pod's end any more. The operator says so (Running=False,
    NodeNotReady, with the fix); once the Node object is deleted, as a cloud provider does for
    a vanished machine, the pod is garbage-collected, the batch Job replaces it on the pool's
    other node, and the run resumes from its last checkpoint."""
    name = "node-lost"
    target.apply(two_node_job(name, POOL_2N_NAME, 2))
    pod = wait_for("a running trainer pod", lambda: trainer_pods(target, name), 120)[0]
    node = pod["spec"]["nodeName"]
    wait_step(target, name, INTERVAL + 3, timeout=300)
    how = target.lose_node(node)
    killed = time.monotonic()

    def reported() -> dict[str, Any] | None:
        s = status(target, name)
        running = next((c for c in s.get("conditions") or [] if c["type"] == "Running"), {})
        return s if running.get("reason") == "NodeNotReady" else None

    s = wait_for("NodeNotReady in the status", reported, 180)
    noticed = time.monotonic() - killed
    assert f"is on node {node}, not Ready" in s["message"], s["message"]
    assert "To fix: if the machine is lost, delete the Node object" in s["message"]
    target.kubectl("delete", "node", node)
    deleted = time.monotonic()
    try:
        s = wait_phase(target, name, "Succeeded", timeout=600)
        recovered = time.monotonic() - deleted
    finally:
        try:
            target.restore_node(node)
        except AssertionError as exc:  # the cluster is left one node short: say so, go on
            REPORT.append(f"node {node} was not brought back after the node-loss test: {exc}")
    records = train_log(target, name)
    starts = [r for r in records if r.get("event") == "start"]
    assert len(starts) == 2, starts
    match = re.search(r"step-(\d+)", starts[1].get("resumed_from") or "")
    before = max(int(r["step"]) for r in records[: records.index(starts[1])] if "loss" in r)
    assert match and 0 < int(match.group(1)) <= before, (match, before)
    lost = before - int(match.group(1))
    assert lost <= INTERVAL, lost
    assert sorted(losses(records)) == list(range(1, STEPS + 1))
    other = next(n for n in two_node_pool if n != node)
    done = [
        p
        for p in target.list("pods", f"kubetune.io/job={name}")
        if (p.get("status") or {}).get("phase") == "Succeeded"
    ]
    assert [p["spec"]["nodeName"] for p in done] == [other], done
    REPORT.append(
        f"node lost at step {before} ({how}): NodeNotReady in status after "
        f"{noticed:.0f}s; Node deleted → resumed at step {match.group(1)} on {other}, "
        f"{lost} steps lost, Succeeded {recovered:.0f}s after the deletion"
    )
    delete_job(target, name)
