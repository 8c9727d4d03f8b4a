"""Unit tests for kubetune.control.build (the manifests of one training attempt).

Every builder's output for two reference jobs is compared with an expected YAML file in
`tests/unit/fixtures/builders/` (safe YAML, keys sorted, multi-line strings such as the
ConfigMap's `config.json` in block style so diffs stay readable). After an intentional
change to a builder, rewrite the fixtures and review the diff:

    KUBETUNE_UPDATE_FIXTURES=1 pytest tests/unit/test_builders.py

The behavioural tests below pin down the properties the fixtures only show by example.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetune.api.errors import SpecError
from kubetune.api.v1alpha1 import (
    FineTuneJob,
    FineTuneJobStatus,
    GGUFSettings,
    GPUPool,
    PlanStatus,
)
from kubetune.api.vocabulary import PlanReason
from kubetune.control.build.children import build_children
from kubetune.control.build.config import build_config_map, build_trainer_config
from kubetune.control.build.names import child_names, labels, owner_reference
from kubetune.control.build.network import build_headless_service, build_network_policy
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.stages import build_export
from kubetune.control.build.storage import (
    access_mode,
    build_checkpoint_pvc,
    checkpoint_size,
    single_node,
)
from kubetune.control.build.trainer import build_indexed_job, host_memory_gib
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
    FaultInjection,
    TrainerConfig,
)
from support.podsecurity import restricted_violations

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "builders"
UPDATE = os.environ.get("KUBETUNE_UPDATE_FIXTURES") == "1"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SETTINGS = BuildSettings()
FAULTS_ON = BuildSettings(allow_test_faults=True)
"""A test cluster's operator: it obeys the kubetune.io/test-faults annotation."""


# --------------------------------------------------------------------------- reference jobs


def tiny_lora_job() -> FineTuneJob:
    return FineTuneJob.model_validate(
        {
            "metadata": {"name": "tiny-lora", "namespace": "team-a", "uid": "uid-tiny"},
            "spec": {
                "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M"},
                "dataset": {"uri": "tatsu-lab/alpaca", "format": "alpaca"},
                "method": "lora",
                "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]},
                "training": {"maxSteps": 50, "sequenceLength": 512, "globalBatchSize": 8},
                "checkpoint": {"intervalSteps": 10, "keep": 3},
            },
        }
    )


def tiny_lora_plan() -> PlanStatus:
    return PlanStatus(
        method="lora",
        pool="l4-spot",
        gpu_product="NVIDIA-L4",
        gpu_memory_gib=24,
        nodes=1,
        gpus_per_node=1,
        total_gpus=1,
        spot=True,
        sharding="none",
        precision="bf16",
        optimizer="adamw",
        micro_batch_size=4,
        gradient_accumulation=2,
        gradient_checkpointing=False,
        per_gpu_memory_gib=3.2,
        trainable_params=921_600,
        model_params=134_515_008,
        total_steps=50,
        total_tokens=204_800,
        estimated_tokens_per_second=9000.0,
        estimated_duration_seconds=60.0,
        estimated_cost_usd=0.01,
        price_per_hour_usd=0.35,
    )


def l4_pool() -> GPUPool:
    return GPUPool.model_validate(
        {
            "metadata": {"name": "l4-spot"},
            "spec": {
                "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                "tolerations": [
                    {
                        "key": "cloud.google.com/gke-spot",
                        "operator": "Equal",
                        "value": "true",
                        "effect": "NoSchedule",
                    }
                ],
                "gpu": {"product": "NVIDIA-L4", "memoryGiB": 24, "bf16TFLOPS": 121},
                "gpusPerNode": 1,
                "maxNodes": 4,
                "pricePerGPUHour": 0.35,
                "spot": True,
            },
        }
    )


def full_8b_job() -> FineTuneJob:
    return FineTuneJob.model_validate(
        {
            "metadata": {"name": "llama-8b-full", "namespace": "research", "uid": "uid-8b"},
            "spec": {
                "model": {
                    "uri": "pvc://shared-data/models/Llama-3.1-8B",
                    "architecture": "meta-llama/Llama-3.1-8B",
                    "tokenSecretRef": {"name": "hf-token"},
                },
                "dataset": {
                    "uri": "pvc://shared-data/datasets/chat.jsonl",
                    "format": "chat",
                    "validationSplit": 0.05,
                },
                "method": "full",
                "training": {
                    "epochs": 2,
                    "learningRate": 1e-5,
                    "sequenceLength": 4096,
                    "globalBatchSize": 64,
                },
                "checkpoint": {
                    "intervalMinutes": 20,
                    "storage": {"retention": "delete", "storageClassName": "filestore-rwx"},
                },
                "output": {"uri": "pvc://results/llama-8b-chat"},
                "trainerImage": "registry.example.com/kubetune/trainer:0.1.0-cu124",
            },
        }
    )


