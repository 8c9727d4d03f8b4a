"""The local pod runner against the real control plane: pods of one node run as local processes.

The runner registers its own node, tainted so that no other test's pods land on it; the pods
here tolerate the taint and select the node, so the real scheduler places them (the Job's too).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubetune_dev.cluster import STORAGE_CLASS, LocalCluster
from kubetune_dev.podrunner.sandbox import probe_mount_namespace
from support.cluster import Cluster
from support.waiting import wait_for

pytestmark = [pytest.mark.tooling, pytest.mark.controlplane]

TAINT_KEY = "kubetune.io/podrunner-test"
TIMEOUT = 90.0


@dataclass
class Runner:
    node: str
    work: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        path = self.work / f"{namespace}_{pod}" / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def start_runner(local: LocalCluster, root: Path, node: str, *extra: str) -> Runner:
    if os.geteuid() != 0 or probe_mount_namespace() is not None:
        pytest.skip("the pod runner's bind mounts need root with CAP_SYS_ADMIN")
    work = root / node
    work.mkdir(parents=True, exist_ok=True)
    log = local.logs / f"podrunner-{node}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubetune_dev.podrunner",
                f"--kubeconfig={local.component_kubeconfig('kwok')}",
                f"--node={node}",
                f"--work={work}",
                "--gpus=1",
                "--labels=kubetune.io/test=podrunner",
                f"--taints={TAINT_KEY}=true:NoSchedule",
                f"--tls-cert={local.pki.serving_cert}",
                f"--tls-key={local.pki.serving_key}",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return Runner(node, work, log, proc)


def stop_runner(local: LocalCluster, runner: Runner) -> int:
    if runner.proc.poll() is None:
        runner.proc.send_signal(signal.SIGTERM)
        try:
            runner.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            runner.proc.kill()
            runner.proc.wait()
    local.kubectl("delete", "node", runner.node, "--wait=false", check=False)
    return int(runner.proc.returncode)


def wait_node_ready(cluster: Cluster, runner: Runner) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        assert runner.proc.poll() is None, runner.log.read_text()[-3000:]
        node = cluster.get("node", runner.node)
        conds = ((node or {}).get("status") or {}).get("conditions") or []
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
            taints = (node or {}).get("spec", {}).get("taints") or []
            # The node-lifecycle controller lifts its not-ready taint once it sees Ready.
            if not any(t["key"].startswith("node.kubernetes.io/") for t in taints):
                return node
        return None

    return dict(wait_for(f"node {runner.node} Ready", ready, timeout=TIMEOUT))


@pytest.fixture(scope="module")
def runner(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runner]:
    node = f"podrunner-{uuid.uuid4().hex[:6]}"
    run = start_runner(local_cluster, tmp_path_factory.mktemp("podrunner"), node)
    try:
        wait_node_ready(Cluster(local_cluster), run)
        yield run
    finally:
        code = stop_runner(local_cluster, run)
        assert code == 0, run.log.read_text()[-3000:]


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace without the tier's `restricted` Pod Security label: the runner's own tests
    run pods as a kubelet's tests would (hostPath volumes, no securityContext); no
    FineTuneJob runs here (the e2e tier runs trainer pods through the runner in a restricted
    namespace)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def placement(node: str) -> dict[str, Any]:
    """Scheduled by the real scheduler onto the runner's node."""
    return {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }


def apply(cluster: Cluster, namespace: str, *docs: dict[str, Any]) -> None:
    out = cluster.apply(*docs, namespace=namespace)
    assert out.returncode == 0, out.stderr


def pod_status(cluster: Cluster, name: str, namespace: str) -> dict[str, Any]:
    pod = cluster.get("pod", name, namespace) or {}
    return dict(pod.get("status") or {})


