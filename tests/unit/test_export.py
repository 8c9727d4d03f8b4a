"""The GGUF export step of a job with spec.output.gguf: refused at admission when there is no
whole model to export, built CPU-only once training succeeded with the output's claim
mounted read-write, run before the stage-out (so an `s3://` output uploads the file too);
the job succeeds only after it, and fails with ExportFailed (the output kept) when it cannot."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from kubetune.api.crdgen import finetunejob_crd
from kubetune.api.v1alpha1 import FineTuneJobSpec
from kubetune.api.vocabulary import ConditionType, Phase, Reason, StepKind
from kubetune.control import conditions as c
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.stages import STEP_CONFIG_KEY, build_export, gguf_uri, needs_export
from kubetune.control.build.storage import checkpoint_size
from kubetune.control.reconcile import Observed
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    GGUF_TYPES,
    ExportConfig,
    ExportResult,
    StageOutResult,
)
from support.reconcile import T0, batch_job, make_job, run, step_job, step_pod

GGUF: dict[str, Any] = {"output": {"mergeAdapter": True, "gguf": {"quantization": "q8_0"}}}
RESULT = ExportResult(
    file="/checkpoints/output/gguf/demo-q8_0.gguf",
    quantization="q8_0",
    bytes=8_100_000_000,
    seconds=312.34,
    tool="convert_hf_to_gguf",
)


def trained(
    export: dict[str, Any] | None = None,
    export_pods: tuple[dict[str, Any], ...] = (),
    stage_out: dict[str, Any] | None = None,
    stage_out_pods: tuple[dict[str, Any], ...] = (),
) -> Observed:
    """The trainer's batch Job completed; the export and stage-out steps as given."""
    return Observed(
        pools=default_pools(),
        batch_job=batch_job("Complete"),
        export_job=export,
        export_pods=list(export_pods),
        stage_out_job=stage_out,
        stage_out_pods=list(stage_out_pods),
    )


def spec(**over: Any) -> dict[str, Any]:
    return {"model": {"uri": "org/model"}, "dataset": {"uri": "d/data.jsonl"}, **over}


# ------------------------------------------------------------------ API


def test_gguf_of_an_adapter_only_run_is_refused_with_how_to_fix() -> None:
    for method in ("lora", "qlora", "auto"):
        with pytest.raises(ValidationError, match=r"To fix: set spec.output.mergeAdapter: true"):
            FineTuneJobSpec.model_validate(spec(method=method, output={"gguf": {}}))
    full = FineTuneJobSpec.model_validate(spec(method="full", output={"gguf": {}}))
    assert full.output.gguf is not None and full.output.gguf.quantization == "q8_0"
    merged = FineTuneJobSpec.model_validate(
        spec(method="lora", output={"mergeAdapter": True, "gguf": {"quantization": "q4_k_m"}})
    )
    assert merged.output.gguf is not None and merged.output.gguf.quantization == "q4_k_m"
    with pytest.raises(ValidationError, match="quantization"):
        FineTuneJobSpec.model_validate(spec(method="full", output={"gguf": {"quantization": "q3"}}))


def test_the_crd_lists_the_gguf_types_and_checks_for_a_whole_model() -> None:
    schema = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    gguf = spec_schema["properties"]["output"]["properties"]["gguf"]
    assert gguf["properties"]["quantization"]["enum"] == list(GGUF_TYPES)
    rules = [r["rule"] for r in spec_schema["x-kubernetes-validations"]]
    assert any("self.output.gguf" in r and "mergeAdapter" in r for r in rules), rules


# ------------------------------------------------------------------ builders