def full_8b_plan() -> PlanStatus:
    return PlanStatus(
        revision=2,
        reason=PlanReason.OUT_OF_MEMORY,
        method="full",
        pool="h100",
        gpu_product="NVIDIA-H100-80GB-HBM3",
        gpu_memory_gib=80,
        nodes=2,
        gpus_per_node=8,
        total_gpus=16,
        sharding="full",
        precision="bf16",
        optimizer="adamw",
        micro_batch_size=1,
        gradient_accumulation=4,
        gradient_checkpointing=True,
        per_gpu_memory_gib=61.5,
        trainable_params=8_030_261_248,
        model_params=8_030_261_248,
        total_steps=1200,
        total_tokens=314_572_800,
        estimated_tokens_per_second=120_000.0,
        estimated_duration_seconds=2621.0,
        estimated_cost_usd=45.0,
        price_per_hour_usd=62.0,
    )


def h100_pool() -> GPUPool:
    return GPUPool.model_validate(
        {
            "metadata": {"name": "h100"},
            "spec": {
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                ],
                "gpu": {
                    "product": "NVIDIA-H100-80GB-HBM3",
                    "memoryGiB": 80,
                    "bf16TFLOPS": 989,
                    "interconnect": "nvlink",
                },
                "gpusPerNode": 8,
                "maxNodes": 4,
                "pricePerGPUHour": 3.9,
            },
        }
    )


Case = tuple[FineTuneJob, PlanStatus, GPUPool, int]
CASES: dict[str, Callable[[], Case]] = {
    "tiny-lora": lambda: (tiny_lora_job(), tiny_lora_plan(), l4_pool(), 1),
    "full-8b": lambda: (full_8b_job(), full_8b_plan(), h100_pool(), 3),
}

BUILDERS: dict[str, Callable[[Case], Any]] = {
    "pvc": lambda c: build_checkpoint_pvc(c[0], c[1], SETTINGS),
    "trainer-config": lambda c: build_trainer_config(c[0], c[1], SETTINGS, c[3]).model_dump(
        mode="json"
    ),
    "configmap": lambda c: build_config_map(c[0], c[1], SETTINGS, c[3]),
    "service": lambda c: build_headless_service(c[0], SETTINGS),
    "networkpolicy": lambda c: build_network_policy(c[0], SETTINGS),
    "job": lambda c: build_indexed_job(c[0], c[1], c[2], SETTINGS, c[3]),
}


# --------------------------------------------------------------------------- fixtures


class _FixtureDumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_FixtureDumper.add_representer(str, _represent_str)