def wait_pod_phase(
    cluster: Cluster, runner: Runner, name: str, namespace: str, *phases: str
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        assert runner.proc.poll() is None, runner.log.read_text()[-3000:]
        status = pod_status(cluster, name, namespace)
        return status if status.get("phase") in phases else None

    try:
        return dict(wait_for(f"pod {namespace}/{name} in {phases}", probe, timeout=TIMEOUT))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nrunner log:\n{runner.log.read_text()[-3000:]}") from None


def terminated(status: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return dict(status["containerStatuses"][index]["state"]["terminated"])


def pv_path(cluster: Cluster, claim: str, namespace: str) -> Path:
    def bound() -> str | None:
        pvc = cluster.get("pvc", claim, namespace) or {}
        return (pvc.get("spec") or {}).get("volumeName")

    volume = wait_for(f"claim {claim} bound", bound, timeout=TIMEOUT)
    pv = cluster.get("pv", volume) or {}
    return Path(pv["spec"]["hostPath"]["path"])


# ---------------------------------------------------------------------- tests


def test_node_is_registered_with_lease_and_simulated_gpus(cluster: Cluster, runner: Runner) -> None:
    node = cluster.get("node", runner.node)
    assert node is not None
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert node["metadata"]["labels"]["kubetune.io/test"] == "podrunner"
    assert "kwok.x-k8s.io/node" not in (node["metadata"].get("annotations") or {})
    lease = cluster.get("lease", runner.node, "kube-node-lease")
    assert lease is not None and lease["spec"]["holderIdentity"] == runner.node


def test_bare_pod_runs_locally_with_volumes_env_and_exit_code(
    cluster: Cluster, runner: Runner, namespace: str
) -> None:
    existing = {p for p in (Path("/etc/cfg"), Path("/data")) if p.exists()}
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg"},
            "data": {"x": "hello from a configmap"},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data"},
            "spec": {
                "storageClassName": STORAGE_CLASS,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "bare"},
            "spec": {
                **placement(runner.node),
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored:latest",
                        "command": [
                            "sh",
                            "-c",
                            "cat /etc/cfg/x > /data/out; echo $POD_NAME; exit 3",
                        ],
                        "env": [
                            {
                                "name": "POD_NAME",
                                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                            }
                        ],
                        "volumeMounts": [
                            {"name": "cfg", "mountPath": "/etc/cfg"},
                            {"name": "data", "mountPath": "/data"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                ],
            },
        },
    )
    status = wait_pod_phase(cluster, runner, "bare", namespace, "Failed", "Succeeded")
    assert status["phase"] == "Failed"
    term = terminated(status)
    assert term["exitCode"] == 3 and term["reason"] == "Error"
    assert status["podIP"].startswith("127.0.100.")
    assert (pv_path(cluster, "data", namespace) / "out").read_text() == "hello from a configmap"
    assert runner.pod_log(namespace, "bare", "main").strip() == "bare"
    # The mount points made on the host for the pod are gone again.
    made = [p for p in (Path("/etc/cfg"), Path("/data")) if p not in existing]
    wait_for("mount points removed", lambda: not any(p.exists() for p in made), timeout=10)


def test_kubectl_logs_reads_and_follows_a_container(
    local_cluster: LocalCluster, cluster: Cluster, runner: Runner, namespace: str
) -> None:
    """`kubectl logs` goes API server → the runner's log endpoint, as to a kubelet."""
    script = "for i in 1 2 3 4 5; do echo line-$i; sleep 0.4; done"
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "talker"},
            "spec": {
                **placement(runner.node),
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "x", "command": ["sh", "-c", script]}],
            },
        },
    )
    wait_pod_phase(cluster, runner, "talker", namespace, "Running", "Succeeded")
    # Follow from the start: every line, and the stream ends when the container exits.
    followed = local_cluster.kubectl("logs", "-f", "talker", "-n", namespace, timeout=30)
    assert followed.stdout.split() == [f"line-{i}" for i in range(1, 6)], followed.stderr
    wait_pod_phase(cluster, runner, "talker", namespace, "Succeeded")
    tail = local_cluster.kubectl("logs", "talker", "-n", namespace, "--tail=2")
    assert tail.stdout.split() == ["line-4", "line-5"]
    limited = local_cluster.kubectl("logs", "talker", "-n", namespace, "--limit-bytes=6")
    assert limited.stdout == "line-1"
    previous = local_cluster.kubectl("logs", "talker", "-n", namespace, "-p", check=False)
    assert previous.returncode != 0 and "previous terminated container" in previous.stderr