def test_the_export_pod_writes_next_to_the_output_and_asks_for_no_gpu() -> None:
    settings = BuildSettings(export_cpu="6", export_memory="24Gi")
    job, _ = run(make_job(**GGUF))
    assert needs_export(job) and not needs_export(make_job())
    config_map, batch = build_export(job, settings)
    config = ExportConfig.model_validate(json.loads(config_map["data"][STEP_CONFIG_KEY]))
    assert config.model_dir == "/checkpoints/output/merged"  # LoRA: the merged model
    assert config.out_file == "/checkpoints/output/gguf/demo-q8_0.gguf"
    assert config.quantization == "q8_0" and config.job.uid == "uid-1"
    assert batch["metadata"]["name"] == "demo-export"
    assert batch["metadata"]["labels"]["kubetune.io/step"] == "export"
    pod = batch["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "kubetune_trainer.export"]
    assert container["resources"] == {"requests": {"cpu": "6", "memory": "24Gi"}}
    claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"] == {"claimName": "demo-ckpt"}  # read-write
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["name"])
    assert mount == {"name": claim["name"], "mountPath": "/checkpoints"}
    rule = batch["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"]["values"] == [EXIT_CONFIG_ERROR]
    assert gguf_uri(job) == "pvc://demo-ckpt/output/gguf/demo-q8_0.gguf"


def test_a_full_fine_tune_exports_its_model_and_a_pvc_output_its_claim() -> None:
    job = make_job(method="full", output={"uri": "pvc://results/v1", "gguf": {}})
    job, _ = run(job)
    config_map, batch = build_export(job, BuildSettings())
    config = ExportConfig.model_validate(json.loads(config_map["data"][STEP_CONFIG_KEY]))
    assert config.model_dir == "/mnt/pvc/results/v1/model"
    assert config.out_file == "/mnt/pvc/results/v1/gguf/demo-q8_0.gguf"
    pod = batch["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "results"}]
    assert gguf_uri(job) == "pvc://results/v1/gguf/demo-q8_0.gguf"


def test_the_checkpoint_volume_has_room_for_the_gguf_file() -> None:
    plain, _ = run(make_job(output={"mergeAdapter": True}))
    q8, _ = run(make_job(**GGUF))
    q4, _ = run(make_job(output={"mergeAdapter": True, "gguf": {"quantization": "q4_k_m"}}))
    assert plain.status is not None and plain.status.plan is not None
    params = plain.status.plan.model_params
    sizes = [int(checkpoint_size(j, plain.status.plan)[:-2]) for j in (plain, q8, q4)]
    # q8_0: about 1 B/param more; q4_k_m: the file and its f16 intermediate, 3 B/param.
    assert sizes[1] - sizes[0] == pytest.approx(params / 2**30, abs=1)
    assert sizes[2] - sizes[0] == pytest.approx(3 * params / 2**30, abs=1)


# ------------------------------------------------------------------ reconcile


def test_the_job_succeeds_only_after_the_export() -> None:
    job, _ = run(make_job(**GGUF))
    assert job.status is not None and job.status.phase == Phase.RUNNING

    job, d = run(job, trained(), now=T0 + timedelta(minutes=30))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.completion_time is None
    assert [(m["kind"], m["metadata"]["name"]) for m in d.create] == [
        ("ConfigMap", "demo-export"),
        ("Job", "demo-export"),
    ]
    cond = c.get_condition(s.conditions, ConditionType.EXPORTED)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.EXPORTING)
    assert "pvc://demo-ckpt/output/gguf/demo-q8_0.gguf" in (s.message or "")
    assert [e.reason for e in d.events] == [Reason.EXPORTING]
    accrued = s.cost.accrued_usd if s.cost is not None else 0.0

    running = trained(step_job(StepKind.EXPORT), (step_pod(StepKind.EXPORT, None),))
    job, d = run(job, running, now=T0 + timedelta(hours=2))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and d.create == []
    assert s.message == "exporting to GGUF: pod demo-export-x1 is converting the model"
    # No GPU is held while the export runs: nothing accrues.
    assert s.cost is not None and s.cost.accrued_usd == accrued

    done = trained(
        step_job(StepKind.EXPORT, "Complete"),
        (step_pod(StepKind.EXPORT, 0, RESULT.model_dump_json()),),
    )
    job, d = run(job, done, now=T0 + timedelta(hours=2, minutes=1))
    s = job.status
    assert s is not None and s.phase == Phase.SUCCEEDED
    assert s.export is not None
    assert s.export.uri == "pvc://demo-ckpt/output/gguf/demo-q8_0.gguf"
    assert (s.export.quantization, s.export.bytes, s.export.seconds) == (
        "q8_0",
        8_100_000_000,
        312.3,
    )
    assert c.is_true(s.conditions, ConditionType.EXPORTED)
    assert [e.reason for e in d.events] == [Reason.EXPORTED, Reason.COMPLETED]