def _render(manifest: Any) -> str:
    text: str = yaml.dump(manifest, Dumper=_FixtureDumper, sort_keys=True)
    # The fixture must describe exactly the manifest: it parses back to the same value.
    assert yaml.safe_load(text) == manifest
    return text


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_matches_fixture(case: str, builder: str) -> None:
    rendered = _render(BUILDERS[builder](CASES[case]()))
    path = FIXTURES / f"{case}-{builder}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered, encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with KUBETUNE_UPDATE_FIXTURES=1"
    assert rendered == path.read_text(encoding="utf-8"), (
        f"{path.name} differs; if the change is intended, rerun with KUBETUNE_UPDATE_FIXTURES=1"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_children_in_apply_order(case: str) -> None:
    job, plan, pool, attempt = CASES[case]()
    children = build_children(job, plan, pool, SETTINGS, attempt)
    assert [c["kind"] for c in children] == [
        "PersistentVolumeClaim",
        "ConfigMap",
        "Service",
        "NetworkPolicy",
        "Job",
    ]
    namespace = job.metadata["namespace"]
    for child in children:
        assert child["metadata"]["namespace"] == namespace
        assert child["metadata"]["labels"]["kubetune.io/job"] == job.metadata["name"]
    for child in children[1:]:
        assert child["metadata"]["ownerReferences"] == [owner_reference(job)]


# --------------------------------------------------------------------------- names


def test_child_names_for_short_job() -> None:
    names = child_names("tiny-lora", 2)
    assert names.pvc == "tiny-lora-ckpt"
    assert names.config_map == "tiny-lora-a2"
    assert names.service == "tiny-lora"
    assert names.job == "tiny-lora-a2"


def test_long_job_names_are_shortened_stably() -> None:
    long_name = "a" * 20 + "-fine-tune-of-llama-on-support-tickets-v2"
    assert len(long_name) == 61
    first = child_names(long_name, 7)
    again = child_names(long_name, 7)
    assert first == again
    for name in (first.pvc, first.config_map, first.service, first.job):
        assert len(name) <= 63
        assert DNS_LABEL.match(name), name
    # Room for the pod hostname `<job>-<index>` of an Indexed Job.
    assert len(f"{first.job}-4095") <= 63
    # Shared children keep their names across attempts.
    later = child_names(long_name, 8)
    assert (later.pvc, later.service) == (first.pvc, first.service)
    # Two names that share the long prefix do not collide.
    other = child_names(long_name[:-1] + "3", 7)
    assert other.service != first.service


def test_sixty_char_job_name_fits_everywhere() -> None:
    name = "x" * 60
    job = tiny_lora_job().model_copy(update={"metadata": {"name": name, "namespace": "ns"}})
    for child in build_children(job, tiny_lora_plan(), l4_pool(), SETTINGS, 12):
        assert len(child["metadata"]["name"]) <= 63
        assert DNS_LABEL.match(child["metadata"]["name"])
        for value in child["metadata"]["labels"].values():
            assert len(value) <= 63


@pytest.mark.parametrize("name", ["1st-run", "run.v2", "run.v2.final", "9"])
def test_names_that_are_not_dns_labels_are_cleaned(name: str) -> None:
    # Object names may start with a digit or contain dots; Service names and pod
    # hostnames may not.
    names = child_names(name, 1)
    for child in (names.pvc, names.config_map, names.service, names.job):
        assert DNS_LABEL.match(child), child


def test_cleaned_names_do_not_collide() -> None:
    assert child_names("run.v2", 1).service != child_names("run-v2", 1).service


def test_attempt_must_be_positive() -> None:
    with pytest.raises(ValueError, match="attempt"):
        child_names("job", 0)


def test_labels() -> None:
    job = tiny_lora_job()
    assert labels(job) == {
        "app.kubernetes.io/name": "kubetune-trainer",
        "app.kubernetes.io/managed-by": "kubetune",
        "app.kubernetes.io/instance": "tiny-lora",
        "kubetune.io/job": "tiny-lora",
    }
    assert labels(job, 4)["kubetune.io/attempt"] == "4"


def test_owner_reference() -> None:
    assert owner_reference(full_8b_job()) == {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "name": "llama-8b-full",
        "uid": "uid-8b",
        "controller": True,
        "blockOwnerDeletion": True,
    }


# --------------------------------------------------------------------------- checkpoint volume


def test_pvc_is_rwx_for_several_nodes_and_rwo_for_one() -> None:
    multi = build_checkpoint_pvc(full_8b_job(), full_8b_plan(), SETTINGS)
    single = build_checkpoint_pvc(tiny_lora_job(), tiny_lora_plan(), SETTINGS)
    assert multi["spec"]["accessModes"] == ["ReadWriteMany"]
    assert single["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_explicit_access_mode_wins() -> None:
    job = full_8b_job()
    job.spec.checkpoint.storage.access_mode = "ReadWriteOnce"
    pvc = build_checkpoint_pvc(job, full_8b_plan(), SETTINGS)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_auto_access_mode_follows_the_read_write_many_setting() -> None:
    """With the class known to offer ReadWriteMany, a one-node plan's volume is ReadWriteMany
    too (a later re-plan may span nodes); without, ReadWriteOnce. An explicit mode wins."""
    rwx = replace(SETTINGS, checkpoint_read_write_many=True)
    one_node = build_checkpoint_pvc(tiny_lora_job(), tiny_lora_plan(), rwx)
    assert one_node["spec"]["accessModes"] == ["ReadWriteMany"]
    assert access_mode(tiny_lora_job(), tiny_lora_plan(), SETTINGS) == "ReadWriteOnce"
    job = tiny_lora_job()
    job.spec.checkpoint.storage.access_mode = "ReadWriteOnce"
    assert access_mode(job, tiny_lora_plan(), rwx) == "ReadWriteOnce"


def test_single_node_until_the_volume_can_follow() -> None:
    """Before the claim exists: the job's mode, or with `auto` the operator's setting; once it
    exists, its access modes. Each reason names what to change."""
    rwx = replace(SETTINGS, checkpoint_read_write_many=True)
    job = tiny_lora_job()
    held = single_node(job, SETTINGS, None)
    assert held is not None
    assert "ReadWriteOnce" in held.reason
    assert "operator.checkpointReadWriteMany" in held.fix
    assert "spec.checkpoint.storage.accessMode" in held.fix
    assert single_node(job, rwx, None) is None
    assert single_node(job, SETTINGS, ["ReadWriteMany"]) is None
    existing = single_node(job, rwx, ["ReadWriteOnce"])
    assert existing is not None
    assert "tiny-lora-ckpt is ReadWriteOnce" in existing.reason
    assert "new name" in existing.fix
    job.spec.checkpoint.storage.access_mode = "ReadWriteOnce"
    explicit = single_node(job, rwx, None)
    assert explicit is not None
    assert explicit.reason == "spec.checkpoint.storage.accessMode is ReadWriteOnce"
    assert "ReadWriteMany" in explicit.fix
    job.spec.checkpoint.storage.access_mode = "ReadWriteMany"
    assert single_node(job, SETTINGS, None) is None


def test_pvc_owner_reference_only_with_retention_delete() -> None:
    deleted = build_checkpoint_pvc(full_8b_job(), full_8b_plan(), SETTINGS)
    retained = build_checkpoint_pvc(tiny_lora_job(), tiny_lora_plan(), SETTINGS)
    assert deleted["metadata"]["ownerReferences"] == [owner_reference(full_8b_job())]
    assert deleted["metadata"]["annotations"]["kubetune.io/retention"] == "delete"
    assert "ownerReferences" not in retained["metadata"]
    assert retained["metadata"]["annotations"]["kubetune.io/retention"] == "retain"


def test_storage_class_from_spec_then_settings() -> None:
    settings = BuildSettings(checkpoint_storage_class="standard-rwo")
    from_spec = build_checkpoint_pvc(full_8b_job(), full_8b_plan(), settings)
    from_settings = build_checkpoint_pvc(tiny_lora_job(), tiny_lora_plan(), settings)
    default = build_checkpoint_pvc(tiny_lora_job(), tiny_lora_plan(), SETTINGS)
    assert from_spec["spec"]["storageClassName"] == "filestore-rwx"
    assert from_settings["spec"]["storageClassName"] == "standard-rwo"
    assert "storageClassName" not in default["spec"]


def test_checkpoint_size_explicit() -> None:
    job = tiny_lora_job()
    job.spec.checkpoint.storage.size = "250Gi"
    assert checkpoint_size(job, tiny_lora_plan()) == "250Gi"


def test_checkpoint_size_full_on_own_output_volume() -> None:
    plan = full_8b_plan()
    # keep=2 → 3 copies × 12 B/param, output on another claim, model not from the hub.
    expected = 3 * 12 * plan.model_params + 1024**3
    assert checkpoint_size(full_8b_job(), plan) == f"{-(-expected // 1024**3)}Gi"


def test_checkpoint_size_counts_hub_cache_and_merged_model() -> None:
    job, plan = tiny_lora_job(), tiny_lora_plan()
    plan.model_params = 8_000_000_000
    plan.trainable_params = 40_000_000
    base = 4 * 16 * plan.trainable_params + 2 * plan.model_params + 1024**3
    assert checkpoint_size(job, plan) == f"{-(-base // 1024**3)}Gi"
    job.spec.output.merge_adapter = True
    merged = base + 2 * plan.model_params
    assert checkpoint_size(job, plan) == f"{-(-merged // 1024**3)}Gi"


def test_checkpoint_size_rounds_up_to_whole_gib() -> None:
    job, plan = tiny_lora_job(), tiny_lora_plan()
    job.spec.model.uri = "/models/tiny"
    plan.model_params = 1000
    plan.trainable_params = 10
    # 1 GiB headroom plus a few bytes of adapter.
    assert checkpoint_size(job, plan) == "2Gi"
    plan.trainable_params = 0
    assert checkpoint_size(job, plan) == "1Gi"


# --------------------------------------------------------------------------- trainer config


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_map_round_trips_through_the_contract(case: str) -> None:
    job, plan, _, attempt = CASES[case]()
    cm = build_config_map(job, plan, SETTINGS, attempt)
    config = TrainerConfig.model_validate_json(cm["data"]["config.json"])
    assert config == build_trainer_config(job, plan, SETTINGS, attempt)
    raw = json.loads(cm["data"]["config.json"])
    assert raw["contract_version"] == config.contract_version


def test_trainer_config_hub_model_and_lora() -> None:
    config = build_trainer_config(tiny_lora_job(), tiny_lora_plan(), SETTINGS, 1)
    assert (config.model.kind, config.model.source) == ("hub", "HuggingFaceTB/SmolLM2-135M")
    assert config.model.token_env is None
    assert (config.dataset.kind, config.dataset.source) == ("hub", "tatsu-lab/alpaca")
    assert config.lora is not None and config.lora.rank == 8
    assert config.output.dir == "/checkpoints/output"
    assert config.training.micro_batch_size == 4
    assert config.training.gradient_accumulation == 2
    assert config.training.max_steps == 50
    assert config.training.chunked_cross_entropy is False
    # The attempt is the checkpoint folder's writer epoch (kubetune_trainer.fence).
    assert config.checkpoint.attempt == 1
    assert (
        build_trainer_config(tiny_lora_job(), tiny_lora_plan(), SETTINGS, 4).checkpoint.attempt == 4
    )


def test_the_planned_chunked_loss_reaches_the_trainer() -> None:
    plan = tiny_lora_plan().model_copy(update={"chunked_cross_entropy": True})
    config = build_trainer_config(tiny_lora_job(), plan, SETTINGS, 1)
    assert config.training.chunked_cross_entropy is True


def test_training_log_lives_on_the_checkpoint_volume() -> None:
    config = build_trainer_config(tiny_lora_job(), tiny_lora_plan(), SETTINGS, 1)
    assert config.metrics.log_path == "/checkpoints/train-log.jsonl"
    assert config.faults.oom_at_step is None


@pytest.mark.parametrize(
    ("annotation", "attempt", "step"),
    [
        ('{"oomAtStep": 6}', 1, 6),
        ('{"oomAtStep": 6}', 4, 6),
        ('{"oomAtStep": 6, "attempts": [1]}', 1, 6),
        ('{"oomAtStep": 6, "attempts": [1]}', 2, None),
    ],
)
def test_fault_annotation_reaches_the_listed_attempts(
    annotation: str, attempt: int, step: int | None
) -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": annotation}
    assert (
        build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, attempt).faults.oom_at_step == step
    )


def test_step_seconds_annotation_slows_every_attempt() -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": '{"stepSeconds": 0.25}'}
    for attempt in (1, 2):
        faults = build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, attempt).faults
        assert faults.min_step_seconds == 0.25 and faults.oom_at_step is None
    job.metadata["annotations"] = {
        "kubetune.io/test-faults": '{"stepSeconds": 1, "oomAtStep": 4, "attempts": [2]}'
    }
    assert build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 1).faults.min_step_seconds is None
    faults = build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 2).faults
    assert (faults.min_step_seconds, faults.oom_at_step) == (1.0, 4)