def test_pod_sees_its_environment_like_in_a_cluster(
    cluster: Cluster, runner: Runner, namespace: str
) -> None:
    workdir = Path(f"/podrunner-test-{uuid.uuid4().hex[:8]}/dir")
    script = "\n".join(
        [
            "set -e",
            'echo "host=$(hostname) env=$HOSTNAME"',
            'echo "rank=$NODE_RANK ip=$POD_IP token=$TOKEN expanded=$GREETING"',
            'echo "cwd=$(pwd) pid=$$$$"',  # $$ is a literal $ in Kubernetes
            "getent hosts sib-0.sub | cut -f1 -d' ' | sed 's/^/resolved=/'",
            "touch /etc/cfg/new 2>/dev/null && echo cfg=writable || echo cfg=read-only",
            "ls /var/run/secrets/kubernetes.io/serviceaccount | tr '\\n' ' '; echo",
            "echo 'finished well' > /dev/termination-log",
        ]
    )
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg"},
            "data": {"x": "1"},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hub"},
            "stringData": {"token": "hf_secret"},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "env", "annotations": {"rank": "5"}},
            "spec": {
                **placement(runner.node),
                "restartPolicy": "Never",
                "hostname": "sib-0",
                "subdomain": "sub",
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored",
                        "command": ["sh", "-c", script],
                        "workingDir": str(workdir),
                        "env": [
                            {
                                "name": "NODE_RANK",
                                "valueFrom": {
                                    "fieldRef": {"fieldPath": "metadata.annotations['rank']"}
                                },
                            },
                            {
                                "name": "POD_IP",
                                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                            },
                            {
                                "name": "TOKEN",
                                "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}},
                            },
                            {"name": "GREETING", "value": "rank-$(NODE_RANK)"},
                        ],
                        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}],
                    }
                ],
                "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}],
            },
        },
    )
    status = wait_pod_phase(cluster, runner, "env", namespace, "Failed", "Succeeded")
    out = runner.pod_log(namespace, "env", "main")
    assert status["phase"] == "Succeeded", out
    ip = status["podIP"]
    assert "host=sib-0 env=sib-0" in out
    assert f"rank=5 ip={ip} token=hf_secret expanded=rank-5" in out
    assert f"cwd={workdir} pid=1" in out  # PID 1 of the container's own PID namespace
    assert f"resolved={ip}" in out
    assert "cfg=read-only" in out
    assert "ca.crt namespace token" in out
    term = terminated(status)
    assert term["reason"] == "Completed" and term["message"] == "finished well\n"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "False" and conditions["PodScheduled"] == "True"
    # The workingDir was created on the host for the process, and removed after it.
    wait_for("workingDir removed", lambda: not workdir.parent.exists(), timeout=10)