def test_an_s3_output_is_uploaded_after_the_export() -> None:
    s3 = {
        "output": {"uri": "s3://results/v1", "mergeAdapter": True, "gguf": {}},
        "s3": {"credentialsSecret": "s3-creds"},
    }
    job, _ = run(make_job(**s3))
    job, d = run(job, trained(), now=T0 + timedelta(minutes=30))
    assert [m["metadata"]["name"] for m in d.create] == ["demo-export", "demo-export"]

    exported = (
        step_job(StepKind.EXPORT, "Complete"),
        (step_pod(StepKind.EXPORT, 0, RESULT.model_dump_json()),),
    )
    job, d = run(job, trained(*exported), now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.export is not None
    assert [m["metadata"]["name"] for m in d.create] == ["demo-stageout", "demo-stageout"]
    assert c.get_condition(s.conditions, ConditionType.UPLOADED) is not None

    uploaded = StageOutResult(destination="s3://results/v1", files=9, bytes=9, uploaded_bytes=9)
    stage_out = (
        step_job(StepKind.STAGE_OUT, "Complete"),
        (step_pod(StepKind.STAGE_OUT, 0, uploaded.model_dump_json()),),
    )
    # The export's Job may be gone by now (TTL, a deleted object): status.export holds.
    job, d = run(job, trained(None, (), *stage_out), now=T0 + timedelta(minutes=32))
    s = job.status
    assert s is not None and s.phase == Phase.SUCCEEDED and d.create == []
    assert c.is_true(s.conditions, ConditionType.EXPORTED)
    assert c.is_true(s.conditions, ConditionType.UPLOADED)


@pytest.mark.parametrize(
    ("code", "message", "says"),
    [
        (
            EXIT_CONFIG_ERROR,
            "config_error llama.cpp's converter does not support the architecture Foo. "
            "To fix: leave GGUF out of the output",
            ["a permanent failure", "does not support the architecture Foo", "Then, to export"],
        ),
        (
            1,
            "transient convert_hf_to_gguf.py failed (exit -9)",
            ["failed repeatedly", "kubectl logs job/demo-export"],
        ),
    ],
)
def test_an_export_failure_fails_the_job_with_its_reason(
    code: int, message: str, says: list[str]
) -> None:
    job, _ = run(make_job(**GGUF))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    failed = trained(
        step_job(StepKind.EXPORT, "Failed"), (step_pod(StepKind.EXPORT, code, message),)
    )
    job, d = run(job, failed, now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and s.export is None
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.EXPORT_FAILED
    for words in [*says, "stays on the checkpoint volume", "To fix", "resumeFromUID: uid-1"]:
        assert words in cond.message, (words, cond.message)
    assert [e.reason for e in d.events][-1] in (Reason.EXPORT_FAILED,)


def test_an_export_without_its_result_fails_the_job() -> None:
    job, _ = run(make_job(**GGUF))
    job, _ = run(job, trained(), now=T0 + timedelta(minutes=30))
    done = trained(step_job(StepKind.EXPORT, "Complete"), (step_pod(StepKind.EXPORT, 0, "ok"),))
    job, _ = run(job, done, now=T0 + timedelta(minutes=31))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.EXPORT_FAILED
    assert "without its result" in cond.message