@pytest.mark.parametrize(
    "annotation",
    [
        "{",
        "[]",
        "{}",
        '{"oomAtStep": 0}',
        '{"oomAtStep": true}',
        '{"oom": 3}',
        '{"oomAtStep": 3, "attempts": 1}',
        '{"stepSeconds": 0}',
        '{"stepSeconds": 61}',
        '{"stepSeconds": "1"}',
        '{"oomInPhase": "train"}',
        '{"killAtStep": 3, "killRank": -1}',
        '{"diskFullAtStep": 0}',
    ],
)
def test_bad_fault_annotation_is_a_spec_error(annotation: str) -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": annotation}
    with pytest.raises(SpecError, match=r"kubetune\.io/test-faults") as info:
        build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 1)
    assert "oomAtStep" in str(info.value) and "stepSeconds" in str(info.value)


def test_hang_annotation_reaches_the_listed_attempts() -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": '{"hangAtStep": 8, "attempts": [1]}'}
    assert build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 1).faults.hang_at_step == 8
    assert build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 2).faults.hang_at_step is None
    job.metadata["annotations"] = {"kubetune.io/test-faults": '{"hangAtStep": 0}'}
    with pytest.raises(SpecError, match=r"hangAtStep, killAtStep .* a step >= 1"):
        build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 1)