def trapping_pod(
    name: str, runner: Runner, marker_dir: Path, on_term: str, grace: int
) -> dict[str, Any]:
    """A pod whose shell runs `on_term` on SIGTERM ("": ignores it), then writes
    `marker_dir/started` once its trap is set, and loops until stopped."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            **placement(runner.node),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": [
                        "sh",
                        "-c",
                        f"trap {shlex.quote(on_term)} TERM; echo started > /markers/started; "
                        "while true; do sleep 0.1; done",
                    ],
                    "volumeMounts": [{"name": "markers", "mountPath": "/markers"}],
                }
            ],
            "volumes": [
                {
                    "name": "markers",
                    "hostPath": {"path": str(marker_dir), "type": "DirectoryOrCreate"},
                }
            ],
        },
    }


def test_deleted_pod_gets_sigterm_first_and_is_removed(
    cluster: Cluster, runner: Runner, namespace: str, tmp_path: Path
) -> None:
    marker_dir = tmp_path / "markers"
    pod = trapping_pod("graceful", runner, marker_dir, "echo TERM > /markers/term; exit 42", 60)
    apply(cluster, namespace, pod)
    status = wait_pod_phase(cluster, runner, "graceful", namespace, "Running")
    assert status["containerStatuses"][0]["ready"] is True
    wait_for("the process to start", (marker_dir / "started").exists, timeout=TIMEOUT)
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", "graceful", "-n", namespace, "--wait=false")
    wait_for(
        "the pod to be removed",
        lambda: cluster.get("pod", "graceful", namespace) is None,
        timeout=TIMEOUT,
    )
    # Removed long before its 60 s grace period: the trap ran on SIGTERM and the pod exited.
    assert time.monotonic() - t0 < 30
    assert (marker_dir / "term").read_text().strip() == "TERM"


def test_sigkill_after_grace_period_is_reported_before_the_final_delete(
    cluster: Cluster, runner: Runner, namespace: str, tmp_path: Path
) -> None:
    finalizer = "kubetune.io/test-keep"
    marker_dir = tmp_path / "markers"
    pod = trapping_pod("stubborn", runner, marker_dir, "", 2)
    # The finalizer keeps the object after the runner's final delete, so that the status it
    # reported can be read.
    pod["metadata"]["finalizers"] = [finalizer]
    apply(cluster, namespace, pod)
    wait_pod_phase(cluster, runner, "stubborn", namespace, "Running")
    # Running means the process started, not that the shell has set its trap yet: a SIGTERM
    # before that would end it (143) instead of leaving it to the SIGKILL.
    wait_for("the trap to be set", (marker_dir / "started").exists, timeout=TIMEOUT)
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    try:
        status = wait_pod_phase(cluster, runner, "stubborn", namespace, "Failed")
        term = terminated(status)
        assert term["exitCode"] == 137 and term["signal"] == 9 and term["reason"] == "Error"
        assert any(
            e["reason"] == "Killing"
            for e in cluster.list("events", namespace)
            if e["involvedObject"]["name"] == "stubborn"
        )
    finally:
        cluster.kubectl(
            "patch",
            "pod",
            "stubborn",
            "-n",
            namespace,
            "--type=json",
            "-p",
            json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]),
            check=False,
        )
    wait_for(
        "the pod to be removed",
        lambda: cluster.get("pod", "stubborn", namespace) is None,
        timeout=TIMEOUT,
    )


def test_indexed_job_runs_and_completes(cluster: Cluster, runner: Runner, namespace: str) -> None:
    code = (
        "import os, sys; "
        "print('rank', os.environ['NODE_RANK'], 'python', sys.version_info[:2], flush=True)"
    )
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "train"},
            "spec": {
                "completionMode": "Indexed",
                "completions": 1,
                "parallelism": 1,
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        **placement(runner.node),
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "trainer",
                                "image": "kubetune/trainer:test",
                                "command": ["python", "-c", code],
                                "env": [
                                    {
                                        "name": "NODE_RANK",
                                        "valueFrom": {
                                            "fieldRef": {
                                                "fieldPath": "metadata.annotations"
                                                "['batch.kubernetes.io/job-completion-index']"
                                            }
                                        },
                                    }
                                ],
                            }
                        ],
                    }
                },
            },
        },
    )

    def complete() -> dict[str, Any] | None:
        job = cluster.get("job", "train", namespace) or {}
        conds = (job.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Failed" and c["status"] == "True" for c in conds):
            raise AssertionError(f"job failed: {conds}\n{runner.log.read_text()[-3000:]}")
        if any(c["type"] == "Complete" and c["status"] == "True" for c in conds):
            return job
        return None

    job = wait_for("job train Complete", complete, timeout=TIMEOUT)
    assert job["status"]["succeeded"] == 1
    pods = cluster.list("pods", namespace, selector="job-name=train")
    assert len(pods) == 1 and pods[0]["spec"]["nodeName"] == runner.node
    assert "rank 0 python" in runner.pod_log(namespace, pods[0]["metadata"]["name"], "trainer")


TORCH_SCRIPT = """\
import os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} sum {total.item():.0f} host {socket.gethostname()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_standalone_runs_in_a_trainer_like_pod(
    cluster: Cluster, runner: Runner, namespace: str
) -> None:
    pytest.importorskip("torch")
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "script"},
            "data": {"allreduce.py": TORCH_SCRIPT},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "torchrun"},
            "spec": {
                **placement(runner.node),
                "restartPolicy": "Never",
                "hostname": "ft-a1-0",
                "subdomain": "ft",
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                "containers": [
                    {
                        "name": "trainer",
                        "image": "kubetune/trainer:test",
                        "command": ["torchrun"],
                        "args": [
                            "--standalone",
                            "--nnodes=1",
                            "--nproc-per-node=2",
                            "--max-restarts=0",
                            "/etc/kubetune/allreduce.py",
                        ],
                        "env": [
                            {"name": "HOME", "value": "/tmp"},
                            {"name": "OMP_NUM_THREADS", "value": "1"},
                        ],
                        "securityContext": {"readOnlyRootFilesystem": True},
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/kubetune", "readOnly": True},
                            {"name": "dshm", "mountPath": "/dev/shm"},
                            {"name": "tmp", "mountPath": "/tmp"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "config", "configMap": {"name": "script"}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "tmp", "emptyDir": {}},
                ],
            },
        },
    )
    status = wait_pod_phase(cluster, runner, "torchrun", namespace, "Succeeded", "Failed")
    out = runner.pod_log(namespace, "torchrun", "trainer")
    assert status["phase"] == "Succeeded", out[-3000:]
    assert "rank 0 sum 3 host ft-a1-0" in out and "rank 1 sum 3 host ft-a1-0" in out


