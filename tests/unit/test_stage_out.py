"""The stage-out step of a job with an `s3://` output: built CPU-only once training
succeeded, reading the checkpoint volume read-only; the job succeeds only after it
uploaded, and fails with UploadFailed (the output kept on the volume) when it cannot."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from kubetune.api.tenancy import Tenant
from kubetune.api.vocabulary import ConditionType, Phase, Reason, StepKind
from kubetune.control import conditions as c
from kubetune.control.build.paths import OUTPUT_DIR
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.stages import STEP_CONFIG_KEY, build_stage_out, needs_stage_out
from kubetune.control.reconcile import Observed
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, StageOutConfig, StageOutResult
from support.reconcile import T0, batch_job, make_job, run, step_job, step_pod

S3_OUT: dict[str, Any] = {
    "output": {"uri": "s3://results/support-bot/v1"},
    "s3": {"credentialsSecret": "s3-creds", "region": "eu-west-1"},
}
RESULT = StageOutResult(
    destination="s3://results/support-bot/v1",
    files=7,
    bytes=80_000_000,
    uploaded_bytes=60_000_000,
    skipped_bytes=20_000_000,
    seconds=12.34,
)


def stage_out_job(*conditions: str) -> dict[str, Any]:
    return step_job(StepKind.STAGE_OUT, *conditions)


def stage_out_pod(code: int | None, message: str = "") -> dict[str, Any]:
    return step_pod(StepKind.STAGE_OUT, code, message)


def trained(step: dict[str, Any] | None = None, *pods: dict[str, Any]) -> Observed:
    """The trainer's batch Job completed; the stage-out step as given."""
    return Observed(
        pools=default_pools(),
        batch_job=batch_job("Complete"),
        stage_out_job=step,
        stage_out_pods=list(pods),
    )


def test_only_an_s3_output_needs_a_stage_out() -> None:
    assert needs_stage_out(make_job(**S3_OUT))
    assert not needs_stage_out(make_job())
    assert not needs_stage_out(make_job(output={"uri": "pvc://results/v1"}))