def test_phase_kill_and_disk_faults_reach_the_trainer_config() -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {
        "kubetune.io/test-faults": '{"oomInPhase": "eval", "killAtStep": 7, "killRank": 1, '
        '"diskFullAtStep": 10, "attempts": [2]}'
    }
    faults = build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 2).faults
    assert (faults.oom_in_phase, faults.kill_at_step, faults.kill_rank) == ("eval", 7, 1)
    assert faults.disk_full_at_step == 10
    assert build_trainer_config(job, tiny_lora_plan(), FAULTS_ON, 1).faults == FaultInjection()


def test_fault_annotation_is_ignored_without_the_setting() -> None:
    job = tiny_lora_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": '{"oomAtStep": 2}'}
    assert build_trainer_config(job, tiny_lora_plan(), SETTINGS, 1).faults.oom_at_step is None
    job.metadata["annotations"] = {"kubetune.io/test-faults": "{oops"}  # not even read
    assert build_trainer_config(job, tiny_lora_plan(), SETTINGS, 1).faults.oom_at_step is None


def test_trainer_config_pvc_model_full() -> None:
    config = build_trainer_config(full_8b_job(), full_8b_plan(), SETTINGS, 3)
    assert config.method == "full"
    assert config.lora is None
    assert (config.model.kind, config.model.source) == (
        "path",
        "/mnt/pvc/shared-data/models/Llama-3.1-8B",
    )
    assert config.model.token_env == "HF_TOKEN"
    assert config.dataset.source == "/mnt/pvc/shared-data/datasets/chat.jsonl"
    assert config.output.dir == "/mnt/pvc/results/llama-8b-chat"
    assert (config.parallel.nodes, config.parallel.gpus_per_node) == (2, 8)
    assert config.job.uid == "uid-8b"


