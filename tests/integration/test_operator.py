"""The operator against a real kube-apiserver, scheduler and Job/GC controllers.

Trainer pods land on kwok nodes (simulated GPU pools), which run and complete them
without executing anything: these tests are about the Kubernetes side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune_dev.cluster import simulated_nodes
from support.cluster import Cluster, job_doc, private_pool, wait_phase
from support.podsecurity import RESTRICTED_CONTAINER
from support.waiting import wait_for

pytestmark = pytest.mark.integration


def phase(cluster: Cluster, name: str, ns: str) -> str | None:
    obj = cluster.get("finetunejob", name, ns)
    return ((obj or {}).get("status") or {}).get("phase")


# ---------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"method": "full", "lora": {"rank": 8}}, "spec.lora is only valid with method lora"),
        ({"resources": {"deadline": "0s"}}, "deadline must be longer than zero"),
        ({"resources": {"gpus": 0}}, "positive integer or 'auto'"),
        ({"resources": {"gpus": "lots"}}, "positive integer or 'auto'"),
        ({"training": {"globalBatchSize": 10, "microBatchSize": 4}}, "multiple of"),
        ({"method": "dpo"}, 'Unsupported value: "dpo"'),
        ({"resources": {"maxCostUSD": 0}}, "maxCostUSD"),
        ({"output": {"gguf": {"quantization": "q8_0"}}}, "spec.output.gguf needs a whole model"),
        ({"method": "full", "output": {"gguf": {"quantization": "q3"}}}, 'Unsupported value: "q3"'),
    ],
)
def test_admission_rejects_bad_specs(
    cluster: Cluster, namespace: str, over: dict[str, Any], message: str
) -> None:
    out = cluster.apply(job_doc("bad", **over), namespace=namespace)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_admission_takes_a_known_gpu_by_name_and_wants_numbers_for_others(
    cluster: Cluster,
) -> None:
    def pool(name: str, gpu: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "kubetune.io/v1alpha1",
            "kind": "GPUPool",
            "metadata": {"name": name},
            "spec": {
                # No node carries this label: the pools exist, and nothing lands on them.
                "nodeSelector": {"kubetune.io/pool": name},
                "gpu": gpu,
                "gpusPerNode": 8,
                "maxNodes": 1,
                "pricePerGPUHour": 999.0,
            },
        }

    try:
        out = cluster.apply(pool("by-name-h200", {"product": "NVIDIA-H200"}))
        assert out.returncode == 0, out.stderr
        stored = cluster.get("gpupool", "by-name-h200")
        assert stored is not None
        # Stored as written: no schema default stands in for the product's figures.
        assert stored["spec"]["gpu"] == {"product": "NVIDIA-H200"}
        out = cluster.apply(pool("by-name-b200", {"product": "NVIDIA-B200", "memoryGiB": 180}))
        assert out.returncode != 0
        assert "spec.gpu.memoryGiB and spec.gpu.bf16TFLOPS are required" in out.stderr
        assert "NVIDIA-H200" in out.stderr
    finally:
        # Waited for: a pool still being deleted would show in the next tests' pool lists.
        cluster.kubectl(
            "delete", "gpupool", "by-name-h200", "--ignore-not-found", "--timeout=60s", check=False
        )


def test_plan_from_the_cluster_uses_its_pools(cluster: Cluster, tmp_path: Path) -> None:
    """`kubetune plan --from-cluster` against the real apiserver, as a user runs it."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_doc("planned-offline")))
    names = set(cluster.kubectl("get", "gpupools", "-o", "name").stdout.split())
    pools = {n.split("/", 1)[1] for n in names}
    assert pools, "the session's cluster has GPUPools"
    env = {**os.environ, "KUBECONFIG": "/nonexistent"}  # only --kubeconfig may count
    argv = [sys.executable, "-m", "kubetune.cli", "plan", str(job), "--from-cluster"]
    argv += ["--kubeconfig", str(cluster.local.kubeconfig)]

    table = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    plan = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=env, timeout=60)

    assert table.returncode == 0, table.stdout + table.stderr
    assert f"pools: {len(pools)} from the cluster, with their free GPUs now" in table.stdout
    assert json.loads(plan.stdout)["pool"] in pools
    wrong = subprocess.run(
        [*argv[:-2], "--kubeconfig", str(tmp_path / "missing")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert wrong.returncode != 0
    assert "cannot read the cluster's GPUPools" in wrong.stdout + wrong.stderr


def test_get_and_pools_read_the_cluster(cluster: Cluster, namespace: str) -> None:
    """`kubetune get` and `kubetune pools` against the real apiserver, as a user runs them."""
    out = cluster.apply(job_doc("listed"), namespace=namespace)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "KUBECONFIG": str(cluster.local.kubeconfig)}

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kubetune.cli", *args],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    table = cli("get", "-n", namespace)
    assert table.splitlines()[0].split()[:2] == ["NAME", "PHASE"]
    assert any(line.split()[0] == "listed" for line in table.splitlines()[1:])
    every = json.loads(cli("get", "-A", "-o", "json"))
    assert ("listed", namespace) in {
        (j["metadata"]["name"], j["metadata"]["namespace"]) for j in every["items"]
    }
    assert "no FineTuneJobs in nowhere-at-all" in cli("get", "-n", "nowhere-at-all")
    described = cli("describe", "listed", "-n", namespace).splitlines()
    assert described[0].split() == ["Name:", "listed"]
    assert described[1].split() == ["Namespace:", namespace]
    assert json.loads(cli("describe", "listed", "-n", namespace, "-o", "json"))["kind"] == (
        "FineTuneJob"
    )
    missing = subprocess.run(
        [sys.executable, "-m", "kubetune.cli", "describe", "absent", "-n", namespace],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert missing.returncode != 0 and "cannot read FineTuneJob absent" in missing.stderr
    pools = cluster.kubectl("get", "gpupools", "-o", "name").stdout.split()
    rows = cli("pools").splitlines()[1:]
    assert sorted(row.split()[0] for row in rows) == sorted(p.split("/", 1)[1] for p in pools)


def test_model_cannot_change_once_training_started(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    cluster.apply(job_doc("frozen"), namespace=namespace)
    wait_phase(cluster, "frozen", namespace, "Running", "Succeeded")
    out = cluster.apply(job_doc("frozen", model={"uri": "Qwen/Qwen2.5-7B"}), namespace=namespace)
    assert out.returncode != 0
    assert "cannot change once training has started" in out.stderr


def test_kubectl_explain_documents_the_spec(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "finetunejob.spec.resources").stdout
    assert "GPUs, pools, objective, deadline, budget" in out
    assert "maxCostUSD" in out and "Budget in US dollars" in out
    out = cluster.kubectl("explain", "gpupool.spec.gpu").stdout
    assert "bf16TFLOPS" in out


# ---------------------------------------------------------------------- lifecycle


def test_job_is_planned_launched_scheduled_and_succeeds(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    cluster.apply(job_doc("happy", resources={"pools": ["l40s"]}), namespace=namespace)
    obj = wait_phase(cluster, "happy", namespace, "Running", "Succeeded")
    plan = obj["status"]["plan"]
    assert plan["pool"] == "l40s" and plan["method"] == "lora"
    for kind, name in [
        ("persistentvolumeclaim", "happy-ckpt"),
        ("configmap", "happy-a1"),
        ("service", "happy"),
        ("job.batch", "happy-a1"),
    ]:
        assert wait_for(f"{kind}/{name}", lambda k=kind, n=name: cluster.get(k, n, namespace), 30)
    # The real scheduler placed the trainer pod on the planned pool's nodes.
    pods = wait_for(
        "trainer pod bound",
        lambda: [
            p
            for p in cluster.list("pods", namespace, "kubetune.io/job=happy")
            if p["spec"].get("nodeName")
        ],
        30,
    )
    assert all(p["spec"]["nodeName"].startswith("l40s-") for p in pods)
    # The provisioner bound the checkpoint volume.
    assert wait_for(
        "PVC bound",
        lambda: (
            (cluster.get("pvc", "happy-ckpt", namespace) or {}).get("status", {}).get("phase")
            == "Bound"
        ),
        30,
    )
    obj = wait_phase(cluster, "happy", namespace, "Succeeded", timeout=90)
    assert obj["status"]["progress"]["percent"] == 100
    # Printer columns show the plan.
    row = cluster.kubectl("get", "ftj", "happy", "-n", namespace).stdout
    assert "Succeeded" in row and "l40s" in row and "lora" in row
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=happy"
    ).stdout
    assert "PlanReady" in events and "Launched" in events


def test_job_too_large_fails_with_advice(cluster: Cluster, namespace: str, operator: Path) -> None:
    cluster.apply(
        job_doc(
            "huge", model={"uri": "meta-llama/Llama-3.1-405B"}, method="full", resources={"gpus": 1}
        ),
        namespace=namespace,
    )
    obj = wait_phase(cluster, "huge", namespace, "Failed")
    assert "To fix:" in obj["status"]["message"]
    assert cluster.get("job.batch", "huge-a1", namespace) is None


HELD_POOL = "held"
HELD_TAINT = {"key": "kubetune.io/test-held", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def held_pool(cluster: Cluster) -> Iterator[str]:
    """A pool of its own whose one node carries a taint trainer pods do not tolerate: its
    pods stay Pending, so kwok never completes them and a job there stays Running until
    the test acts."""
    pool = private_pool(HELD_POOL, nodes=1)
    nodes = simulated_nodes(pool)
    for node in nodes:
        node["spec"]["taints"].append(HELD_TAINT)
    assert cluster.apply(pool, *nodes).returncode == 0
    yield HELD_POOL
    cluster.kubectl("delete", "gpupool", HELD_POOL, "--wait=false", check=False)
    for node in nodes:
        cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)


def test_suspend_stops_pods_and_resume_relaunches(
    cluster: Cluster, namespace: str, operator: Path, held_pool: str
) -> None:
    # kwok completes a Job's pods as soon as they run; on the held pool they never do, so
    # the suspend always finds the job Running, however late the operator sees it.
    spec = {"training": {"maxSteps": 2000}, "resources": {"pools": [held_pool]}}
    cluster.apply(job_doc("pause", **spec), namespace=namespace)
    wait_phase(cluster, "pause", namespace, "Running")
    pods = wait_for("trainer pod created", lambda: cluster.list("pod", namespace), 30)
    assert [pod["status"].get("phase") for pod in pods] == ["Pending"], "the held pool holds"
    cluster.kubectl(
        "patch", "ftj", "pause", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    obj = wait_phase(cluster, "pause", namespace, "Suspended")
    assert obj["status"]["attempt"] == 1
    wait_for("batch Job gone", lambda: cluster.get("job.batch", "pause-a1", namespace) is None, 30)
    cluster.kubectl(
        "patch", "ftj", "pause", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    obj = wait_phase(cluster, "pause", namespace, "Running")
    assert obj["status"]["attempt"] == 2
    assert wait_for("second attempt", lambda: cluster.get("job.batch", "pause-a2", namespace), 30)


def test_deleting_the_job_collects_its_children(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    doc = job_doc("gone", checkpoint={"storage": {"retention": "delete"}})
    cluster.apply(doc, namespace=namespace)
    wait_phase(cluster, "gone", namespace, "Running", "Succeeded")
    wait_for("job created", lambda: cluster.get("job.batch", "gone-a1", namespace), 30)
    cluster.kubectl("delete", "ftj", "gone", "-n", namespace, "--wait=true", "--timeout=60s")
    for kind, name in [
        ("job.batch", "gone-a1"),
        ("configmap", "gone-a1"),
        ("service", "gone"),
        ("pvc", "gone-ckpt"),
    ]:
        wait_for(
            f"{kind}/{name} collected",
            lambda k=kind, n=name: cluster.get(k, n, namespace) is None,
            60,
        )


def test_retained_checkpoint_volume_survives_deletion(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    cluster.apply(job_doc("keep"), namespace=namespace)
    wait_for("pvc", lambda: cluster.get("pvc", "keep-ckpt", namespace), 60)
    cluster.kubectl("delete", "ftj", "keep", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("job collected", lambda: cluster.get("job.batch", "keep-a1", namespace) is None, 60)
    assert cluster.get("pvc", "keep-ckpt", namespace) is not None


def test_a_claim_kubetune_did_not_make_is_not_taken_for_a_checkpoint_volume(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    """The trainer prunes the `step-N` folders of its checkpoint volume: a claim of the
    user's that happens to bear the name (say, a torchtitan run's) must fail the job, not
    lose its folders."""
    theirs = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "theirs-ckpt", "labels": {"kubetune.io/job": "theirs"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    assert cluster.apply(theirs, namespace=namespace).returncode == 0
    cluster.apply(job_doc("theirs"), namespace=namespace)
    status = wait_phase(cluster, "theirs", namespace, "Failed")["status"]
    (cond,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert cond["reason"] == "ChildConflict", status
    assert "kubetune did not make it" in status["message"] and "To fix:" in status["message"]
    assert cluster.get("job.batch", "theirs-a1", namespace) is None
    claim = cluster.get("pvc", "theirs-ckpt", namespace)
    assert claim is not None and not claim["metadata"].get("ownerReferences")


def test_a_job_created_again_waits_for_the_children_its_predecessor_left(
    cluster: Cluster, namespace: str, operator: Path
) -> None:
    """Deleted and created again while garbage collection still holds the old job's
    ConfigMap (a finalizer keeps it here): the new job waits, then launches."""
    cluster.apply(job_doc("twice"), namespace=namespace)
    wait_for("twice-a1", lambda: cluster.get("configmap", "twice-a1", namespace), 60)
    hold = {"metadata": {"finalizers": ["kubetune.test/hold"]}}
    cluster.kubectl("patch", "configmap", "twice-a1", "-n", namespace, "-p", json.dumps(hold))
    cluster.kubectl("delete", "ftj", "twice", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "the old ConfigMap marked for deletion",
        lambda: (
            (cluster.get("configmap", "twice-a1", namespace) or {})
            .get("metadata", {})
            .get("deletionTimestamp")
        ),
        60,
    )
    cluster.apply(job_doc("twice"), namespace=namespace)
    time.sleep(6)  # a few looks of the operator (its poll is 1 s here)
    job = cluster.get("finetunejob", "twice", namespace) or {}
    assert (job.get("status") or {}).get("phase") != "Failed", job.get("status")
    new_uid = job["metadata"]["uid"]
    batch = cluster.get("job.batch", "twice-a1", namespace)
    assert batch is None or new_uid not in json.dumps(batch["metadata"]), "launched too soon"
    cluster.kubectl(
        "patch", "configmap", "twice-a1", "-n", namespace, "--type=json",
        "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]',
    )  # fmt: skip
    wait_phase(cluster, "twice", namespace, "Running", "Succeeded")
    config = wait_for("the new ConfigMap", lambda: cluster.get("configmap", "twice-a1", namespace))
    assert [o["uid"] for o in config["metadata"]["ownerReferences"]] == [new_uid]


def test_queued_until_gpus_free_up(cluster: Cluster, namespace: str, operator: Path) -> None:
    # Hold every GPU of the h100 pool with plain pods, so the job must wait.
    blockers = []
    for i in range(2):
        blockers.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"hog-{i}"},
                "spec": {
                    "nodeSelector": {"kubetune.io/pool": "h100"},
                    "tolerations": [
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                    ],
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
        )
    assert cluster.apply(*blockers, namespace=namespace).returncode == 0
    wait_for(
        "GPU pool status shows no free GPUs",
        lambda: (cluster.get("gpupool", "h100") or {}).get("status", {}).get("freeGPUs") == 0,
        60,
    )
    cluster.apply(job_doc("waits", resources={"pools": ["h100"]}), namespace=namespace)
    obj = wait_phase(cluster, "waits", namespace, "Queued")
    assert "waiting for" in obj["status"]["message"]
    assert cluster.get("job.batch", "waits-a1", namespace) is None
    cluster.kubectl(
        "delete", "pod", "hog-0", "hog-1", "-n", namespace, "--grace-period=0", "--force"
    )
    wait_phase(cluster, "waits", namespace, "Running", "Succeeded", timeout=90)


def test_gpupool_status_reflects_nodes(cluster: Cluster, operator: Path) -> None:
    pool = wait_for(
        "a100 pool status",
        lambda: (
            (cluster.get("gpupool", "a100-80gb") or {}).get("status", {}).get("nodes") == 4
            and cluster.get("gpupool", "a100-80gb")
        ),
        60,
    )
    assert pool["status"]["allocatableGPUs"] == 32
    nodes = cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout
    assert "NVIDIA-H100-80GB-HBM3" in nodes and "NVIDIA-L40S" in nodes
