"""`kubetune demo`: the whole product on this machine, with no GPU and no cloud.

Starts the local control plane, installs the CRDs, turns this machine into a one-node GPU
pool whose pods run as local processes (the local pod runner), writes a tiny random-init
model and an Alpaca-style dataset onto a volume, starts the operator, applies
`examples/tiny-cpu-lora.yaml`, and shows the job's plan and live progress until it ends.
The trainer really trains (on CPU); the GPU is simulated only for the scheduler.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kubetune.api.crdgen import render_all
from kubetune.cli.follow import Watcher, outcome
from kubetune_dev.binaries import ensure_binaries
from kubetune_dev.cluster import ClusterError, LocalCluster

Say = Callable[[str], None]
Read = Callable[[str, str, str | None], dict[str, Any] | None]

DEMO_JOB = "tiny-cpu-lora"
DEMO_CLAIM = "kubetune-demo"
LOCAL_POOL: dict[str, Any] = {
    "apiVersion": "kubetune.io/v1alpha1",
    "kind": "GPUPool",
    "metadata": {"name": "local-cpu"},
    "spec": {
        "nodeSelector": {"kubetune.io/pool": "local-cpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # One simulated GPU backed by this machine's CPU; the price only makes cost visible.
        "gpu": {"product": "local-cpu", "memoryGiB": 16, "bf16TFLOPS": 1},
        "gpusPerNode": 1,
        "maxNodes": 1,
        "pricePerGPUHour": 0.5,
    },
}


def _example_job() -> dict[str, Any]:
    path = Path(__file__).resolve().parents[3] / "examples" / f"{DEMO_JOB}.yaml"
    if not path.exists():
        raise ClusterError(f"{path} not found: run the demo from a kubetune checkout")
    return dict(yaml.safe_load(path.read_text()))


def _wait(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")


def _get(cluster: LocalCluster, *args: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def prepare_data(
    cluster: LocalCluster, say: Say, namespace: str = "default", claim: str = DEMO_CLAIM
) -> Path:
    """A volume holding a tiny model, its tokenizer and an Alpaca-style dataset."""
    from kubetune_trainer.tiny import make_model, make_records, write_jsonl

    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": namespace},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
        ]
    )

    root = Path(_wait("the data volume to bind", lambda: claim_path(cluster, namespace, claim), 30))
    say(f"writing a tiny Llama-style model and 256 Alpaca records to {root}")
    make_model(root / "models" / "tiny-llama", arch="llama")
    write_jsonl(root / "data" / "alpaca-tiny.jsonl", make_records("alpaca", 256))
    return root


def claim_path(
    cluster: LocalCluster, namespace: str, claim: str, get: Read | None = None
) -> str | None:
    """The host folder behind a bound claim (the local provisioner's hostPath volumes).
    `get` reads an object (kind, name, namespace or None; None when there is none), a
    kubectl process per read where not given."""
    read = get or (lambda kind, name, ns: _get(cluster, kind, name, *(["-n", ns] if ns else [])))
    pvc = read("pvc", claim, namespace)
    volume = ((pvc or {}).get("spec") or {}).get("volumeName")
    pv = read("pv", volume, None) if volume else None
    return (((pv or {}).get("spec") or {}).get("hostPath") or {}).get("path")


def follow(cluster: LocalCluster, say: Say, timeout: float) -> dict[str, Any]:
    """What `kubetune watch` prints, until the demo job ends."""
    watcher = Watcher()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        obj = _get(cluster, "finetunejob", DEMO_JOB, "-n", "default") or {}
        for line in watcher.update(obj):
            say(line)
        if outcome(obj):
            return obj
        time.sleep(1.0)
    raise ClusterError(f"the demo job did not finish within {timeout:.0f}s")


def run_demo(root: Path, keep: bool, say: Say, timeout: float = 900.0) -> int:
    t0 = time.monotonic()
    binaries = ensure_binaries(say)
    cluster = LocalCluster(root, binaries, progress=say)
    try:
        cluster.start()
        cluster.apply([yaml.safe_load(text) for text in render_all().values()])
        cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")
        cluster.add_local_pool(LOCAL_POOL)
        prepare_data(cluster, say)
        # Faster than production (10 s, 15 s, 60 s) so that a one-minute run shows progress.
        cluster.start_operator(
            {
                "KUBETUNE_POLL_SECONDS": "2",
                "KUBETUNE_QUEUE_RETRY_SECONDS": "3",
                "KUBETUNE_PROGRESS_WRITE_SECONDS": "2",
                # The local provisioner serves ReadWriteMany volumes (docs/local-cluster.md).
                "KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "true",
            }
        )
        cluster.apply([_example_job()])
        say(
            f"applied examples/{DEMO_JOB}.yaml; following it as `kubetune watch {DEMO_JOB}` "
            "does (`kubetune get` and `kubectl get ftj` show the same)"
        )
        obj = follow(cluster, say, timeout)
        phase = obj["status"]["phase"]
        say(f"{phase} in {time.monotonic() - t0:.0f}s: {obj['status'].get('message', '')}")
        if phase == "Succeeded":
            outputs = sorted(p for p in cluster.volumes.rglob("output/*") if p.is_file())
            for path in outputs[:10]:
                say(f"  output: {path}")
        return 0 if phase == "Succeeded" else 1
    except ClusterError as exc:
        say(f"demo failed: {exc}")
        for name in ("operator", "podrunner"):
            say(f"--- {name} log (tail) ---\n{cluster.log_tail(name, 25)}")
        return 1
    finally:
        if keep:
            say(
                f"cluster left running: export KUBECONFIG={cluster.kubeconfig}; "
                "stop it with `kubetune dev down --root " + str(root) + "`"
            )
        else:
            left = cluster.stop()
            say("cluster stopped" + (f"; still running: {left}" if left else ""))