def test_trainer_config_lora_defaults_for_auto_choice() -> None:
    job = tiny_lora_job()
    job.spec.lora = None
    plan = tiny_lora_plan()
    plan.method = "qlora"
    config = build_trainer_config(job, plan, SETTINGS, 1)
    assert config.lora is not None and config.lora.target_modules == ["all-linear"]


@pytest.mark.parametrize(
    ("uri", "kind", "source", "revision"),
    [
        ("meta-llama/Llama-3.1-8B", "hub", "meta-llama/Llama-3.1-8B", None),
        ("hf://Qwen/Qwen2.5-7B@v1.0", "hub", "Qwen/Qwen2.5-7B", "v1.0"),
        ("/models/llama", "path", "/models/llama", None),
        ("pvc://models", "path", "/mnt/pvc/models", None),
        ("pvc://models/llama/", "path", "/mnt/pvc/models/llama", None),
    ],
)
def test_model_uri_mapping(uri: str, kind: str, source: str, revision: str | None) -> None:
    job = tiny_lora_job()
    job.spec.model.uri = uri
    model = build_trainer_config(job, tiny_lora_plan(), SETTINGS, 1).model
    assert (model.kind, model.source, model.revision) == (kind, source, revision)


# --------------------------------------------------------------------------- batch Job


def _pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def _trainer(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod_spec(job)["containers"]
    assert container["name"] == "trainer"
    return dict(container)


def test_pod_failure_policy_uses_contract_exit_codes() -> None:
    built = build_indexed_job(tiny_lora_job(), tiny_lora_plan(), l4_pool(), SETTINGS, 1)
    rules = built["spec"]["podFailurePolicy"]["rules"]
    summary = [
        (r["action"], tuple(r["onExitCodes"]["values"]) if "onExitCodes" in r else "disruption")
        for r in rules
    ]
    assert summary == [
        ("Ignore", (EXIT_PREEMPTED,)),
        ("Ignore", "disruption"),
        ("FailJob", (EXIT_OOM,)),
        ("FailJob", (EXIT_CONFIG_ERROR, EXIT_STOPPED, EXIT_CHECKPOINT_FAILED, EXIT_SUPERSEDED)),
    ]
    for rule in rules:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == "trainer"
            assert rule["onExitCodes"]["operator"] == "In"
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert _pod_spec(built)["restartPolicy"] == "Never"


def test_restricted_pod_security() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 1)
    pod = _pod_spec(built)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == pod["runAsGroup"] == pod["fsGroup"] == 1000
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _trainer(built)["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in _trainer(built)["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/checkpoints", "/etc/kubetune"} <= mounts
    for volume in _pod_spec(built)["volumes"]:
        assert "hostPath" not in volume


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_pods_meet_the_restricted_pod_security_standard(case: str) -> None:
    """Trainer pods run in namespaces that enforce `restricted` (the integration and e2e
    tiers label theirs so): every check of that standard passes, and the checker does see
    what the builders would lose."""
    job, plan, pool, attempt = CASES[case]()
    pod = _pod_spec(build_indexed_job(job, plan, pool, SETTINGS, attempt))
    assert restricted_violations(pod) == []
    loose = json.loads(json.dumps(pod))
    del loose["securityContext"]["seccompProfile"]
    del loose["securityContext"]["runAsNonRoot"]
    loose["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    loose["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert restricted_violations(loose) == [
        "volume host of type ['hostPath']",
        "trainer: allowPrivilegeEscalation != false",
        "trainer: capabilities do not drop ALL",
        "trainer: adds capabilities ['SYS_ADMIN']",
        "trainer: runAsNonRoot != true",
        "trainer: seccompProfile None",
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_limit_and_indexed_layout(case: str) -> None:
    job, plan, pool, attempt = CASES[case]()
    built = build_indexed_job(job, plan, pool, SETTINGS, attempt)
    assert built["spec"]["completionMode"] == "Indexed"
    assert built["spec"]["completions"] == built["spec"]["parallelism"] == plan.nodes
    assert built["spec"]["backoffLimit"] == SETTINGS.backoff_limit
    assert "activeDeadlineSeconds" not in built["spec"]
    resources = _trainer(built)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == str(plan.gpus_per_node)
    assert _pod_spec(built)["nodeSelector"] == pool.spec.node_selector
    assert _pod_spec(built)["subdomain"] == child_names(job.metadata["name"], attempt).service
    gpu_tolerations = [
        t for t in _pod_spec(built)["tolerations"] if t.get("key") == "nvidia.com/gpu"
    ]
    assert gpu_tolerations == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_resource_requests_scale_with_gpus() -> None:
    settings = BuildSettings(cpu_per_gpu="1500m", memory_per_gpu="1.5Gi")
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), settings, 1)
    assert _trainer(built)["resources"]["requests"] == {"cpu": "12000m", "memory": "12Gi"}


def test_trainer_memory_limit_equals_its_request_unless_turned_off() -> None:
    # Within its own limit the kernel kills the trainer (OOMKilled, which the operator
    # answers with more memory) rather than the kubelet evicting pods under node pressure.
    settings = BuildSettings(memory_per_gpu="1.5Gi")
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), settings, 1)
    resources = _trainer(built)["resources"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == "12Gi"
    off = replace(settings, memory_limit=False)
    resources = _trainer(build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), off, 1))[
        "resources"
    ]
    assert resources["requests"]["memory"] == "12Gi"
    assert resources["limits"] == {"nvidia.com/gpu": "8"}


