"""What a run sets up: the control plane's knobs, kwok's stages, the simulated pools, the
operator's environment and the job mix, every job a different question for the planner."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

GROUP, VERSION = "kubetune.io", "v1alpha1"
LABEL_JOB = "kubetune.io/job"
POD_LOOPBACK_CIDR = "127.16.0.0/12"
"""kwok's pod addresses: on loopback, where nothing listens on the trainers' metrics port."""
DROPPED_STAGES = frozenset({"pod-complete"})
"""kwok stages left out, so that trainer pods stay Running."""
ENDPOINT_CONTROLLERS_OFF = (
    "--controllers=-endpoints-controller,-endpointslice-controller,"
    "-endpointslice-mirroring-controller"
)
"""Endpoints of the trainers' headless Services: no use without DNS or kube-proxy, and the
controllers would retry loopback pod addresses (which Endpoints refuse) forever."""
SCALE_TEST_QPS = 100
"""The client rate limit (QPS and burst) Kubernetes' own 5,000-node scalability tests give
kube-controller-manager and kube-scheduler; their defaults are 20/30 and 50/100."""


def gpu_bin_packing() -> dict[str, Any]:
    """A kube-scheduler profile that fills the busiest node's GPUs first (MostAllocated on
    nvidia.com/gpu, no balancing of CPU and memory): what the operator's queue assumes when
    it reserves GPUs (best fit), and what keeps whole nodes free for multi-GPU jobs. The
    default profile spreads pods, so one-GPU pods fragment the nodes."""
    return {
        "profiles": [
            {
                "schedulerName": "default-scheduler",
                "plugins": {"score": {"disabled": [{"name": "NodeResourcesBalancedAllocation"}]}},
                "pluginConfig": [
                    {
                        "name": "NodeResourcesFit",
                        "args": {
                            "scoringStrategy": {
                                "type": "MostAllocated",
                                "resources": [
                                    {"name": "nvidia.com/gpu", "weight": 10},
                                    {"name": "cpu", "weight": 1},
                                    {"name": "memory", "weight": 1},
                                ],
                            }
                        },
                    }
                ],
            }
        ]
    }


# The job mix: pairwise coprime lengths (11, 3, 4, 5), so the first 660 jobs are 660
# different combinations, and a dataset size of its own for every job on top.
MODELS = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "Qwen/Qwen2.5-1.5B",
    "google/gemma-2-2b",
    "microsoft/phi-2",
    "meta-llama/Llama-3.2-3B",
    "Qwen/Qwen3-4B",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-14B",
)
METHODS = ("lora", "qlora", "full")
SEQUENCE_LENGTHS = (512, 1024, 2048, 4096)
GPU_COUNTS = (1, 2, 4, 8, 16)


OPERATOR_DEFAULTS = {
    # The jobs name hub models; with the stage-in step on, each would first run a CPU pod
    # that fetches its model into the namespace's cache, which kwok's nodes (GPU-tainted,
    # pods that never complete) cannot run: the trainer fetches instead, as a job whose
    # model the stage-in step leaves alone does.
    "KUBETUNE_STAGE_IN_HUB": "false",
    # The 16-GPU jobs span two nodes, which the planner offers only with ReadWriteMany
    # checkpoint volumes; the local provisioner serves them.
    "KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "true",
}
"""The operator's environment unless --operator-env says otherwise."""


def pool_docs(nodes_per_pool: int) -> list[dict[str, Any]]:
    from kubetune_dev.cli import simulated_pool_docs

    docs = simulated_pool_docs()
    for doc in docs:
        doc["spec"]["maxNodes"] = nodes_per_pool
    return docs


def running_stages(default_stages: str) -> str:
    """kwok's default Stage documents without `DROPPED_STAGES`: pods go Running and stay."""
    kept = []
    names = set()
    for doc in yaml.safe_load_all(default_stages):
        if not doc:
            continue
        name = str((doc.get("metadata") or {}).get("name", ""))
        names.add(name)
        if name not in DROPPED_STAGES:
            kept.append(doc)
    missing = {"pod-ready", "pod-delete", "node-initialize"} - names
    if missing:
        raise ValueError(
            f"kwok's stage file has no {', '.join(sorted(missing))} stage; to fix: rebuild the "
            "binaries (python -m kubetune_dev.binaries build) so the stage file matches kwok"
        )
    return yaml.safe_dump_all(kept, sort_keys=False)


@dataclass(frozen=True)
class JobPlan:
    """One FineTuneJob to create: where, and the planner question it asks."""

    namespace: str
    name: str
    model: str
    method: str
    sequence_length: int
    num_examples: int
    gpus: int

    def question(self) -> tuple[str, str, int, int, int]:
        return (self.model, self.method, self.sequence_length, self.num_examples, self.gpus)

    def doc(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FineTuneJob",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "model": {"uri": self.model},
                "dataset": {
                    "uri": "/data/train.jsonl",
                    "numExamples": self.num_examples,
                    "avgTokensPerExample": 300,
                },
                "method": self.method,
                "training": {"sequenceLength": self.sequence_length, "globalBatchSize": 32},
                "resources": {"gpus": self.gpus},
            },
        }


def job_mix(
    n: int, namespaces: int, feasible: Callable[[JobPlan], bool] = lambda _: True
) -> list[JobPlan]:
    """`n` jobs spread over `namespaces` namespaces, no two alike; a combination the planner
    cannot place gets the next method, then the next GPU count, that it can."""
    jobs = []
    for i in range(n):
        base = JobPlan(
            namespace=f"scale-{i % namespaces:02d}",
            name=f"ftj-{i:05d}",
            model=MODELS[i % len(MODELS)],
            method=METHODS[i % len(METHODS)],
            sequence_length=SEQUENCE_LENGTHS[i % len(SEQUENCE_LENGTHS)],
            num_examples=1000 + 13 * i,
            gpus=GPU_COUNTS[i % len(GPU_COUNTS)],
        )
        candidates = (
            replace(
                base,
                method=METHODS[(i + dm) % len(METHODS)],
                gpus=GPU_COUNTS[(i + dg) % len(GPU_COUNTS)],
            )
            for dg in range(len(GPU_COUNTS))
            for dm in range(len(METHODS))
        )
        chosen = next((c for c in candidates if feasible(c)), None)
        if chosen is None:
            raise ValueError(f"no method or GPU count of {GPU_COUNTS} fits {base.model}")
        jobs.append(chosen)
    return jobs


def planner_check(pools: Sequence[Mapping[str, Any]]) -> Callable[[JobPlan], bool]:
    """Whether the planner places a job on `pools` at all (free capacity aside)."""
    from kubetune.api.errors import KubetuneError
    from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
    from kubetune.planning.planner import plan_job
    from kubetune.sources import load_arch

    models = [GPUPool.model_validate(p) for p in pools]
    seen: dict[tuple[str, str, int, int], bool] = {}

    def feasible(job: JobPlan) -> bool:
        key = (job.model, job.method, job.sequence_length, job.gpus)
        if key not in seen:
            spec = FineTuneJobSpec.model_validate(job.doc()["spec"])
            try:
                plan_job(spec, models, load_arch(job.model, local_files=False))
                seen[key] = True
            except KubetuneError:
                seen[key] = False
        return seen[key]

    return feasible
