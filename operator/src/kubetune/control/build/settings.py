"""The operator-wide knobs every builder reads (Helm values, environment, CLI flags)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubetune.api.vocabulary import METRICS_SCRAPER_LABEL


@dataclass(frozen=True)
class BuildSettings:
    """Operator-wide knobs for the children (Helm values / CLI flags)."""

    trainer_image: str = "kubetune/trainer:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    checkpoint_storage_class: str | None = None
    """StorageClass for checkpoint volumes when the job names none (cluster default if unset)."""
    checkpoint_read_write_many: bool = False
    """The checkpoint StorageClass offers ReadWriteMany: jobs with access mode `auto` get a
    ReadWriteMany volume from the start and may span nodes; off, theirs is ReadWriteOnce and
    their plans stay on one node."""
    termination_grace_seconds: int = 120
    """Time the trainer gets after SIGTERM to finish its emergency checkpoint."""
    metrics_port: int = 9400
    rendezvous_port: int = 29400
    backoff_limit: int = 3
    network_policy: bool = True
    """Create a NetworkPolicy with each job's children (`build_network_policy`)."""
    operator_namespace: str | None = None
    """Namespace of the operator's pods, which scrape the trainers' metrics port; None (the
    operator runs outside the cluster): the NetworkPolicy names no operator peer."""
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    """Labels that select the operator's pods in `operator_namespace`."""
    metrics_from: tuple[dict[str, Any], ...] = (
        {"namespaceSelector": {"matchLabels": {METRICS_SCRAPER_LABEL: "true"}}},
    )
    """NetworkPolicyPeers (podSelector / namespaceSelector / ipBlock) besides the operator
    that may reach the trainers' metrics port, e.g. Prometheus; empty: none."""
    shm_size: str = "8Gi"
    """Size of the memory-backed /dev/shm (NCCL and data loader workers use it)."""
    tmp_size: str = "10Gi"
    """Size limit of the /tmp emptyDir (the root filesystem is read-only)."""
    cpu_per_gpu: str = "4"
    """CPU request per GPU of the pod."""
    memory_per_gpu: str = "16Gi"
    """Host memory per GPU of the pod, before what the plan adds (`host_memory_gib`)."""
    memory_limit: bool = True
    """Give the trainer container a memory limit equal to its request; off: a request only."""
    launcher: tuple[str, ...] = ("python", "-m", "kubetune_trainer.launch")
    """Container command; it receives torchrun's arguments. The trainer's launcher runs
    torchrun in-process and exits with the workers' contract code (torchrun alone exits 1
    for every worker failure, which would hide OOM and preemption from podFailurePolicy); one
    worker on one node runs in the launcher's own process, without torchrun."""
    rendezvous_join_timeout_seconds: int = 1800
    """How long the first pod waits for its peers to be scheduled before giving up."""
    allow_test_faults: bool = False
    """Obey the `kubetune.io/test-faults` annotation (test clusters only): off, it is ignored."""
    cache_size: str = "200Gi"
    """Size of a namespace's model and data cache claim (`kubetune-cache`) when created."""
    cache_storage_class: str | None = None
    """StorageClass of the cache claim (it must offer ReadWriteMany where trainer pods of
    several nodes read it); unset: the checkpoint StorageClass, else the cluster default."""
    stage_in_cpu: str = "2"
    stage_in_memory: str = "8Gi"
    """CPU and memory requests of a stage-in or stage-out pod (it downloads and tokenizes the
    data, or hashes and uploads the output)."""
    export_cpu: str = "4"
    export_memory: str = "16Gi"
    """CPU and memory requests of an export pod. llama.cpp's converter reads the model
    lazily, one tensor at a time through the page cache, so it needs a few GiB beyond the
    largest tensor, not the whole model; the quantizer uses every CPU it gets."""
    stage_in_node_selector: tuple[tuple[str, str], ...] = ()
    stage_in_tolerations: tuple[dict[str, Any], ...] = ()
    """Where stage-in pods may run: by default any node, preferring ones without a GPU; a
    cluster whose only nodes are tainted GPU nodes gives the tolerations."""
    stage_in_hub: bool = True
    """Fetch hub models and datasets in the stage-in step (into the shared cache) rather
    than in the trainer pods; off: rank 0 of the trainer downloads them, as GPUs wait."""
    hub_endpoint: str | None = None
    """HF_ENDPOINT of stage-in and trainer pods (a hub mirror); unset: huggingface.co."""
    cache_max_bytes: int | None = None
    """Evict least-recently-used cache entries above this many bytes (stage-in step)."""
    cache_volume: Mapping[str, Any] | None = None
    """A pod volume source (`{"csi": {...}}`, `{"nfs": {...}}`) every namespace's stage-in and
    trainer pods mount as the cache instead of a claim of their own: one cache for the
    cluster. None: a claim `kubetune-cache` per namespace."""