RENDEZVOUS_PORT = 29411
"""Not torchrun's default: pods share this machine's network, and a TCP store on 29400 of
another suite's job would answer."""


def test_two_nodes_rendezvous_through_the_headless_service(
    local_cluster: LocalCluster,
    cluster: Cluster,
    runner: Runner,
    namespace: str,
    tmp_path: Path,
) -> None:
    """An Indexed Job of two pods on two nodes (two runners, distinct pod IPs): pod 1 finds
    `mn-0.mn` (the headless Service's name for pod 0, on the other runner) and the two
    torchrun agents rendezvous (c10d) and all-reduce over gloo, as trainer pods of a
    multi-node plan do."""
    pytest.importorskip("torch")
    other = start_runner(
        local_cluster, tmp_path, f"podrunner-b-{uuid.uuid4().hex[:6]}", "--pod-ip-base=127.0.104."
    )
    try:
        wait_node_ready(cluster, other)
        nodes = [runner.node, other.node]
        selector = {"matchLabels": {"job-name": "mn"}}
        apply(
            cluster,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "script"},
                "data": {"allreduce.py": TORCH_SCRIPT},
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "mn"},
                "spec": {
                    "clusterIP": "None",
                    "selector": {"job-name": "mn"},
                    "publishNotReadyAddresses": True,
                    "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
                },
            },
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "mn"},
                "spec": {
                    "completionMode": "Indexed",
                    "completions": 2,
                    "parallelism": 2,
                    "backoffLimit": 0,
                    "template": {
                        "spec": {
                            "subdomain": "mn",
                            "restartPolicy": "Never",
                            "tolerations": placement(runner.node)["tolerations"],
                            "affinity": {
                                "nodeAffinity": {
                                    "requiredDuringSchedulingIgnoredDuringExecution": {
                                        "nodeSelectorTerms": [
                                            {
                                                "matchExpressions": [
                                                    {
                                                        "key": "kubernetes.io/hostname",
                                                        "operator": "In",
                                                        "values": nodes,
                                                    }
                                                ]
                                            }
                                        ]
                                    }
                                },
                                "podAntiAffinity": {
                                    "requiredDuringSchedulingIgnoredDuringExecution": [
                                        {
                                            "labelSelector": selector,
                                            "topologyKey": "kubernetes.io/hostname",
                                        }
                                    ]
                                },
                            },
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "kubetune/trainer:test",
                                    "command": ["torchrun"],
                                    "args": [
                                        "--nnodes=2",
                                        "--nproc-per-node=1",
                                        "--rdzv-backend=c10d",
                                        f"--rdzv-endpoint=mn-0.mn:{RENDEZVOUS_PORT}",
                                        f"--rdzv-id={uuid.uuid4().hex[:8]}",
                                        "--rdzv-conf=join_timeout=60",
                                        "--max-restarts=0",
                                        "/etc/kubetune/allreduce.py",
                                    ],
                                    "env": [
                                        {"name": "HOME", "value": "/tmp"},
                                        {"name": "OMP_NUM_THREADS", "value": "1"},
                                    ],
                                    "volumeMounts": [
                                        {"name": "config", "mountPath": "/etc/kubetune"},
                                        {"name": "tmp", "mountPath": "/tmp"},
                                    ],
                                }
                            ],
                            "volumes": [
                                {"name": "config", "configMap": {"name": "script"}},
                                {"name": "tmp", "emptyDir": {}},
                            ],
                        }
                    },
                },
            },
        )

        def finished() -> dict[str, Any] | None:
            assert other.proc.poll() is None, other.log.read_text()[-3000:]
            job = cluster.get("job", "mn", namespace) or {}
            conds = (job.get("status") or {}).get("conditions") or []
            done = [c["type"] for c in conds if c["status"] == "True"]
            return job if {"Complete", "Failed"} & set(done) else None

        job = wait_for("job mn finished", finished, timeout=2 * TIMEOUT)
        pods = {
            p["spec"]["hostname"]: p
            for p in cluster.list("pods", namespace, selector="job-name=mn")
        }
        logs = {
            host: (runner if p["spec"]["nodeName"] == runner.node else other).pod_log(
                namespace, p["metadata"]["name"], "trainer"
            )
            for host, p in pods.items()
        }
        assert job["status"].get("succeeded") == 2, (job["status"], logs)
        assert {p["spec"]["nodeName"] for p in pods.values()} == set(nodes)
        ips = {p["status"]["podIP"] for p in pods.values()}
        assert len(ips) == 2, ips
        text = "".join(logs.values())
        assert "sum 3 host mn-0" in text and "sum 3 host mn-1" in text, logs
    finally:
        code = stop_runner(local_cluster, other)
    assert code == 0, other.log.read_text()[-3000:]


