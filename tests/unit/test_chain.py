"""A job whose model is another FineTuneJob's result (`ftj://<name>`): it waits, visibly,
until the upstream Succeeded, then trains on the upstream's whole model (planned from the
upstream's architecture); it fails naming the upstream when that one failed, is missing or
left no whole model."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import ConditionType, Phase, Reason
from kubetune.control import conditions as c
from kubetune.control.build.storage import input_refs
from kubetune.control.reconcile import Observed, chained, upstream_result
from kubetune.planning.catalog import default_pools
from support.reconcile import T0, make_job, run

CREATED = "2026-11-22T12:00:00Z"


def downstream(**spec: Any) -> FineTuneJob:
    job = make_job(model={"uri": "ftj://sft", "architecture": None}, **spec)
    job.metadata["creationTimestamp"] = CREATED
    return job


def upstream(phase: str, **spec: Any) -> FineTuneJob:
    job = make_job(model={"uri": "meta-llama/Llama-3.1-8B", "architecture": None}, **spec)
    job.metadata.update(name="sft", uid="uid-sft")
    conditions = []
    if phase == "Failed":
        conditions = [{"type": "Failed", "status": "True", "reason": "TrainerConfigError",
                       "message": "bad record", "lastTransitionTime": CREATED}]  # fmt: skip
    status = {"phase": phase, "conditions": conditions}
    return FineTuneJob.model_validate(
        {**job.model_dump(by_alias=True, exclude_none=True), "status": status}
    )


def seen(up: FineTuneJob | None, read: bool = True) -> Observed:
    return Observed(pools=default_pools(), upstream=up, upstream_read=read)


MERGED = {"output": {"mergeAdapter": True}}


def test_the_job_waits_for_its_upstream_and_says_so() -> None:
    job, d = run(downstream(), seen(upstream("Running", **MERGED)))
    s = job.status
    assert s is not None and s.phase == Phase.PENDING and s.plan is None and d.create == []
    cond = c.get_condition(s.conditions, ConditionType.UPSTREAM_READY)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.WAITING_FOR_UPSTREAM)
    assert "FineTuneJob sft (phase Running)" in (s.message or "")
    assert [e.reason for e in d.events] == [Reason.WAITING_FOR_UPSTREAM]
    assert d.requeue_after is not None  # it looks again without an event of its own

    # Looked at again while the upstream still runs: no second Event.
    job, d = run(job, seen(upstream("Running", **MERGED)), now=T0 + timedelta(minutes=5))
    assert d.events == [] and job.status is not None and job.status.phase == Phase.PENDING


def test_once_the_upstream_succeeded_the_job_trains_on_its_merged_model() -> None:
    job, _ = run(downstream(), seen(upstream("Running", **MERGED)))
    job, d = run(job, seen(upstream("Succeeded", **MERGED)), now=T0 + timedelta(minutes=30))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.plan is not None
    assert s.upstream is not None
    assert s.upstream.model_uri == "pvc://sft-ckpt/output/merged"
    assert s.upstream.architecture == "meta-llama/Llama-3.1-8B"
    assert c.is_true(s.conditions, ConditionType.UPSTREAM_READY)
    # Planned as the upstream's model, without reading anything from the network.
    assert 7.9e9 < s.plan.model_params < 8.1e9
    # The trainer reads the upstream's output folder from its checkpoint claim, read-only.
    (batch,) = [m for m in d.create if m["kind"] == "Job"]
    volumes = batch["spec"]["template"]["spec"]["volumes"]
    claims = [v["persistentVolumeClaim"] for v in volumes if "persistentVolumeClaim" in v]
    assert {"claimName": "sft-ckpt", "readOnly": True} in claims, claims
    # The launch preflight checks that claim like any other.
    assert [r.name for r in input_refs(chained(job, s.upstream))][:1] == ["sft-ckpt"]


def test_a_full_upstream_with_a_claim_output_gives_its_model_folder() -> None:
    up = upstream("Succeeded", method="full", output={"uri": "pvc://models/sft-v1"})
    taken = upstream_result(up)
    assert not isinstance(taken, str)
    assert taken.model_uri == "pvc://models/sft-v1/model"


def test_an_upstream_that_failed_fails_the_job_naming_it() -> None:
    job, d = run(downstream(), seen(upstream("Failed", **MERGED)))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and d.create == []
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.UPSTREAM_FAILED
    assert "upstream FineTuneJob sft failed (TrainerConfigError: bad record)" in cond.message
    assert "To fix:" in cond.message


def test_a_missing_upstream_is_waited_for_briefly_then_fails() -> None:
    job, _ = run(downstream(), seen(None), now=T0 + timedelta(seconds=5))
    assert job.status is not None and job.status.phase == Phase.PENDING
    assert "FineTuneJob sft (not found yet)" in (job.status.message or "")
    # Unreadable (the API server's trouble): never taken for missing.
    job, _ = run(job, seen(None, read=False), now=T0 + timedelta(hours=1))
    assert job.status is not None and job.status.phase == Phase.PENDING
    assert "FineTuneJob sft (not read yet: the read got no answer)" in (job.status.message or "")
    job, _ = run(job, seen(None), now=T0 + timedelta(minutes=2))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.UPSTREAM_FAILED
    assert "FineTuneJob sft (spec.model.uri ftj://sft) does not exist" in cond.message


def test_an_upstream_with_only_an_adapter_fails_the_job_with_the_fix() -> None:
    job, _ = run(downstream(), seen(upstream("Succeeded")))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and "set spec.output.mergeAdapter: true on sft" in cond.message


def test_an_upstream_that_deletes_its_volume_cannot_be_chained() -> None:
    up = upstream("Succeeded", checkpoint={"storage": {"retention": "delete"}}, **MERGED)
    taken = upstream_result(up)
    assert isinstance(taken, str) and "retention: delete" in taken and "To fix:" in taken


def test_a_named_architecture_wins_over_the_upstreams() -> None:
    job = make_job(model={"uri": "ftj://sft", "architecture": "Qwen/Qwen2.5-7B"})
    taken = upstream_result(upstream("Succeeded", **MERGED))
    assert not isinstance(taken, str)
    assert chained(job, taken).spec.model.architecture == "Qwen/Qwen2.5-7B"
    assert chained(job, taken).spec.model.uri == "pvc://sft-ckpt/output/merged"


def test_the_upstreams_model_is_where_its_output_went() -> None:
    """A `pvc://` or `s3://` output holds the upstream's model; an output.uri that is a hub
    id, `hf://` or a path means the checkpoint volume's `output/`, where the trainer wrote it
    (and a URI that is a model URI, which the output's with `/merged` added would not be)."""
    for out, model_uri in [
        ("pvc://models/sft-v1/", "pvc://models/sft-v1/merged"),
        ("s3://results/run", "s3://results/run/merged"),
        ("org/out", "pvc://sft-ckpt/output/merged"),
        ("hf://org/out", "pvc://sft-ckpt/output/merged"),
        ("/models/out", "pvc://sft-ckpt/output/merged"),
    ]:
        taken = upstream_result(upstream("Succeeded", output={"uri": out, "mergeAdapter": True}))
        assert not isinstance(taken, str) and taken.model_uri == model_uri, out
        job = chained(downstream(), taken)
        assert job.spec.model.model_validate(job.spec.model.model_dump()).uri == model_uri
