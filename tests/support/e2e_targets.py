"""Where the e2e suite runs: the local control plane, or a kind cluster.

Both targets offer the same few verbs, so the scenarios in `test_e2e.py` do not care which
one they run on:

* `local` (default): the control plane this project builds from Go modules, started on
  loopback, with one node served by the local pod runner — the trainer runs as a process
  of this machine on CPU — and the operator as its own `kopf run` process.
* `kind` (`KUBETUNE_E2E_TARGET=kind`): a kind cluster made by `hack/kind-e2e.sh`, with the
  operator installed by `helm install` and the trainer in real containers on CPU. The
  script exports `KUBETUNE_KIND_KUBECONFIG` and `KUBETUNE_KIND_TRAINER_IMAGE`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from support.apiserver import RESOURCES, Api
from support.podsecurity import RESTRICTED_CONTAINER, RESTRICTED_LABELS, restricted_namespace
from support.waiting import WaitTimeout, wait_for

if TYPE_CHECKING:
    from kubetune_dev.binaries import Binaries

NAMESPACE = "e2e"
DATA_CLAIM = "e2e-data"
MODEL_PATH = "models/tiny-llama"
DATASET_PATH = "data/alpaca-tiny.jsonl"
POOL_NAME = "local-cpu"

# The pool the trainer pods land on: its node's "GPUs" are simulated and the work runs on
# the CPU. The throughput figure is high on purpose, so that plans are short and cheap and
# budgets and deadlines measured against real (slow) CPU training are what stops a job.
POOL: dict[str, Any] = {
    "apiVersion": "kubetune.io/v1alpha1",
    "kind": "GPUPool",
    "metadata": {"name": POOL_NAME},
    "spec": {
        "nodeSelector": {"kubetune.io/pool": POOL_NAME},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "gpu": {"product": "local-cpu", "memoryGiB": 16, "bf16TFLOPS": 200},
        "gpusPerNode": 2,
        "maxNodes": 1,
        "pricePerGPUHour": 3.6,
    },
}

# A second, dearer pool on a second node: where a job moves when the first has no room.
POOL_B_NAME = "local-cpu-b"
POOL_B: dict[str, Any] = {
    **POOL,
    "metadata": {"name": POOL_B_NAME},
    "spec": {
        **POOL["spec"],
        "nodeSelector": {"kubetune.io/pool": POOL_B_NAME},
        "pricePerGPUHour": 7.2,
    },
}
NODE_A, NODE_B = "local-0", "local-1"
SHARED_CLASS = "kubetune-shared"
"""The kind target's ReadWriteMany StorageClass (hack/kind-shared-storage.yaml)."""

OPERATOR_SETTINGS = {
    "KUBETUNE_POLL_SECONDS": "1",
    "KUBETUNE_QUEUE_RETRY_SECONDS": "2",
    # The scenarios read progress from the status; a production operator writes it once a
    # minute.
    "KUBETUNE_PROGRESS_WRITE_SECONDS": "1",
    "KUBETUNE_TERMINATION_GRACE_SECONDS": "60",
    "KUBETUNE_RESCHEDULE_SECONDS": "5",
    "KUBETUNE_TRAINER_IMAGE": "kubetune/trainer:e2e",
    # The scenarios inject their faults (out of memory, slow steps) through the annotation.
    "KUBETUNE_ALLOW_TEST_FAULTS": "true",
    # Every node here is a tainted GPU pool node: stage-in pods have nowhere else to go.
    "KUBETUNE_STAGE_IN_TOLERATIONS": json.dumps(POOL["spec"]["tolerations"]),
    # The local cluster's provisioner serves ReadWriteMany hostPath volumes: checkpoint
    # volumes follow a job to several nodes (kind's local-path class cannot; it keeps the
    # chart's default, off).
    "KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "true",
}