def test_trainer_memory_grows_with_offloaded_activations_and_the_host_memory_scale() -> None:
    offloading = full_8b_plan().model_copy(
        update={"activation_offloading": True, "host_offload_gib": 5.5}
    )
    assert host_memory_gib(full_8b_plan(), SETTINGS) == 128.0  # 16Gi x 8 GPUs
    assert host_memory_gib(offloading, SETTINGS) == 133.5
    scaled = offloading.model_copy(update={"host_memory_scale": 1.5})
    assert host_memory_gib(scaled, SETTINGS) == 200.25
    built = build_indexed_job(full_8b_job(), scaled, h100_pool(), SETTINGS, 1)
    resources = _trainer(built)["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "205056Mi"
    # What the plan recorded when it was made wins over the settings of today.
    recorded = scaled.model_copy(update={"host_memory_gib": 24.0})
    built = build_indexed_job(full_8b_job(), recorded, h100_pool(), SETTINGS, 1)
    assert _trainer(built)["resources"]["limits"]["memory"] == "24Gi"


def test_torchrun_single_node_is_standalone() -> None:
    built = build_indexed_job(tiny_lora_job(), tiny_lora_plan(), l4_pool(), SETTINGS, 1)
    container = _trainer(built)
    assert container["command"] == ["python", "-m", "kubetune_trainer.launch"]
    assert container["args"] == [
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "-m",
        "kubetune_trainer",
        "--config",
        "/etc/kubetune/config.json",
    ]


def test_torchrun_multi_node_rendezvous() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 3)
    args = _trainer(built)["args"]
    assert "--standalone" not in args
    assert args[:5] == [
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=llama-8b-full-a3-0.llama-8b-full:29400",
        "--rdzv-id=uid-8b-a3",
    ]
    assert "--rdzv-conf=join_timeout=1800" in args
    assert args[-5:] == [
        "--max-restarts=0",
        "-m",
        "kubetune_trainer",
        "--config",
        "/etc/kubetune/config.json",
    ]


def test_env() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 3)
    env = {e["name"]: e for e in _trainer(built)["env"]}
    assert env["KUBETUNE_CONFIG"]["value"] == "/etc/kubetune/config.json"
    assert env["KUBETUNE_ATTEMPT"]["value"] == "3"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["HF_HOME"]["value"] == "/checkpoints/.hf-cache"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["PYTHONUNBUFFERED"]["value"] == "1"
    no_token = build_indexed_job(tiny_lora_job(), tiny_lora_plan(), l4_pool(), SETTINGS, 1)
    assert "HF_TOKEN" not in {e["name"] for e in _trainer(no_token)["env"]}


def test_pvc_claims_mounted_once_each() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 1)
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in _pod_spec(built)["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert sorted(claims) == ["llama-8b-full-ckpt", "results", "shared-data"]
    mounts = {m["mountPath"]: m for m in _trainer(built)["volumeMounts"]}
    assert mounts["/mnt/pvc/shared-data"].get("readOnly") is True
    assert "readOnly" not in mounts["/mnt/pvc/results"]
    assert "readOnly" not in mounts["/checkpoints"]
    assert len(mounts) == len(_trainer(built)["volumeMounts"])
    volume_names = [v["name"] for v in _pod_spec(built)["volumes"]]
    assert len(volume_names) == len(set(volume_names))


def test_claim_used_for_input_and_output_is_writable() -> None:
    job = full_8b_job()
    job.spec.output.uri = "pvc://shared-data/out"
    built = build_indexed_job(job, full_8b_plan(), h100_pool(), SETTINGS, 1)
    mounts = [m for m in _trainer(built)["volumeMounts"] if m["mountPath"].startswith("/mnt")]
    assert mounts == [{"name": "pvc-shared-data", "mountPath": "/mnt/pvc/shared-data"}]


def test_pod_template_annotations_and_labels() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 3)
    meta = built["spec"]["template"]["metadata"]
    # The job's uid too: the pods of a deleted job of the same name are not this one's.
    assert meta["labels"] == {**labels(full_8b_job(), 3), "kubetune.io/job-uid": "uid-8b"}
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert meta["annotations"]["prometheus.io/port"] == "9400"
    assert meta["annotations"]["kubetune.io/plan-revision"] == "2"