def test_runner_shutdown_kills_its_processes(
    local_cluster: LocalCluster, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    token = f"podrunner-orphan-check-{uuid.uuid4().hex[:8]}"
    own = start_runner(local_cluster, tmp_path, f"podrunner-stop-{uuid.uuid4().hex[:6]}")
    try:
        wait_node_ready(cluster, own)
        # Copies of a script whose command line carries the token: one in the background,
        # one in a session of its own (as torchrun starts its workers), one in the foreground.
        script = tmp_path / token
        script.write_text("#!/bin/sh\nwhile true; do sleep 1; done\n")
        script.chmod(0o755)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "long"},
            "spec": {
                **placement(own.node),
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored",
                        "command": ["sh", "-c", f"{script} & setsid {script} & {script}; wait"],
                    }
                ],
            },
        }
        apply(cluster, namespace, pod)
        wait_pod_phase(cluster, own, "long", namespace, "Running")
        wait_for("the processes to start", lambda: len(_processes(token)) >= 3, timeout=TIMEOUT)
    finally:
        code = stop_runner(local_cluster, own)
    assert code == 0, own.log.read_text()[-3000:]
    assert wait_for("no process left", lambda: not _processes(token), timeout=10)
    status = pod_status(cluster, "long", namespace)
    assert status["phase"] == "Failed"
    assert terminated(status)["exitCode"] == 137
    cluster.kubectl(
        "delete", "pod", "long", "-n", namespace, "--grace-period=0", "--force", check=False
    )


def test_processes_left_by_a_finished_container_are_killed(
    cluster: Cluster, runner: Runner, namespace: str, tmp_path: Path
) -> None:
    token = f"podrunner-leftover-{uuid.uuid4().hex[:8]}"
    script = tmp_path / token
    script.write_text("#!/bin/sh\nwhile true; do sleep 1; done\n")
    script.chmod(0o755)
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "leaver"},
            "spec": {
                **placement(runner.node),
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored",
                        "command": ["sh", "-c", f"setsid {script} & {script} & sleep 1; exit 0"],
                    }
                ],
            },
        },
    )
    status = wait_pod_phase(cluster, runner, "leaver", namespace, "Succeeded", "Failed")
    assert status["phase"] == "Succeeded"
    assert wait_for("no process left", lambda: not _processes(token), timeout=10)


def test_without_mount_namespace_volumes_are_found_through_the_path_map(
    local_cluster: LocalCluster, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    mount_path = f"/podrunner-cfg-{uuid.uuid4().hex[:8]}"
    script = 'echo "$KUBETUNE_PATH_MAP"; pwd'
    own = start_runner(
        local_cluster, tmp_path, f"podrunner-map-{uuid.uuid4().hex[:6]}", "--no-mount-namespace"
    )
    try:
        wait_node_ready(cluster, own)
        apply(
            cluster,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "cfg"},
                "data": {"x": "mapped"},
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "mapped"},
                "spec": {
                    **placement(own.node),
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": "ignored",
                            "command": ["sh", "-c", script],
                            "workingDir": mount_path,
                            "volumeMounts": [{"name": "cfg", "mountPath": mount_path}],
                        }
                    ],
                    "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}],
                },
            },
        )
        status = wait_pod_phase(cluster, own, "mapped", namespace, "Succeeded", "Failed")
    finally:
        assert stop_runner(local_cluster, own) == 0, own.log.read_text()[-3000:]
    out = own.pod_log(namespace, "mapped", "main").splitlines()
    assert status["phase"] == "Succeeded", out
    mapping = json.loads(out[0])
    host = Path(mapping[mount_path])
    assert (host / "x").read_text() == "mapped"
    assert out[1] == str(host)  # the workingDir under a mount path is mapped too
    assert not Path(mount_path).exists()


def _processes(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().split(") ")[1][:1]
        except OSError:
            continue
        if token.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_runner_cli_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kubetune_dev.podrunner", "--node", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--kubeconfig" in out.stderr