REPORT: list[str] = []
"""Numbers the scenarios measured (steps lost, loss differences, restarts, write rates);
printed at the end of the run."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Target:
    """The verbs the scenarios use; see LocalTarget and KindTarget."""

    name = "?"
    nodes = (NODE_A, NODE_B)
    """The node of POOL and the node of POOL_B."""
    volumes_follow_pods = True
    """Whether a volume written on one node can be mounted on the other (a job that moves
    pools takes its checkpoint volume along)."""
    cheap_volume_reads = True
    """Whether reading a file of a volume is quick (a local folder), not a pod per read."""
    pulls_images = False
    """Whether a kubelet pulls the pods' images (the local pod runner ignores them)."""
    enforces_memory_limits = False
    """Whether a container's memory limit is enforced (a cgroup the kernel kills in); the
    local pod runner has no cgroups."""
    host_address = "127.0.0.1"
    """The IPv4 address of this machine that the target's pods reach: where a server the
    suite starts here (the S3 server) listens, and the endpoint the pods are given."""

    def kubectl_argv(self) -> list[str]:
        """kubectl with the target's kubeconfig, for commands run as their own process."""
        raise NotImplementedError

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def read_volume_file(self, claim: str, path: str) -> str | None:
        """A file on a claim in NAMESPACE; None when it does not exist."""
        raise NotImplementedError

    def list_volume(self, claim: str, path: str) -> list[str]:
        """Names of the files under a folder of a claim (recursively, relative)."""
        raise NotImplementedError

    def volume_sha256(self, claim: str, path: str) -> str | None:
        """The sha256 (hex) of a file on a claim in NAMESPACE; None when it does not exist."""
        raise NotImplementedError

    def volume_folder(self, claim: str) -> Path:
        """The folder on this machine that holds a claim of NAMESPACE, to write inputs to it
        or load a model from it; only where volumes are local folders."""
        raise NotImplementedError(f"the volumes of the {self.name} target are not local folders")

    def kill_operator(self) -> None:
        """Stop the operator at once (SIGKILL): no cleanup of its own."""
        raise NotImplementedError

    def hard_kill(self, pod: str) -> None:
        """SIGKILL a trainer pod's training mid-step, as when its node dies: no checkpoint."""
        raise NotImplementedError

    def lose_node(self, node: str) -> str:
        """The machine behind a node dies with everything on it: its kubelet stops reporting
        and nothing reports its pods' end. Returns how it was done, in words."""
        raise NotImplementedError

    def restore_node(self, node: str) -> None:
        """After its Node object was deleted: bring a lost node back where the target can,
        ready for pods as before."""

    def start_operator(self) -> None:
        raise NotImplementedError

    def operator_running(self) -> bool:
        raise NotImplementedError

    def diagnostics(self) -> dict[str, str]:
        """Log tails worth printing when a scenario fails."""
        return {}

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ shared

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.kubectl("get", kind, name, "-n", NAMESPACE, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(out.stderr)
        return dict(json.loads(out.stdout))

    def list(self, kind: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", NAMESPACE, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return list(json.loads(self.kubectl(*args).stdout)["items"])

    def apply(self, *docs: dict[str, Any]) -> None:
        text = "---\n".join(yaml.safe_dump(d) for d in docs)
        self.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=text)


# ---------------------------------------------------------------------- local


def pod_ip_base(block: int, node: int) -> str:
    """The pod IP base of a local target's `node`-th pod runner: `127.<block>.<100+node>.`.

    All of 127/8 is loopback on Linux. Each target of one run (one per pytest-xdist worker)
    takes a block of its own, so the pods of two targets never share an address: a trainer
    binds its metrics port, and a multi-node job's rendezvous, on its pod's."""
    return f"127.{block}.{100 + node}."


class LocalTarget(Target):
    name = "local"

    def __init__(self, root: Path, binaries: Binaries, block: int = 0) -> None:
        from kubetune.api.crdgen import render_all
        from kubetune_dev.cluster import LocalCluster
        from kubetune_dev.demo import prepare_data

        self.block = block
        self.cluster = LocalCluster(root, binaries, die_with_caller=True)
        t0 = time.monotonic()
        self.cluster.start()
        try:
            self.cluster.apply([yaml.safe_load(text) for text in render_all().values()])
            self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")
            # As a careful admin would have it: the `restricted` Pod Security Standard.
            self.kubectl("create", "-f", "-", input=yaml.safe_dump(restricted_namespace(NAMESPACE)))
            self.cluster.add_local_pool(POOL, node=NODE_A, pod_ip_base=self.pod_ip_base(0))
            self.cluster.add_local_pool(POOL_B, node=NODE_B, pod_ip_base=self.pod_ip_base(1))
            prepare_data(self.cluster, say, namespace=NAMESPACE, claim=DATA_CLAIM)
            self.start_operator()
        except BaseException:
            self.close()
            raise
        say(f"e2e target local ready in {time.monotonic() - t0:.1f}s")

    def pod_ip_base(self, node: int) -> str:
        """The pod IP base of this target's `node`-th pod runner (0: NODE_A, 1: NODE_B)."""
        return pod_ip_base(self.block, node)

    def hard_kill(self, pod: str) -> None:
        # The local pod runner kills a force-deleted pod's processes at once.
        self.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=0", "--force")

    def lose_node(self, node: str) -> str:
        # A node's pod runner is its kubelet: SIGKILLed, its process group (the pods'
        # processes) dies with it, and nothing reports either any more.
        pid = self.cluster.state.pids.pop(f"podrunner-{node}")
        self.cluster.state.save()
        os.killpg(pid, signal.SIGKILL)
        return "its pod runner SIGKILLed"

    def kubectl_argv(self) -> list[str]:
        return [str(self.cluster.binaries.kubectl), f"--kubeconfig={self.cluster.kubeconfig}"]

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = self.cluster.kubectl(*args, input=input, check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    @functools.cached_property
    def api(self) -> Api:
        """Reads of the kinds in RESOURCES without a kubectl process each (the scenarios
        poll every half second, on the cores the trainer and the operator use)."""
        return Api(self.cluster)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        if kind in RESOURCES:
            return self.api.get(kind, name, NAMESPACE)
        return super().get(kind, name)

    def list(self, kind: str, selector: str | None = None) -> list[dict[str, Any]]:
        if kind in RESOURCES:
            return self.api.list(kind, NAMESPACE, selector)
        return super().list(kind, selector)

    def _claim_root(self, claim: str) -> Path | None:
        from kubetune_dev.demo import claim_path

        path = claim_path(self.cluster, NAMESPACE, claim, get=self.api.get)
        return Path(path) if path else None

    def volume_folder(self, claim: str) -> Path:
        root = self._claim_root(claim)
        assert root is not None, f"claim {claim} is not bound to a folder"
        return root

    def read_volume_file(self, claim: str, path: str) -> str | None:
        root = self._claim_root(claim)
        if root is None or not (root / path).is_file():
            return None
        return (root / path).read_text()

    def volume_sha256(self, claim: str, path: str) -> str | None:
        root = self._claim_root(claim)
        if root is None or not (root / path).is_file():
            return None
        return hashlib.sha256((root / path).read_bytes()).hexdigest()

    def list_volume(self, claim: str, path: str) -> list[str]:
        root = self._claim_root(claim)
        folder = root / path if root is not None else None
        if folder is None or not folder.is_dir():
            return []
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    def kill_operator(self) -> None:
        from kubetune_dev.cluster import process_alive

        pid = self.cluster.state.pids.pop("operator", None)
        self.cluster.state.save()
        if pid is None:
            return
        os.killpg(pid, signal.SIGKILL)
        wait_for(f"the operator (pid {pid}) to die", lambda: not process_alive(pid), 10, 0.05)

    def start_operator(self) -> None:
        self.cluster.start_operator(OPERATOR_SETTINGS)

    def operator_running(self) -> bool:
        from kubetune_dev.cluster import process_alive

        pid = self.cluster.state.pids.get("operator")
        return pid is not None and process_alive(pid)

    def diagnostics(self) -> dict[str, str]:
        return {
            name: self.cluster.log_tail(name, 40)
            for name in ("operator", "podrunner", f"podrunner-{NODE_B}", "kube-controller-manager")
        }

    def close(self) -> None:
        left = self.cluster.stop()
        assert not left, f"processes survived shutdown: {left}"


# ---------------------------------------------------------------------- kind


class KindTarget(Target):
    """A kind cluster prepared by hack/kind-e2e.sh (operator installed with helm)."""

    name = "kind"
    # The data and checkpoint claims are on the StorageClass kubetune-shared (ReadWriteMany,
    # one host folder mounted into every node, hack/kind-e2e.sh): a volume follows its job to
    # any node, and a multi-node plan's pods share one.
    volumes_follow_pods = True
    cheap_volume_reads = False  # each read is a pod
    SHARED_MOUNT = "/var/kubetune-shared"
    """Where kubetune-shared's folder is mounted inside the nodes."""
    pulls_images = True
    enforces_memory_limits = True
    OPERATOR_NAMESPACE = "kubetune-system"
    OPERATOR_SELECTOR = "app.kubernetes.io/name=kubetune"

    def __init__(
        self, kubeconfig: str, trainer_image: str, cluster: str, shared_dir: str | None = None
    ) -> None:
        self.nodes = (f"{cluster}-worker", f"{cluster}-worker2")
        self.shared_dir = Path(shared_dir) if shared_dir else None
        self.kubeconfig = kubeconfig
        self.image = trainer_image
        self.kubectl_bin = shutil.which("kubectl") or "kubectl"
        self.host_address = docker_network_gateway(
            os.environ.get("KIND_EXPERIMENTAL_DOCKER_NETWORK") or "kind"
        )
        self.kubectl("create", "namespace", NAMESPACE, check=False)
        # Trainer pods and this target's data and volume-reader pods run under the
        # `restricted` Pod Security Standard.
        self.kubectl(
            "label",
            "namespace",
            NAMESPACE,
            "--overwrite",
            *(f"{k}={v}" for k, v in RESTRICTED_LABELS.items()),
        )
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(POOL))
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(POOL_B))
        self.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": DATA_CLAIM},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": SHARED_CLASS,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
        )
        # The trainer image carries the tiny-model helpers: write the model and data there.
        script = (
            "from pathlib import Path; "
            "from kubetune_trainer.tiny import make_model, make_records, write_jsonl; "
            f"make_model(Path('/data/{MODEL_PATH}'), arch='llama'); "
            f"write_jsonl(Path('/data/{DATASET_PATH}'), make_records('alpaca', 256))"
        )
        # On the first pool's node, which holds the trainer image.
        self._run_pod("e2e-prepare-data", ["python", "-c", script], timeout=600, node=self.nodes[0])

    def volume_folder(self, claim: str) -> Path:
        """A kubetune-shared claim's folder on this machine: the PV's hostPath inside the
        nodes is under SHARED_MOUNT, which is the host's shared folder."""
        if self.shared_dir is None:
            return super().volume_folder(claim)
        pvc = self.get("persistentvolumeclaim", claim) or {}
        volume = (pvc.get("spec") or {}).get("volumeName")
        assert volume, f"claim {claim} is not bound"
        out = self.kubectl("get", "pv", volume, "-o", "jsonpath={.spec.hostPath.path}")
        inside = Path(out.stdout.strip())
        assert inside.is_relative_to(self.SHARED_MOUNT), f"{claim}: {inside} is not shared"
        return self.shared_dir / inside.relative_to(self.SHARED_MOUNT)

    def kubectl_argv(self) -> list[str]:
        return [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}"]

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.kubectl_argv(), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def _run_pod(
        self,
        name: str,
        command: list[str],
        claim: str = DATA_CLAIM,
        timeout: float = 120,
        node: str | None = None,
    ) -> str:
        """Run a one-off pod of the trainer image with `claim` at /data; its output.

        It runs as the trainer pods do, as a non-root user under the `restricted` Pod
        Security Standard of NAMESPACE.

        It runs where the trainer image is, on a pool node (it tolerates the pools' taint):
        `node` if given, else wherever the claim's volume is.
        """
        pod_name = f"{name}-{uuid.uuid4().hex[:6]}"
        on_pool_node = {"key": "kubetune.io/pool", "operator": "Exists"}
        placement: dict[str, Any] = {
            "tolerations": POOL["spec"]["tolerations"],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [on_pool_node]}]
                    }
                }
            },
        }
        if node:
            placement["nodeSelector"] = {"kubernetes.io/hostname": node}
        self.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod_name},
                "spec": {
                    **placement,
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": self.image,
                            "imagePullPolicy": "Never",
                            "command": command,
                            # The trainer's own user; its caches go to /tmp, not to a HOME
                            # it cannot write.
                            "env": [{"name": "HOME", "value": "/tmp"}],
                            "securityContext": RESTRICTED_CONTAINER,
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
                },
            }
        )

        phases: list[str | None] = []

        def ended() -> bool:
            phases.append(((self.get("pod", pod_name) or {}).get("status") or {}).get("phase"))
            return phases[-1] in ("Succeeded", "Failed")

        with contextlib.suppress(WaitTimeout):  # the pod's phase and logs tell what happened
            wait_for(f"pod {pod_name} to end", ended, timeout, 1.0)
        phase = phases[-1]
        logs = self.kubectl("logs", "-n", NAMESPACE, pod_name, check=False).stdout
        self.kubectl("delete", "pod", "-n", NAMESPACE, pod_name, "--wait=false", check=False)
        if phase != "Succeeded":
            raise AssertionError(f"pod {pod_name} ended {phase}: {logs[-2000:]}")
        return logs

    def read_volume_file(self, claim: str, path: str) -> str | None:
        out = self._run_pod(
            "e2e-read", ["sh", "-c", f"cat /data/{path} 2>/dev/null || echo '<missing>'"], claim
        )
        return None if out.strip() == "<missing>" else out

    def list_volume(self, claim: str, path: str) -> list[str]:
        out = self._run_pod(
            "e2e-list", ["sh", "-c", f"cd /data/{path} 2>/dev/null && find . -type f"], claim
        )
        return sorted(line.removeprefix("./") for line in out.split() if line.strip())

    def volume_sha256(self, claim: str, path: str) -> str | None:
        out = self._run_pod(
            "e2e-sum",
            ["sh", "-c", f"sha256sum /data/{path} 2>/dev/null || echo '<missing>'"],
            claim,
        )
        return None if out.strip() == "<missing>" else out.split()[0]

    def hard_kill(self, pod: str) -> None:
        """SIGKILL every process of the trainer container from its node, as a crash or the
        kernel's OOM killer does: no checkpoint, and the container ends 137.

        From the node, not from inside the container: there the launcher of a one-worker job
        may be PID 1 of its namespace, which ignores a SIGKILL sent from within. A force
        delete is no hard kill under a real kubelet either: the API object goes at once while
        the old container may still run, so its replacement would train beside it on the
        same volume.
        """
        doc = self.get("pod", pod) or {}
        node = doc["spec"]["nodeName"]
        [container_id] = [
            c["containerID"].split("://", 1)[1]
            for c in doc["status"]["containerStatuses"]
            if c["name"] == "trainer" and c.get("containerID")
        ]
        # The container's processes are those whose cgroup path names its id (cgroup v1 or
        # v2, either kubelet cgroup driver); twice, for any forked while the first ran.
        script = (
            'for round in 1 2; do for p in /proc/[0-9]*; do grep -qs "$1" "$p/cgroup" && '
            'kill -9 "${p#/proc/}" 2>/dev/null; done; done; true'
        )
        out = subprocess.run(
            ["docker", "exec", node, "sh", "-c", script, "sh", container_id],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, f"kill the trainer of {pod} on {node}: {out.stderr.strip()}"

    def lose_node(self, node: str) -> str:
        # The node container SIGKILLed: kubelet, containerd and the trainer die at once.
        out = subprocess.run(["docker", "kill", node], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"docker kill {node}: {out.stderr.strip()}"
        return "its node container killed (docker kill)"

    def restore_node(self, node: str) -> None:
        """Start the node container again: its kubelet registers the Node anew (with the
        labels of the cluster config); the GPU taint and the advertised GPUs are put back as
        hack/kind-e2e.sh first set them."""
        out = subprocess.run(["docker", "start", node], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"docker start {node}: {out.stderr.strip()}"

        def ready() -> bool:
            conds = ((self.get("node", node) or {}).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_for(f"node {node} Ready again", ready, 180)
        self.kubectl("taint", "node", node, "nvidia.com/gpu=true:NoSchedule", "--overwrite")
        patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "2"}]
        self.kubectl("patch", "node", node, "--subresource=status", "--type=json",
                     "-p", json.dumps(patch))  # fmt: skip

    def _scale(self, replicas: int) -> None:
        self.kubectl(
            "scale",
            "deployment",
            "-n",
            self.OPERATOR_NAMESPACE,
            "-l",
            self.OPERATOR_SELECTOR,
            f"--replicas={replicas}",
        )

    def kill_operator(self) -> None:
        self._scale(0)
        self.kubectl(
            "delete",
            "pod",
            "-n",
            self.OPERATOR_NAMESPACE,
            "-l",
            self.OPERATOR_SELECTOR,
            "--grace-period=0",
            "--force",
            check=False,
        )

    def start_operator(self) -> None:
        self._scale(1)

    def operator_running(self) -> bool:
        out = self.kubectl(
            "get",
            "pods",
            "-n",
            self.OPERATOR_NAMESPACE,
            "-l",
            self.OPERATOR_SELECTOR,
            "-o",
            "jsonpath={.items[*].status.phase}",
        )
        return "Running" in out.stdout

    def diagnostics(self) -> dict[str, str]:
        out = self.kubectl(
            "logs",
            "-n",
            self.OPERATOR_NAMESPACE,
            "-l",
            self.OPERATOR_SELECTOR,
            "--tail=60",
            check=False,
        )
        return {"operator": out.stdout + out.stderr}


def docker_network_gateway(network: str) -> str:
    """This machine's IPv4 address on a Docker network (its bridge's gateway): the nodes of a
    kind cluster, and their pods through the nodes' masquerading, reach it; loopback they do
    not (each node has its own)."""
    gateways_format = "{{range .IPAM.Config}}{{.Gateway}} {{end}}"
    out = subprocess.run(
        ["docker", "network", "inspect", network, "--format", gateways_format],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise LookupError(f"docker network inspect {network}: {out.stderr.strip()}")
    gateways = [g for g in out.stdout.split() if "." in g]  # IPv4 only; kind's also has IPv6
    if not gateways:
        raise LookupError(f"docker network {network} has no IPv4 gateway: {out.stdout!r}")
    return gateways[0]


def make_target(
    root_factory: Callable[[], Path], binaries: Callable[[], Binaries], block: int = 0
) -> Target:
    """The target named by KUBETUNE_E2E_TARGET; raises LookupError with why it cannot run.

    `binaries` gives the control-plane binaries, which only the local target needs; `block`
    sets the local target's pod addresses apart from another's in the same run (one per
    pytest-xdist worker). A kind cluster is one per run.
    """
    which = os.environ.get("KUBETUNE_E2E_TARGET", "local")
    if which == "local":
        return LocalTarget(root_factory(), binaries(), block)
    if which == "kind":
        kubeconfig = os.environ.get("KUBETUNE_KIND_KUBECONFIG")
        image = os.environ.get("KUBETUNE_KIND_TRAINER_IMAGE", "kubetune/trainer:e2e")
        if not kubeconfig:
            raise LookupError(
                "KUBETUNE_E2E_TARGET=kind needs a kind cluster: run hack/kind-e2e.sh, which "
                "creates one and sets KUBETUNE_KIND_KUBECONFIG"
            )
        return KindTarget(
            kubeconfig,
            image,
            os.environ.get("KIND_CLUSTER_NAME", "kubetune-e2e"),
            os.environ.get("KUBETUNE_KIND_SHARED_DIR"),
        )
    raise LookupError(f"KUBETUNE_E2E_TARGET={which!r}: expected 'local' or 'kind'")