def test_service_is_headless_and_selects_all_attempts() -> None:
    svc = build_headless_service(full_8b_job(), SETTINGS)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"kubetune.io/job": "llama-8b-full"}
    assert {p["port"] for p in svc["spec"]["ports"]} == {29400, 9400}


def test_builders_are_deterministic() -> None:
    first = build_children(*CASES["full-8b"]()[:3], SETTINGS, 3)
    second = build_children(*CASES["full-8b"]()[:3], SETTINGS, 3)
    assert first == second


def test_long_claim_names_give_valid_volume_names() -> None:
    job = full_8b_job()
    claim = "team." + "c" * 70
    job.spec.model.uri = f"pvc://{claim}/models/llama"
    built = build_indexed_job(job, full_8b_plan(), h100_pool(), SETTINGS, 1)
    (volume,) = [
        v
        for v in _pod_spec(built)["volumes"]
        if v.get("persistentVolumeClaim", {}).get("claimName") == claim
    ]
    assert len(volume["name"]) <= 63 and DNS_LABEL.match(volume["name"])
    mounts = [m for m in _trainer(built)["volumeMounts"] if m["name"] == volume["name"]]
    assert [m["mountPath"] for m in mounts] == [f"/mnt/pvc/{claim}"]


@pytest.mark.parametrize(("grace", "shutdown"), [(120, "110"), (600, "590"), (30, "20"), (12, "5")])
def test_the_launcher_gives_up_on_workers_before_the_kubelet_does(
    grace: int, shutdown: str
) -> None:
    settings = BuildSettings(termination_grace_seconds=grace)
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), settings, 1)
    env = {e["name"]: e.get("value") for e in _trainer(built)["env"]}
    assert env["KUBETUNE_SHUTDOWN_TIMEOUT"] == shutdown
    assert _pod_spec(built)["terminationGracePeriodSeconds"] == grace


def test_a_trainer_that_wrote_no_message_is_explained_by_its_log() -> None:
    built = build_indexed_job(full_8b_job(), full_8b_plan(), h100_pool(), SETTINGS, 1)
    assert _trainer(built)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_a_hub_datasets_revision_reaches_the_trainer_and_a_files_does_not() -> None:
    job = tiny_lora_job()
    job.spec.dataset.uri = "tatsu-lab/alpaca"
    job.spec.dataset.revision = "0123abc"
    dataset = build_trainer_config(job, tiny_lora_plan(), SETTINGS, 1).dataset
    assert (dataset.kind, dataset.source, dataset.revision) == (
        "hub",
        "tatsu-lab/alpaca",
        "0123abc",
    )
    job.spec.dataset.uri = "pvc://data/train.jsonl"
    assert build_trainer_config(job, tiny_lora_plan(), SETTINGS, 1).dataset.revision is None


def test_export_job_matches_fixture() -> None:
    """The GGUF export step of the full 8B job (a `pvc://` output): the ConfigMap and Job."""
    job = full_8b_job()
    job.spec.output.gguf = GGUFSettings(quantization="q8_0")
    job.status = FineTuneJobStatus(plan=full_8b_plan())
    rendered = _render(build_export(job, SETTINGS))
    path = FIXTURES / "full-8b-export.yaml"
    if UPDATE:
        path.write_text(rendered, encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with KUBETUNE_UPDATE_FIXTURES=1"
    assert rendered == path.read_text(encoding="utf-8"), (
        f"{path.name} differs; if the change is intended, rerun with KUBETUNE_UPDATE_FIXTURES=1"
    )


def test_the_plans_memory_savers_reach_the_trainer_config() -> None:
    plain = build_trainer_config(full_8b_job(), full_8b_plan(), SETTINGS, 1).training
    assert not plain.optimizer_in_backward and not plain.chunked_cross_entropy
    saving = full_8b_plan().model_copy(
        update={"optimizer_in_backward": True, "chunked_cross_entropy": True}
    )
    training = build_trainer_config(full_8b_job(), saving, SETTINGS, 1).training
    assert training.optimizer_in_backward and training.chunked_cross_entropy