def test_the_stage_out_pod_reads_the_volume_read_only_and_asks_for_no_gpu() -> None:
    config_map, batch = build_stage_out(make_job(**S3_OUT), BuildSettings())
    config = StageOutConfig.model_validate(json.loads(config_map["data"][STEP_CONFIG_KEY]))
    assert config.source_dir == OUTPUT_DIR
    assert config.destination == "s3://results/support-bot/v1"
    assert config.job.uid == "uid-1"
    assert batch["metadata"]["labels"]["kubetune.io/step"] == "stage-out"
    assert batch["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    pod = batch["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "kubetune_trainer.stageout"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"] == {"claimName": "demo-ckpt", "readOnly": True}
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["name"])
    assert mount["readOnly"] is True and OUTPUT_DIR.startswith(mount["mountPath"])
    env = {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_REGION"] == "eu-west-1"
    rule = batch["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"]["values"] == [EXIT_CONFIG_ERROR]
    assert batch["spec"]["backoffLimit"] >= 3  # a store down for minutes is ridden out


def test_the_job_succeeds_only_after_the_upload() -> None:
    job, _ = run(make_job(**S3_OUT))
    assert job.status is not None and job.status.phase == Phase.RUNNING

    # Training finished: the stage-out step is created, the job is not done yet.
    job, d = run(job, trained(), now=T0 + timedelta(minutes=30))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.completion_time is None
    assert [m["kind"] for m in d.create] == ["ConfigMap", "Job"]
    cond = c.get_condition(s.conditions, ConditionType.UPLOADED)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.UPLOADING)
    assert "s3://results/support-bot/v1" in (s.message or "")
    assert [e.reason for e in d.events] == [Reason.UPLOADING]

    job, d = run(job, trained(stage_out_job(), stage_out_pod(None)), now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and d.create == []
    assert s.message == "uploading the output: pod demo-stageout-x1 is uploading"

    done = stage_out_pod(0, RESULT.model_dump_json())
    job, d = run(job, trained(stage_out_job("Complete"), done), now=T0 + timedelta(minutes=32))
    s = job.status
    assert s is not None and s.phase == Phase.SUCCEEDED
    assert s.stage_out is not None and s.stage_out.files == 7
    assert (s.stage_out.uploaded_bytes, s.stage_out.skipped_bytes) == (60_000_000, 20_000_000)
    assert c.is_true(s.conditions, ConditionType.UPLOADED)
    assert [e.reason for e in d.events] == [Reason.UPLOADED, Reason.COMPLETED]


def test_no_upload_step_for_other_outputs() -> None:
    job, _ = run(make_job())
    job, d = run(job, trained(), now=T0 + timedelta(minutes=30))
    assert job.status is not None and job.status.phase == Phase.SUCCEEDED
    assert d.create == [] and job.status.stage_out is None


def test_a_permanent_upload_failure_fails_the_job_and_keeps_the_output() -> None:
    job, _ = run(make_job(**S3_OUT))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    why = "config_error s3://results/support-bot/v1: AccessDenied. To fix: check spec.s3"
    failed = trained(stage_out_job("Failed"), stage_out_pod(EXIT_CONFIG_ERROR, why))
    job, d = run(job, failed, now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.UPLOAD_FAILED
    assert "a permanent failure" in cond.message and "AccessDenied" in cond.message
    assert "stays on the checkpoint volume (demo-ckpt" in cond.message
    assert "resumeFromUID: uid-1" in cond.message
    assert "demo-stageout" not in d.delete_jobs  # its pod log stays readable


def owned_claim(uid: str = "uid-1") -> dict[str, Any]:
    """The checkpoint claim as retention `delete` makes it: owned by the job."""
    owner = {"kind": "FineTuneJob", "name": "demo", "uid": uid}
    return {"metadata": {"name": "demo-ckpt", "ownerReferences": [owner]}}


def test_a_failed_upload_releases_the_owned_volume_before_any_ttl_deletes_the_job() -> None:
    """Retention `delete` and a TTL: the volume holds the only copy of the output, so the
    claim leaves the job's ownership before the job may go (and the message is true)."""
    ttl = {"ttlSecondsAfterFinished": 60, "checkpoint": {"storage": {"retention": "delete"}}}
    job, _ = run(make_job(**S3_OUT, **ttl))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    failed = trained(stage_out_job("Failed"), stage_out_pod(EXIT_CONFIG_ERROR, "AccessDenied"))
    failed = replace(failed, checkpoint_claim=owned_claim())
    job, d = run(job, failed, now=T0 + timedelta(minutes=31))
    assert job.status is not None and job.status.phase == Phase.FAILED
    assert d.release_claims == ["demo-ckpt"] and not d.delete_self
    assert "which deleting this job leaves in place" in (job.status.message or "")

    # Should that release not have landed, the look that deletes the job releases it first.
    later = replace(trained(stage_out_job("Failed")), checkpoint_claim=owned_claim())
    _, d = run(job, later, now=T0 + timedelta(minutes=33))
    assert d.delete_self and d.release_claims == ["demo-ckpt"]
    # Released (or another job's), nothing more to do.
    later = replace(later, checkpoint_claim=owned_claim(uid="uid-other"))
    _, d = run(job, later, now=T0 + timedelta(minutes=33))
    assert d.delete_self and d.release_claims == []


def test_a_credentials_secret_patched_after_the_launch_gets_no_upload_pod() -> None:
    """spec.s3 stays mutable: the upload step is checked against the namespace's consent
    when it is built, not only the launch."""
    tenant = Tenant.of("team-a", {}, {"kubetune.io/allowed-secrets": "s3-creds"})
    job, _ = run(make_job(**S3_OUT), Observed(pools=default_pools(), tenant=tenant))
    s3 = {**S3_OUT["s3"], "credentialsSecret": "someone-elses-keys"}
    spec = type(job.spec).model_validate({**job.spec.model_dump(by_alias=True), "s3": s3})
    job = job.model_copy(update={"spec": spec})
    job, d = run(job, replace(trained(), tenant=tenant), now=T0 + timedelta(minutes=30))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and d.create == []
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.SECRET_NOT_ALLOWED


def test_a_stage_out_without_its_result_fails_with_the_reason() -> None:
    job, _ = run(make_job(**S3_OUT))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    done = trained(stage_out_job("Complete"), stage_out_pod(0, "not json"))
    job, _ = run(job, done, now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.UPLOAD_FAILED
    assert "kubectl logs job/demo-stageout" in cond.message


def test_a_stage_out_pod_that_never_starts_fails_the_job() -> None:
    job, _ = run(make_job(**S3_OUT))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    waiting = stage_out_pod(None)
    waiting["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-22T12:30:00Z"}
        ],
        "containerStatuses": [
            {
                "name": "stage-out",
                "state": {"waiting": {"reason": "CreateContainerConfigError",
                                      "message": 'secret "s3-creds" not found'}},
            }
        ],
    }  # fmt: skip
    job, _ = run(job, trained(stage_out_job(), waiting), now=T0 + timedelta(minutes=31))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    assert "s3-creds" in (job.status.message or "")
    job, _ = run(job, trained(stage_out_job(), waiting), now=T0 + timedelta(hours=2))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.UPLOAD_FAILED
