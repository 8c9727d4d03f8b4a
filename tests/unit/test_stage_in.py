"""The stage-in step of a job with S3 sources: built CPU-only before any trainer pod, its
result read from its pod, the plan made with what it measured, its failures the job's."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from kubetune.api.v1alpha1 import LabelSelector
from kubetune.api.vocabulary import ConditionType, Reason, StepKind
from kubetune.control import conditions as c
from kubetune.control.build.children import build_children
from kubetune.control.build.paths import CACHE_DIR
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.stages import (
    STEP_CONFIG_KEY,
    build_stage_in,
    fetched_sources,
    needs_stage_in,
)
from kubetune.control.build.storage import CACHE_CLAIM
from kubetune.control.reconcile import Observed, may_create_stage_in
from kubetune.controller.settings import settings_from_env
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, StageInConfig, StageInResult
from support.reconcile import SETTINGS, T0, make_job, run, step_job, step_pod

S3_JOB: dict[str, Any] = {
    "model": {"uri": "Qwen/Qwen2.5-7B"},
    "dataset": {"uri": "s3://data/support/train.jsonl", "numExamples": 20000},
    "s3": {"credentialsSecret": "s3-creds", "region": "eu-west-1",
           "endpoint": "http://minio.storage:9000"},
}  # fmt: skip
RESULT = StageInResult(
    model_path="/cache/models/qwen",
    dataset_path="/cache/datasets/train-abc/train.jsonl",
    examples=50_000,
    tokens=20_000_000,
    packed_sequences=9_800,
    downloaded_bytes=123_456,
    reused_bytes=0,
    seconds=42.0,
)


def stage_in_job(*conditions: str) -> dict[str, Any]:
    return step_job(StepKind.STAGE_IN, *conditions)


def stage_in_pod(code: int | None, message: str = "") -> dict[str, Any]:
    return step_pod(StepKind.STAGE_IN, code, message)


def seen(job: dict[str, Any] | None = None, *pods: dict[str, Any]) -> Observed:
    return Observed(pools=default_pools(), stage_in_job=job, stage_in_pods=list(pods))


def test_what_needs_a_stage_in() -> None:
    build = BuildSettings()
    assert needs_stage_in(make_job(**S3_JOB), build)
    assert needs_stage_in(
        make_job(model={"uri": "s3://models/qwen", "architecture": "Qwen/Qwen2.5-7B"}), build
    )
    # A hub model or dataset, an https dataset: fetched before any GPU waits for them.
    assert fetched_sources(make_job(model={"uri": "Qwen/Qwen2.5-7B"}), build) == ["Qwen/Qwen2.5-7B"]
    https = {"uri": "https://data.example.com/train.jsonl"}
    assert fetched_sources(make_job(dataset=https), build) == [https["uri"]]
    # Unless the operator is told to let the trainer download from the hub.
    assert not needs_stage_in(make_job(model={"uri": "Qwen/Qwen2.5-7B"}),
                              BuildSettings(stage_in_hub=False))  # fmt: skip
    # A model on a claim with no architecture named: its config.json is read first.
    no_arch = make_job(model={"uri": "pvc://models/qwen", "architecture": None})
    assert needs_stage_in(no_arch, build) and fetched_sources(no_arch, build) == []
    # Everything on claims and described: nothing to do before the plan.
    assert not needs_stage_in(make_job(), build)


def test_only_a_look_that_may_create_the_stage_in_asks_what_other_jobs_read() -> None:
    # What other jobs read from the cache (kept by the step's eviction) is linear in the
    # jobs; the operator looks it up only for a look that may create the step.
    fresh = make_job(**S3_JOB)
    assert may_create_stage_in(fresh, seen(), SETTINGS)
    assert not may_create_stage_in(fresh, seen(stage_in_job()), SETTINGS)  # already created
    assert not may_create_stage_in(make_job(), seen(), SETTINGS)  # nothing to stage in
    done = seen(stage_in_job("Complete"), stage_in_pod(0, RESULT.model_dump_json()))
    staged, _ = run(run(fresh)[0], done, now=T0 + timedelta(seconds=60))
    assert staged.status is not None and staged.status.stage_in is not None
    assert not may_create_stage_in(staged, seen(), SETTINGS)  # its step's child went away


def test_the_stage_in_pod_asks_for_no_gpu_and_reads_the_store_with_the_jobs_credentials() -> None:
    pvc, config_map, batch = build_stage_in(make_job(**S3_JOB), BuildSettings())
    assert pvc["metadata"]["name"] == CACHE_CLAIM and "ownerReferences" not in pvc["metadata"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    config = StageInConfig.model_validate(json.loads(config_map["data"][STEP_CONFIG_KEY]))
    assert (config.dataset.kind, config.dataset.source) == ("s3", "s3://data/support/train.jsonl")
    assert config.model.kind == "hub" and config.cache_dir == CACHE_DIR
    pod = batch["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "tolerations" not in pod  # it never lands on a tainted GPU node
    env = {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_REGION"] == "eu-west-1"
    assert env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000"
    assert container["command"][-1] == "kubetune_trainer.stagein"
    rule = batch["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [EXIT_CONFIG_ERROR]
    assert batch["metadata"]["labels"]["kubetune.io/step"] == "stage-in"


def test_the_stage_in_runs_before_any_trainer_and_holds_the_job() -> None:
    job, d = run(make_job(**S3_JOB))
    s = job.status
    assert s is not None and s.phase == "Planning" and s.attempt == 0
    assert [m["kind"] for m in d.create] == ["PersistentVolumeClaim", "ConfigMap", "Job"]
    cond = c.get_condition(s.conditions, ConditionType.STAGED_IN)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.STAGING_IN)
    assert [e.reason for e in d.events] == [Reason.STAGING_IN]

    job, d = run(job, seen(stage_in_job(), stage_in_pod(None)), now=T0 + timedelta(seconds=10))
    assert d.create == [] and job.status is not None and job.status.attempt == 0
    assert "is fetching and measuring" in (job.status.message or "")


def test_the_plan_is_made_with_what_the_stage_in_measured() -> None:
    job, _ = run(make_job(**S3_JOB))
    done = seen(stage_in_job("Complete"), stage_in_pod(0, RESULT.model_dump_json()))
    job, d = run(job, done, now=T0 + timedelta(seconds=60))
    s = job.status
    assert s is not None and s.phase == "Running" and s.stage_in is not None
    assert (s.stage_in.examples, s.stage_in.tokens) == (50_000, 20_000_000)
    assert s.stage_in.assumed_tokens is None  # the spec gave examples but no tokens per example
    assert c.is_true(s.conditions, ConditionType.STAGED_IN)
    # The measured size made the plan: 20M tokens an epoch at 32 × 2048 per step.
    assert s.plan is not None and s.plan.total_steps == -(-20_000_000 // (32 * 2048))

    (config_map,) = [m for m in d.create if m["kind"] == "ConfigMap"]
    config = json.loads(config_map["data"]["config.json"])
    assert config["model"] == {**config["model"], "kind": "path", "source": RESULT.model_path}
    assert config["dataset"]["source"] == RESULT.dataset_path
    (batch,) = [m for m in d.create if m["kind"] == "Job"]
    mounts = batch["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "cache", "mountPath": CACHE_DIR, "readOnly": True} in mounts

    # Looked at again, nothing is staged or created twice.
    job, d = run(job, done, now=T0 + timedelta(seconds=70))
    assert all(m["kind"] != "ConfigMap" or "stagein" not in m["metadata"]["name"] for m in d.create)


def test_a_permanent_stage_in_failure_fails_the_job_with_its_reason() -> None:
    job, _ = run(make_job(**S3_JOB))
    why = "s3://data/support/train.jsonl: InvalidAccessKeyId. To fix: check spec.s3"
    failed = seen(stage_in_job("Failed"), stage_in_pod(EXIT_CONFIG_ERROR, why))
    job, d = run(job, failed, now=T0 + timedelta(seconds=20))
    s = job.status
    assert s is not None and s.phase == "Failed" and s.attempt == 0
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.STAGE_IN_FAILED
    assert "a permanent failure" in cond.message and "InvalidAccessKeyId" in cond.message
    assert not any(m["kind"] == "Job" for m in d.create)


def test_a_stage_in_without_a_result_fails_instead_of_training_on_nothing() -> None:
    job, _ = run(make_job(**S3_JOB))
    job, _ = run(job, seen(stage_in_job("Complete"), stage_in_pod(0, "")), now=T0)
    cond = c.get_condition(job.status.conditions, ConditionType.FAILED)  # type: ignore[union-attr]
    assert cond is not None and cond.reason == Reason.STAGE_IN_FAILED
    assert "without its result" in cond.message


def test_the_s3_secret_needs_the_namespaces_consent_like_the_token() -> None:
    from kubetune.api.tenancy import Tenant

    refused = Observed(pools=default_pools(), tenant=Tenant("team-a"))
    job, d = run(make_job(**S3_JOB), refused)
    cond = c.get_condition(job.status.conditions, ConditionType.FAILED)  # type: ignore[union-attr]
    assert cond is not None and cond.reason == Reason.SECRET_NOT_ALLOWED
    assert "spec.s3.credentialsSecret names Secret 's3-creds'" in cond.message
    assert d.create == []


def test_trainer_pods_of_a_job_without_stage_in_do_not_mount_the_cache() -> None:
    job, _ = run(make_job())
    assert job.status is not None and job.status.plan is not None
    pool = next(p for p in default_pools() if p.name == job.status.plan.pool)
    children = build_children(job, job.status.plan, pool, SETTINGS.build, 1)
    assert CACHE_CLAIM not in json.dumps(children)


def test_a_stage_in_pod_that_cannot_be_scheduled_says_why() -> None:
    job, _ = run(make_job(**S3_JOB))
    pending = {
        "metadata": {"name": "demo-stagein-x1"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 node(s) had untolerated taint"}
            ],
        },
    }  # fmt: skip
    job, _ = run(job, seen(stage_in_job(), pending), now=T0 + timedelta(seconds=30))
    assert "untolerated taint" in (job.status.message or "")  # type: ignore[union-attr]


def test_stage_in_placement_comes_from_the_operator_settings() -> None:
    env = {
        "KUBETUNE_STAGE_IN_TOLERATIONS": '[{"key": "nvidia.com/gpu", "operator": "Exists"}]',
        "KUBETUNE_STAGE_IN_NODE_SELECTOR": '{"node-role/cpu": "true"}',
        "KUBETUNE_CACHE_SIZE": "1Ti",
        "KUBETUNE_STAGE_IN_CPU": "250m",
        "KUBETUNE_STAGE_IN_MEMORY": "1Gi",
    }
    settings = settings_from_env(env).build
    pvc, _, batch = build_stage_in(make_job(**S3_JOB), settings)
    pod = batch["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert pod["nodeSelector"] == {"node-role/cpu": "true"}
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "250m", "memory": "1Gi"}
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Ti"
    with pytest.raises(ValueError, match="is not a toleration; to fix"):
        settings_from_env({"KUBETUNE_STAGE_IN_TOLERATIONS": '[{"keyy": "x"}]'})


def test_a_job_suspended_while_staging_in_stages_in_before_it_launches_on_resume() -> None:
    job, _ = run(make_job(**S3_JOB))
    suspended = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    job, _ = run(suspended, seen(stage_in_job(), stage_in_pod(None)), now=T0 + timedelta(seconds=5))
    assert job.status is not None and job.status.phase == "Suspended"
    resumed = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})})
    job, d = run(resumed, seen(stage_in_job(), stage_in_pod(None)), now=T0 + timedelta(seconds=9))
    assert job.status is not None and job.status.attempt == 0, job.status
    assert not any(m["kind"] == "Job" for m in d.create)  # no trainer before the data is in
    done = seen(stage_in_job("Complete"), stage_in_pod(0, RESULT.model_dump_json()))
    job, d = run(job, done, now=T0 + timedelta(seconds=20))
    assert job.status is not None and job.status.attempt == 1
    assert job.status.stage_in is not None and job.status.stage_in.tokens == RESULT.tokens


def test_a_stage_in_pod_that_never_starts_fails_the_job_after_the_startup_timeout() -> None:
    job, _ = run(make_job(**S3_JOB))
    stuck = {
        "metadata": {"name": "demo-stagein-x1", "creationTimestamp": "2026-11-22T12:00:00Z"},
        "spec": {"nodeName": "cpu-1"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "stage-in", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
            ],
        },
    }
    later = T0 + timedelta(seconds=SETTINGS.startup_timeout_seconds + 1)
    job, _ = run(job, seen(stage_in_job(), stuck), now=T0 + timedelta(seconds=30))
    assert job.status is not None and job.status.phase == "Planning"
    assert "ImagePullBackOff" in (job.status.message or "")
    job, _ = run(job, seen(stage_in_job(), stuck), now=later)
    cond = c.get_condition(job.status.conditions, ConditionType.FAILED)  # type: ignore[union-attr]
    assert cond is not None and cond.reason == Reason.STAGE_IN_FAILED
    assert "did not start within" in cond.message


TINY_LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def test_a_model_on_a_claim_without_architecture_is_planned_from_its_config_json() -> None:
    job, d = run(make_job(model={"uri": "pvc://models/llama", "architecture": None}))
    s = job.status
    assert s is not None and s.phase == "Planning" and s.plan is None
    # Nothing is fetched: no cache claim, the files are read in place.
    assert [m["kind"] for m in d.create] == ["ConfigMap", "Job"]
    volumes = d.create[1]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}} in volumes
    assert "reading the config.json of pvc://models/llama" in (s.message or "")

    result = RESULT.model_copy(
        update={"model_path": "/mnt/pvc/models/llama", "model_config_json": TINY_LLAMA_CONFIG}
    )
    done = seen(stage_in_job("Complete"), stage_in_pod(0, result.model_dump_json()))
    job, _ = run(job, done, now=T0 + timedelta(seconds=60))
    s = job.status
    assert s is not None and s.phase == "Running" and s.plan is not None
    assert s.stage_in is not None and s.stage_in.model_config_json == TINY_LLAMA_CONFIG
    # Sized as the 8B Llama its config.json describes (the default 7B Qwen would differ).
    assert 7.9e9 < s.plan.model_params < 8.1e9


def test_a_hub_model_is_fetched_by_the_stage_in_step_through_the_configured_hub() -> None:
    settings = settings_from_env({"KUBETUNE_HF_ENDPOINT": "https://hub.example.internal/"})
    job = make_job(model={"uri": "meta-llama/Llama-3.1-8B", "architecture": None})
    pvc, config_map, batch = build_stage_in(job, settings.build, keep_paths=["/cache/models/x"])
    assert pvc["metadata"]["name"] == CACHE_CLAIM
    config = StageInConfig.model_validate(json.loads(config_map["data"][STEP_CONFIG_KEY]))
    assert (config.model.kind, config.model.source) == ("hub", "meta-llama/Llama-3.1-8B")
    assert config.keep_paths == ["/cache/models/x"] and config.metrics_port == 9400
    # The cache is evicted above 90% of its size by default.
    assert config.cache_max_bytes == int(200 * 2**30 * 0.9)
    env = batch["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_ENDPOINT", "value": "https://hub.example.internal"} in env
    with pytest.raises(ValueError, match="not an http"):
        settings_from_env({"KUBETUNE_HF_ENDPOINT": "hub.example.internal"})
    capped = settings_from_env({"KUBETUNE_CACHE_EVICT_ABOVE": "50Gi"}).build
    assert capped.cache_max_bytes == 50 * 2**30


def test_a_job_no_pool_can_run_fails_before_its_model_is_fetched() -> None:
    job = make_job(
        model={"uri": "meta-llama/Llama-3.1-405B", "architecture": None},
        method="full",
        resources={"gpus": 1},
    )
    job, d = run(job)
    s = job.status
    assert s is not None and s.phase == "Failed" and d.create == []
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.INFEASIBLE


def test_stage_in_progress_shows_in_status() -> None:
    job, _ = run(make_job(**S3_JOB))
    gauges = {"bytes_done": 1.5e9, "bytes_total": 4e9, "files_done": 3, "files_total": 7}
    running = Observed(
        pools=default_pools(),
        stage_in_job=stage_in_job(),
        stage_in_pods=[stage_in_pod(None)],
        stage_in_metrics=gauges,
    )
    job, _ = run(job, running, now=T0 + timedelta(seconds=10))
    s = job.status
    assert s is not None and s.phase == "Planning" and s.stage_in is not None
    assert (s.stage_in.bytes_done, s.stage_in.bytes_total) == (1_500_000_000, 4_000_000_000)
    assert (s.stage_in.files_done, s.stage_in.files_total) == (3, 7)
    assert s.message == "staging in: 1.5 GB of 4.0 GB, 3 of 7 files"
    assert s.progress is not None and s.progress.summary == "stage-in 1.5 GB/4.0 GB"
    # Progress is not a result: the step is still followed, and its result replaces it.
    done = seen(stage_in_job("Complete"), stage_in_pod(0, RESULT.model_dump_json()))
    job, _ = run(job, done, now=T0 + timedelta(seconds=60))
    s = job.status
    assert s is not None and s.phase == "Running" and s.stage_in is not None
    assert s.stage_in.model_path == RESULT.model_path and s.stage_in.bytes_done is None
    assert s.plan is not None and s.progress is not None
    assert s.progress.summary == f"0/{s.plan.total_steps} (0%)"


def test_one_cache_for_the_cluster_replaces_the_claims() -> None:
    volume = {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {"share": "/cache"}}}
    settings = settings_from_env({"KUBETUNE_CACHE_VOLUME": json.dumps(volume)}).build
    created = build_stage_in(make_job(**S3_JOB), settings)
    assert [m["kind"] for m in created] == ["ConfigMap", "Job"]  # no claim of its own
    pod = created[1]["spec"]["template"]["spec"]
    assert {"name": "cache", **volume} in pod["volumes"]
    # The trainer reads the same volume, read-only.
    job, _ = run(make_job(**S3_JOB))
    done = seen(stage_in_job("Complete"), stage_in_pod(0, RESULT.model_dump_json()))
    job, _ = run(job, done, now=T0 + timedelta(seconds=60))
    assert job.status is not None and job.status.plan is not None
    (batch,) = [
        m
        for m in build_children(job, job.status.plan, default_pools()[0], settings, 1)
        if m["kind"] == "Job"
    ]
    trainer = batch["spec"]["template"]["spec"]
    assert {"name": "cache", **volume} in trainer["volumes"]
    mount = next(m for m in trainer["containers"][0]["volumeMounts"] if m["name"] == "cache")
    assert mount["readOnly"] is True
    for bad in ('{"csi": {}, "nfs": {}}', '{"name": "x"}', "[1]", "not json"):
        with pytest.raises(ValueError, match="KUBETUNE_CACHE_VOLUME"):
            settings_from_env({"KUBETUNE_CACHE_VOLUME": bad})
    assert settings_from_env({"KUBETUNE_CACHE_VOLUME": "{}"}).build.cache_volume is None


def test_the_shared_cache_is_refused_where_pools_keep_namespaces_apart() -> None:
    """The cluster-wide cache volume is one trust domain (any namespace's pod can mount its
    volume source): with a GPUPool scoped to namespaces, a job that would fetch into it fails
    before anything is created, unless the admins said the namespaces trust each other."""
    volume = json.dumps({"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {}}})
    shared = settings_from_env({"KUBETUNE_CACHE_VOLUME": volume})
    scoped = [
        p.model_copy(
            update={
                "spec": p.spec.model_copy(
                    update={"namespace_selector": LabelSelector(match_labels={"team": "a"})}
                )
            }
        )
        for p in default_pools()[:1]
    ] + default_pools()[1:]
    refused, d = run(make_job(**S3_JOB), Observed(pools=scoped), settings=shared)
    s = refused.status
    assert s is not None and s.phase == "Failed" and d.create == []
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.SHARED_CACHE_REFUSED
    assert f"GPUPool(s) {scoped[0].name} keep namespaces apart" in (s.message or "")
    assert "operator.cacheVolumeSharedTrust=true" in (s.message or "")
    # Consent, no scoped pool, or nothing to fetch: the job goes on.
    trusted = settings_from_env(
        {"KUBETUNE_CACHE_VOLUME": volume, "KUBETUNE_CACHE_VOLUME_SHARED_TRUST": "true"}
    )
    for settings, pools, spec in (
        (trusted, scoped, S3_JOB),
        (shared, default_pools(), S3_JOB),
        (shared, scoped, {}),
    ):
        job, _ = run(make_job(**spec), Observed(pools=pools), settings=settings)
        assert job.status is not None and job.status.phase != "Failed", job.status.message


def test_a_model_read_in_place_gives_trainer_pods_no_cache_to_mount() -> None:
    job, _ = run(make_job(model={"uri": "pvc://models/llama", "architecture": None}))
    result = RESULT.model_copy(
        update={
            "model_path": "/mnt/pvc/models/llama",
            "dataset_path": "/mnt/pvc/data/train.jsonl",
            "model_config_json": TINY_LLAMA_CONFIG,
        }
    )
    done = seen(stage_in_job("Complete"), stage_in_pod(0, result.model_dump_json()))
    job, d = run(job, done, now=T0 + timedelta(seconds=60))
    assert job.status is not None and job.status.phase == "Running"
    (batch,) = [m for m in d.create if m["kind"] == "Job"]
    volumes = batch["spec"]["template"]["spec"]["volumes"]
    assert all(v["name"] != "cache" for v in volumes), volumes
