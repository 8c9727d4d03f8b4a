"""Planner: chosen plans, rejections, advice, and optimality against brute force."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetune.api.errors import InfeasibleError
from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
from kubetune.planning.arch import ModelArch
from kubetune.planning.catalog import default_pools
from kubetune.planning.estimator import (
    EstimatorError,
    TrainingSetup,
    VramEstimate,
    estimate_vram,
    offloaded_bytes,
)
from kubetune.planning.planner import (
    GIB,
    Layout,
    Limit,
    Plan,
    PlannerSettings,
    Rejection,
    brute_force_plan,
    objective_of,
    plan_job,
    rank_key,
    replan_settings_after_oom,
)
from kubetune.planning.planner import context as planner_context
from kubetune.planning.throughput import HOST_LINK_BYTES_PER_S
from kubetune.sources import load_arch

pytestmark = pytest.mark.unit

POOLS = default_pools()
NO_LIVE = PlannerSettings(use_live_capacity=False)


def spec(**over: Any) -> FineTuneJobSpec:
    base: dict[str, Any] = {
        "model": {"uri": "meta-llama/Llama-3.1-8B"},
        "dataset": {"uri": "pvc://d/x.jsonl", "numExamples": 50000, "avgTokensPerExample": 400},
        "method": "lora",
        "training": {"sequenceLength": 2048, "globalBatchSize": 32},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return FineTuneJobSpec.model_validate(base)


def pools(*names: str) -> list[GPUPool]:
    return [p for p in POOLS if p.name in names]


def test_plan_fits_and_reports_everything() -> None:
    s = spec()
    plan = plan_job(s, POOLS, load_arch(s.model.uri), NO_LIVE)
    c = plan.chosen
    assert c.estimate.per_gpu_bytes * NO_LIVE.safety_factor <= c.gpu_memory_gib * GIB
    assert c.micro_batch * c.grad_accum * c.total_gpus == 32
    assert plan.total_steps == -(-plan.dataset.sequences_per_epoch // 32)
    assert c.cost == pytest.approx(
        c.duration_s
        / 3600
        * c.total_gpus
        * next(p.spec.price_per_gpu_hour for p in POOLS if p.name == c.pool)
    )
    status = plan.to_status(POOLS)
    assert status.total_gpus == c.total_gpus
    assert sum(status.memory_breakdown_gib.values()) == pytest.approx(
        status.per_gpu_memory_gib, abs=0.05
    )
    assert len(status.alternatives) == 3
    keys = [rank_key(a, "cost", "allowed") for a in [c, *plan.alternatives]]
    assert keys == sorted(keys)


def test_objective_time_is_faster_and_cost_is_cheaper() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    cheap = plan_job(spec(resources={"objective": "cost"}), POOLS, arch, NO_LIVE).chosen
    fast = plan_job(spec(resources={"objective": "time"}), POOLS, arch, NO_LIVE).chosen
    assert cheap.cost <= fast.cost
    assert fast.duration_s <= cheap.duration_s
    assert fast.duration_s < cheap.duration_s or fast.cost == cheap.cost


def test_unset_objective_takes_the_operator_default_and_the_spec_wins() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    unset = spec()
    assert unset.resources.objective is None
    by_time = PlannerSettings(use_live_capacity=False, default_objective="time")
    by_cost = PlannerSettings(use_live_capacity=False, default_objective="cost")
    explicit_time = plan_job(spec(resources={"objective": "time"}), POOLS, arch, NO_LIVE)
    explicit_cost = plan_job(spec(resources={"objective": "cost"}), POOLS, arch, NO_LIVE)
    # The two objectives pick different plans for this job, so the checks below can tell.
    assert explicit_time.chosen.layout != explicit_cost.chosen.layout
    # Unset: the operator's default decides; out of the box that is cost.
    assert PlannerSettings().default_objective == "cost"
    for settings_, want in (
        (NO_LIVE, explicit_cost),
        (by_cost, explicit_cost),
        (by_time, explicit_time),
    ):
        plan = plan_job(unset, POOLS, arch, settings_)
        assert plan.objective == want.objective
        assert plan.chosen == want.chosen
    # Set in the spec: the default is ignored.
    plan = plan_job(spec(resources={"objective": "cost"}), POOLS, arch, by_time)
    assert plan.objective == "cost" and plan.chosen == explicit_cost.chosen
    plan = plan_job(spec(resources={"objective": "time"}), POOLS, arch, by_cost)
    assert plan.objective == "time" and plan.chosen == explicit_time.chosen
    # A re-plan after an OOM keeps the operator's default.
    first = plan_job(unset, POOLS, arch, by_time)
    safer = replan_settings_after_oom(first.to_status(POOLS), by_time, measured_peak_gib=None)
    assert safer.default_objective == "time"
    assert plan_job(unset, POOLS, arch, safer).objective == "time"


def test_fixed_gpu_count_is_respected() -> None:
    plan = plan_job(
        spec(resources={"gpus": 16}), POOLS, load_arch("meta-llama/Llama-3.1-8B"), NO_LIVE
    )
    assert plan.chosen.total_gpus == 16
    assert plan.chosen.nodes == 2


def rejected(plan: Plan) -> dict[str, Rejection]:
    by_pool = {r.pool: r for r in plan.rejected}
    assert len(by_pool) == len(plan.rejected), "one rejection per pool"
    assert [r.pool for r in plan.rejected] == sorted(by_pool), "sorted by pool"
    return by_pool


def test_spot_never_excludes_spot_pools() -> None:
    plan = plan_job(
        spec(resources={"spot": "never"}), POOLS, load_arch("meta-llama/Llama-3.1-8B"), NO_LIVE
    )
    assert not plan.chosen.spot
    why = rejected(plan)["rtx4090-spot"]
    assert why.limit is Limit.SPOT and "spot" in why.message


def test_allowed_pools_filter() -> None:
    plan = plan_job(
        spec(resources={"pools": ["h100"]}), POOLS, load_arch("meta-llama/Llama-3.1-8B"), NO_LIVE
    )
    assert plan.chosen.pool == "h100"
    why = rejected(plan)["l40s"]
    assert why.limit is Limit.NOT_LISTED
    assert why.message == "not listed in spec.resources.pools"


def test_full_70b_needs_many_gpus_and_small_gpus_are_rejected_with_numbers() -> None:
    s = spec(model={"uri": "meta-llama/Llama-3.1-70B"}, method="full")
    plan = plan_job(s, POOLS, load_arch(s.model.uri), NO_LIVE)
    assert plan.chosen.total_gpus >= 8
    assert plan.chosen.gpu_memory_gib >= 80
    why = rejected(plan)["l4"]
    assert why.limit is Limit.MEMORY and "GiB per GPU" in why.message


def test_infeasible_says_how_to_fix() -> None:
    s = spec(model={"uri": "meta-llama/Llama-3.1-405B"}, method="full", resources={"gpus": 1})
    with pytest.raises(InfeasibleError) as err:
        plan_job(s, POOLS, load_arch(s.model.uri), NO_LIVE)
    text = str(err.value)
    assert "To fix:" in text
    assert "qlora" in text and "resources.gpus" in text
    for pool in POOLS:
        assert pool.name in text


def test_deadline_and_budget_rejections() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    with pytest.raises(InfeasibleError, match="deadline"):
        plan_job(spec(resources={"deadline": "1m"}), POOLS, arch, NO_LIVE)
    with pytest.raises(InfeasibleError, match="maxCostUSD"):
        plan_job(spec(resources={"maxCostUSD": 0.01}), POOLS, arch, NO_LIVE)


def test_auto_method_never_picks_full() -> None:
    plan = plan_job(spec(method="auto"), POOLS, load_arch("meta-llama/Llama-3.1-8B"), NO_LIVE)
    assert plan.chosen.method in ("lora", "qlora")


def test_oom_replan_avoids_the_failed_layout() -> None:
    s = spec()
    arch = load_arch(s.model.uri)
    first = plan_job(s, POOLS, arch, NO_LIVE)
    status = first.to_status(POOLS)
    safer = replan_settings_after_oom(status, NO_LIVE, measured_peak_gib=None)
    second = plan_job(s, POOLS, arch, safer).chosen
    assert safer.memory_scale > 1.0
    assert second.layout != first.chosen.layout
    # The new layout is predicted to use a smaller share of its GPU than the one that failed.
    first_share = first.chosen.estimate.per_gpu_bytes / (first.chosen.gpu_memory_gib * GIB)
    second_share = (
        second.estimate.per_gpu_bytes / safer.memory_scale / (second.gpu_memory_gib * GIB)
    )
    assert second_share < first_share


ONE_NODE = "the checkpoint volume is ReadWriteOnce"


def test_single_node_reason_keeps_layouts_on_one_node_and_says_why() -> None:
    """Full fine-tuning of an 8B model fits only two 8-GPU nodes of h100 at this batch:
    with layouts held to one node, the pool is rejected with the reason, and the error's
    advice is the fix the caller gave."""
    s = spec(method="full", lora=None, resources={"gpus": 16, "pools": ["h100"]})
    arch = load_arch(s.model.uri)
    assert plan_job(s, POOLS, arch, NO_LIVE).chosen.nodes == 2
    one_node = replace(
        NO_LIVE, single_node_reason=ONE_NODE, single_node_fix="set accessMode ReadWriteMany"
    )
    with pytest.raises(InfeasibleError) as err:
        plan_job(s, POOLS, arch, one_node)
    text = str(err.value)
    assert "h100: spans 2 nodes, but the checkpoint volume is ReadWriteOnce" in text
    assert "To fix: set accessMode ReadWriteMany" in text
    with pytest.raises(InfeasibleError) as slow:
        brute_force_plan(s, POOLS, arch, one_node, exhaustive=False)
    assert str(slow.value) == text


def test_single_node_reason_names_itself_beside_a_memory_miss() -> None:
    """A job that needs more memory than one node has: the memory rejection says layouts
    over several nodes were not tried, and why."""
    s = spec(model={"uri": "meta-llama/Llama-3.1-70B"}, method="full", lora=None)
    s = s.model_copy(update={"resources": s.resources.model_copy(update={"pools": ["h100"]})})
    arch = load_arch(s.model.uri)
    assert plan_job(s, POOLS, arch, NO_LIVE).chosen.nodes > 1
    one_node = replace(NO_LIVE, single_node_reason=ONE_NODE)
    with pytest.raises(InfeasibleError) as err:
        plan_job(s, POOLS, arch, one_node)
    text = str(err.value)
    assert "GiB per GPU" in text
    assert f"; it may not span nodes, as {ONE_NODE}" in text
    assert "To fix: let the job span nodes" in text


def test_single_node_reason_leaves_one_node_plans_alone() -> None:
    s = spec()
    arch = load_arch(s.model.uri)
    plain = plan_job(s, POOLS, arch, NO_LIVE)
    held = plan_job(s, POOLS, arch, replace(NO_LIVE, single_node_reason=ONE_NODE))
    assert plain.chosen.nodes == 1
    assert held.chosen.layout == plain.chosen.layout


# ---------------------------------------------------------------------- optimality


SMALL_MODELS = [
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-32B",
]


def twin(pool: GPUPool, price_factor: float, network_gbps: float | None = None) -> GPUPool:
    """The same GPUs under another name: shared estimates (and step times, on the same
    network), and ties when the price is the same."""
    doc = pool.to_wire()
    doc["metadata"] = {"name": f"{pool.name}-twin"}
    doc["spec"]["pricePerGPUHour"] = pool.spec.price_per_gpu_hour * price_factor
    if network_gbps is not None:
        doc["spec"]["networkGbps"] = network_gbps
    return GPUPool.model_validate(doc)


def with_free_gpus(pool: GPUPool, free_per_node: list[int]) -> GPUPool:
    """`pool` with live status: nodes holding `free_per_node` free GPUs each."""
    doc = pool.to_wire()
    doc["status"] = {
        "nodes": len(free_per_node),
        "allocatableGPUs": len(free_per_node) * pool.spec.gpus_per_node,
        "freeGPUs": sum(free_per_node),
        "freeGPUsPerNode": free_per_node,
        "updatedAt": "2026-01-01T00:00:00Z",
    }
    return GPUPool.model_validate(doc)


TWINS = [
    twin(pools("l40s")[0], 1.0),
    twin(pools("a100-80gb")[0], 0.9, 25),
    twin(pools("h100")[0], 0.8),
]
CANDIDATE_POOLS = POOLS + TWINS


@st.composite
def jobs(draw: st.DrawFn) -> tuple[FineTuneJobSpec, list[GPUPool]]:
    model = draw(st.sampled_from(SMALL_MODELS))
    method = draw(st.sampled_from(["auto", "full", "lora", "qlora"]))
    over: dict[str, Any] = {
        "model": {"uri": model},
        "method": method,
        "training": {
            "sequenceLength": draw(st.sampled_from([512, 2048, 8192])),
            "globalBatchSize": draw(st.sampled_from([8, 16, 48, 64])),
            "gradientCheckpointing": draw(st.sampled_from([None, True, False])),
            "chunkedCrossEntropy": draw(st.sampled_from([None, True, False])),
            "activationOffloading": draw(st.sampled_from([None, None, True, False])),
            "microBatchSize": draw(st.sampled_from([None, None, None, 1, 4])),
        },
        "resources": {
            "objective": draw(st.sampled_from(["cost", "time"])),
            "spot": draw(st.sampled_from(["never", "allowed", "preferred"])),
            "gpus": draw(st.sampled_from(["auto", "auto", 1, 2, 8, 16])),
        },
    }
    if (
        over["training"]["activationOffloading"]
        and over["training"]["gradientCheckpointing"] is False
    ):
        over["training"]["gradientCheckpointing"] = None  # offloading needs checkpointing
    if draw(st.booleans()):
        over["resources"]["deadline"] = draw(st.sampled_from(["30m", "3h", "48h"]))
    if draw(st.booleans()):
        over["resources"]["maxCostUSD"] = draw(st.sampled_from([5, 50, 500]))
    if method == "full":
        over["lora"] = None
    chosen = draw(
        st.lists(
            st.sampled_from(CANDIDATE_POOLS), min_size=1, max_size=5, unique_by=lambda p: p.name
        )
    )
    return spec(**over), chosen


@st.composite
def live_pools(draw: st.DrawFn, pool_list: list[GPUPool]) -> list[GPUPool]:
    """Some pools busy: layouts beyond their free GPUs are planned as queued."""
    out = []
    for pool in pool_list:
        busy = draw(st.sampled_from([None, [0], [8, 0], [4, 2, 1], [8, 8, 8, 8]]))
        out.append(pool if busy is None else with_free_gpus(pool, busy))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_planner_matches_brute_force(case: tuple[FineTuneJobSpec, list[GPUPool]]) -> None:
    s, pool_list = case
    arch = load_arch(s.model.uri)
    try:
        fast = plan_job(s, pool_list, arch, NO_LIVE)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            brute_force_plan(s, pool_list, arch, NO_LIVE)
        return
    slow = brute_force_plan(s, pool_list, arch, NO_LIVE)
    objective, spot = objective_of(s, NO_LIVE), s.resources.spot
    assert rank_key(fast.chosen, objective, spot) == rank_key(slow.chosen, objective, spot)
    assert fast.chosen.layout == slow.chosen.layout


def plan_or_error(plan: Callable[[], Plan]) -> Plan | str:
    try:
        return plan()
    except InfeasibleError as exc:
        return str(exc)


def assert_same_as_reference(
    s: FineTuneJobSpec, pool_list: list[GPUPool], settings_: PlannerSettings
) -> Plan | str:
    """plan_job's whole answer (alternatives, rejections, error text) is the reference walk's,
    and its choice is the exhaustive search's."""
    arch = load_arch(s.model.uri)
    fast = plan_or_error(lambda: plan_job(s, pool_list, arch, settings_))
    walk = plan_or_error(lambda: brute_force_plan(s, pool_list, arch, settings_, exhaustive=False))
    assert fast == walk
    if isinstance(fast, Plan) and isinstance(walk, Plan):
        assert fast.to_status(pool_list) == walk.to_status(pool_list)
        slow = brute_force_plan(s, pool_list, arch, settings_)
        objective = objective_of(s, settings_)
        assert rank_key(fast.chosen, objective, s.resources.spot) == rank_key(
            slow.chosen, objective, s.resources.spot
        )
    return fast


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_planner_equals_the_unoptimised_walk(data: st.DataObject) -> None:
    """Shared estimates and lazy pricing change nothing: with live capacity (queued
    layouts), twins of a pool (ties, shared step times), an OOM re-plan's forbidden layouts
    and memory scale, and a higher GPU floor."""
    s, pool_list = data.draw(jobs())
    pool_list = data.draw(live_pools(pool_list))
    live = PlannerSettings(default_objective=data.draw(st.sampled_from(["cost", "time"])))
    first = assert_same_as_reference(s, pool_list, live)
    if not isinstance(first, Plan):
        return
    status = first.to_status(pool_list)
    replan = replan_settings_after_oom(status, live, measured_peak_gib=None)
    # Forbid the runners-up too, as later OOMs would.
    forbid = replan.forbid | {
        Layout(a.pool, a.method, a.total_gpus, m, ck)
        for a in first.alternatives
        for m in (1, 2, 4, 8)
        for ck in (False, True)
    }
    for settings_ in (
        replan,
        replace(replan, forbid=forbid),
        replace(live, min_total_gpus=max(2, first.chosen.total_gpus * 2)),
        replace(replan, single_node_reason=ONE_NODE, single_node_fix="share the volume"),
    ):
        assert_same_as_reference(s, pool_list, settings_)
    # Single-node settings from the start change nothing either.
    one_node = replace(live, single_node_reason=ONE_NODE)
    assert_same_as_reference(s, pool_list, one_node)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"resources": {"deadline": "2h"}},
        {"resources": {"maxCostUSD": 3}},
        {"resources": {"gpus": 8, "objective": "time"}},
        {"resources": {"gpus": 16}},
        {"method": "auto", "resources": {"spot": "preferred"}},
        {"model": {"uri": "meta-llama/Llama-3.1-70B"}, "method": "full", "lora": None},
        {"model": {"uri": "meta-llama/Llama-3.1-405B"}, "method": "full", "lora": None},
        {"training": {"microBatchSize": 3}},
    ],
    ids=[
        "plain",
        "deadline",
        "budget",
        "fixed-gpus",
        "two-nodes",
        "auto-spot",
        "full-70b",
        "nowhere",
        "batch",
    ],
)
def test_whole_catalog_equals_the_unoptimised_walk(over: dict[str, Any]) -> None:
    """Every pool of the catalog and its twins, live capacity off and on (nothing free on
    any pool: everything that fits is queued)."""
    pool_list = CANDIDATE_POOLS
    busy = [with_free_gpus(p, [0] * p.spec.max_nodes) for p in pool_list]
    one_node = replace(NO_LIVE, single_node_reason=ONE_NODE)
    for pools_, settings_ in (
        (pool_list, NO_LIVE),
        (busy, PlannerSettings()),
        (pool_list, one_node),
    ):
        result = assert_same_as_reference(spec(**over), pools_, settings_)
        if pools_ is busy and isinstance(result, Plan):
            assert result.queued
        if settings_ is one_node and isinstance(result, Plan):
            assert result.chosen.nodes == 1


def _one_gpu_job(
    arch: ModelArch, seq: int, targets: list[str] | None = None, **training: object
) -> FineTuneJobSpec:
    """One sequence per micro-batch of `seq` tokens on one GPU, a global batch of 8, no
    activation offloading (`training` overrides any of them); `targets`: the LoRA target
    modules."""
    return spec(
        model={"uri": arch.name},
        **({"lora": {"targetModules": targets}} if targets else {}),
        training={
            "sequenceLength": seq,
            "globalBatchSize": 8,
            "microBatchSize": 1,
            "activationOffloading": False,
            **training,
        },
        resources={"gpus": 1},
    )


def test_a_job_fits_a_24_gib_gpu_only_with_chunked_cross_entropy() -> None:
    """Llama-3.2-1B LoRA at 16k tokens on one 24 GiB L4: the plain loss's fp32 logits
    (27 GiB at a 128k vocabulary) do not fit; the chunked loss keeps 8 GiB of them, and the
    planner turns it on when the job leaves it unset. A job that fits without it keeps the
    plain loss."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    l4 = pools("l4")
    assert l4[0].spec.gpu.memory_gib == 24

    def job(chunked: bool | None, seq: int = 16384) -> FineTuneJobSpec:
        return _one_gpu_job(arch, seq, chunkedCrossEntropy=chunked, fusedCrossEntropy=False)

    with pytest.raises(InfeasibleError) as refused:
        plan_job(job(False), l4, arch, NO_LIVE)
    assert "needs at least 44.4 GiB per GPU" in str(refused.value)
    assert "enable training.chunkedCrossEntropy" in str(refused.value)
    assert "enable training.fusedCrossEntropy" in str(refused.value)

    for chunked in (None, True):
        plan = plan_job(job(chunked), l4, arch, NO_LIVE)
        c = plan.chosen
        assert c.estimate.setup.chunked_ce
        assert c.estimate.per_gpu_bytes * NO_LIVE.safety_factor <= 24 * GIB
        assert plan.to_status(l4).chunked_cross_entropy is True

    short = plan_job(job(None, seq=2048), l4, arch, NO_LIVE)
    assert not short.chosen.estimate.setup.chunked_ce
    assert short.to_status(l4).chunked_cross_entropy is None


def test_a_job_fits_a_24_gib_gpu_only_with_the_fused_cross_entropy() -> None:
    """Llama-3.2-1B LoRA at 32k tokens on one 24 GiB L4: the chunked loss still keeps every
    chunk's fp32 log-softmax (16 GiB at a 128k vocabulary), 36 GiB in all; the fused loss keeps
    nothing of vocabulary size (17.9 GiB). The planner tries plain, chunked, then fused, so a
    job that fits with the chunked loss keeps it (tested on every device)."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    l4 = pools("l4")

    def job(fused: bool | None, seq: int = 32768) -> FineTuneJobSpec:
        return _one_gpu_job(arch, seq, fusedCrossEntropy=fused)

    with pytest.raises(InfeasibleError) as refused:
        plan_job(job(False), l4, arch, NO_LIVE)
    assert "enable training.fusedCrossEntropy" in str(refused.value)

    for fused in (None, True):
        plan = plan_job(job(fused), l4, arch, NO_LIVE)
        setup = plan.chosen.estimate.setup
        assert setup.fused_ce and not setup.chunked_ce
        assert plan.chosen.estimate.per_gpu_bytes * NO_LIVE.safety_factor <= 24 * GIB
        status = plan.to_status(l4)
        assert status.fused_cross_entropy is True and status.chunked_cross_entropy is None

    chunked = plan_job(job(None, seq=16384), l4, arch, NO_LIVE).chosen.estimate.setup
    assert chunked.chunked_ce and not chunked.fused_ce


def test_the_fused_loss_is_not_chosen_where_the_trainer_cannot_run_it() -> None:
    """Llama-3.1-8B LoRA at 24k tokens on one 48 GiB L40S fits only with the fused loss (51.0
    GiB chunked, 37.4 fused). With an adapter on lm_head (which the kernel cannot apply) the
    walk leaves the fused loss out and nothing fits; a job that asks for it there, or for
    Gemma 2's soft-capped logits, is told why (an invalid spec, before any GPU)."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    l40s = pools("l40s")

    def job(fused: bool | None, targets: list[str]) -> FineTuneJobSpec:
        return _one_gpu_job(arch, 24576, targets, fusedCrossEntropy=fused)

    assert plan_job(job(None, ["q_proj"]), l40s, arch, NO_LIVE).chosen.estimate.setup.fused_ce
    with pytest.raises(InfeasibleError) as refused:
        plan_job(job(None, ["q_proj", "lm_head"]), l40s, arch, NO_LIVE)
    assert "memory" in str(refused.value)
    with pytest.raises(EstimatorError, match="adapter on the output layer"):
        plan_job(job(True, ["q_proj", "lm_head"]), l40s, arch, NO_LIVE)

    gemma = load_arch("google/gemma-2-2b")
    asked = spec(
        model={"uri": gemma.name},
        training={"sequenceLength": 2048, "fusedCrossEntropy": True},
        resources={"gpus": 1},
    )
    with pytest.raises(EstimatorError, match="soft-caps its logits"):
        plan_job(asked, l40s, gemma, NO_LIVE)


def test_activation_offloading_is_the_last_resort_and_is_priced() -> None:
    """Llama-3.2-3B LoRA at 32k tokens on one 48 GiB L40S: 50.3 GiB needed with the
    activations on the GPU, 43.8 GiB with each layer's input in host memory. The planner
    turns offloading on only then, and the plan is slower by the copies it prices."""
    arch = load_arch("meta-llama/Llama-3.2-3B")
    l40s = pools("l40s")

    def job(offload: bool | None, seq: int = 32768) -> FineTuneJobSpec:
        return _one_gpu_job(
            arch, seq, globalBatchSize=4, chunkedCrossEntropy=True, activationOffloading=offload
        )

    with pytest.raises(InfeasibleError) as refused:
        plan_job(job(False), l40s, arch, NO_LIVE)
    assert "needs at least 50.3 GiB per GPU" in str(refused.value)
    assert "enable training.activationOffloading" in str(refused.value)

    plan = plan_job(job(None), l40s, arch, NO_LIVE)
    chosen = plan.chosen
    assert chosen.estimate.setup.activation_offload and chosen.grad_ckpt
    assert chosen.estimate.per_gpu_bytes * NO_LIVE.safety_factor <= 48 * GIB
    assert plan.to_status(l40s).activation_offloading is True
    # The layer inputs wait in the trainer pod's host memory: the plan says how much.
    host_gib = offloaded_bytes(arch, chosen.estimate.setup) * chosen.gpus_per_node / GIB
    assert plan.to_status(l40s).host_offload_gib == round(host_gib, 2) > 1
    # Priced: a GPU with room for it runs without the copies; on the L40S each step pays
    # for every layer input going to host memory and back.
    roomy = plan_job(job(None), pools("a100-80gb"), arch, NO_LIVE).chosen
    assert not roomy.estimate.setup.activation_offload
    ctx = planner_context.JobContext(job(None), arch, NO_LIVE)
    setup = replace(chosen.estimate.setup, activation_offload=False)
    without = ctx.candidate(
        l40s[0], "lora", 1, 1, "none", 1, True, replace(chosen.estimate, setup=setup), False
    )
    per_step = 2 * offloaded_bytes(arch, chosen.estimate.setup) * chosen.grad_accum
    assert per_step > 0
    assert chosen.duration_s - without.duration_s == pytest.approx(
        plan.total_steps * per_step / HOST_LINK_BYTES_PER_S
    )
    # A shorter sequence fits without offloading, and the planner leaves it off.
    short = plan_job(job(None, seq=8192), l40s, arch, NO_LIVE)
    assert not short.chosen.estimate.setup.activation_offload
    assert short.to_status(l40s).activation_offloading is None
    assert short.to_status(l40s).host_offload_gib is None


def test_each_candidate_is_sized_with_its_gradient_accumulation() -> None:
    """The estimate of a configuration counts the accumulation the trainer will run:
    micro-batch × GPUs × accumulation = global batch."""
    s = spec(model={"uri": "meta-llama/Llama-3.2-1B"}, method="full")
    plan = plan_job(s, pools("a100-80gb", "h100"), load_arch(s.model.uri), NO_LIVE)
    candidates = [plan.chosen, *plan.alternatives]
    assert {c.grad_accum for c in candidates} != {1}
    for c in candidates:
        assert c.estimate.setup.grad_accumulation == c.grad_accum
        assert c.micro_batch * c.total_gpus * c.grad_accum == 32


def test_accumulated_gradients_can_change_the_plan() -> None:
    """Full fine-tuning under FSDP2 accumulates unsharded fp32 gradients: a configuration that
    accumulates needs more memory than the same micro-batch making up the whole global batch,
    enough here to leave the 48 GiB GPUs."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    base = {"resources": {"gpus": 8}, "method": "full"}
    layout = {"microBatchSize": 1, "gradientCheckpointing": True}
    whole = spec(**base, training={**layout, "globalBatchSize": 8})
    accumulating = spec(**base, training={**layout, "globalBatchSize": 32})
    one = plan_job(whole, pools("l40s", "h100"), arch, NO_LIVE).chosen
    four = plan_job(accumulating, pools("l40s", "h100"), arch, NO_LIVE)
    assert (one.pool, one.grad_accum) == ("l40s", 1)
    assert (four.chosen.pool, four.chosen.grad_accum) == ("h100", 4)
    assert four.chosen.estimate.breakdown["gradients"] == arch.total_params * 4
    assert [r.pool for r in four.rejected] == ["l40s"]
    with pytest.raises(InfeasibleError, match=r"raise or unset training\.microBatchSize \(now 1\)"):
        plan_job(accumulating, pools("l40s"), arch, NO_LIVE)


def test_estimates_are_shared_by_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory estimate depends on the layout, not the pool: planning on four pools with
    the same GPU shape sizes each layout once, as planning on one does."""
    calls: list[object] = []

    def counting(arch: ModelArch, setup: TrainingSetup) -> VramEstimate:
        calls.append(setup)
        return estimate_vram(arch, setup)

    monkeypatch.setattr(planner_context, "estimate_vram", counting)
    s = spec(model={"uri": "meta-llama/Llama-3.1-70B"}, method="auto")
    arch = load_arch(s.model.uri)
    one = pools("a100-80gb")
    four = [*pools("a100-80gb", "a100-80gb-spot", "h100"), twin(one[0], 1.1)]
    planner_context._estimate.cache_clear()  # estimates kept from earlier plans
    plan_job(s, one, arch, NO_LIVE)
    alone = len(calls)
    calls.clear()
    planner_context._estimate.cache_clear()
    plan_job(s, four, arch, NO_LIVE)
    assert alone > 1
    assert len(calls) == len(set(calls)) == alone

    # Planned again (its pools' capacity changed while it waited): the same questions,
    # answered from the estimates kept, and the same plan.
    calls.clear()
    again = plan_job(s, four, arch, NO_LIVE)
    assert calls == []
    assert again == plan_job(s, four, arch, NO_LIVE)


def test_a_budget_miss_is_not_reported_as_a_slower_configuration_s_deadline() -> None:
    """The walk of a group stops at the first configuration that fits: when it meets the
    deadline but not the budget, the pool is rejected for the budget, although slower
    configurations of the group would miss the deadline."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    l40s = pools("l40s")
    fastest = plan_job(spec(resources={"gpus": 1}), l40s, arch, NO_LIVE).chosen
    deadline = f"{math.ceil(fastest.duration_s * 1.02)}s"
    without_fastest = replace(NO_LIVE, forbid=frozenset({fastest.layout}))
    with pytest.raises(InfeasibleError, match="over the deadline"):
        plan_job(spec(resources={"gpus": 1, "deadline": deadline}), l40s, arch, without_fastest)
    s = spec(resources={"gpus": 1, "deadline": deadline, "maxCostUSD": fastest.cost * 0.9})
    error = assert_same_as_reference(s, l40s, NO_LIVE)
    assert isinstance(error, str)
    assert (
        f"l40s: cheapest fitting configuration costs ${fastest.cost:,.2f}, over maxCostUSD" in error
    )
    assert "deadline" not in error


def test_the_optimizer_in_backward_is_chosen_when_only_it_fits() -> None:
    """Llama-3.1-8B full fine-tuning with 8-bit AdamW on one 48 GiB L40S: with every
    gradient alive at the end of backward no configuration fits; stepping each parameter in
    backward does, with one micro-batch per step (it needs accumulation 1). Refused, the
    rejection says to enable it; on an 80 GiB GPU the plan does without it."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    l40s = pools("l40s")

    def job(in_backward: bool | None) -> FineTuneJobSpec:
        return spec(
            model={"uri": arch.name},
            method="full",
            training={
                "globalBatchSize": 2,
                "optimizer": "adamw-8bit",
                "optimizerInBackward": in_backward,
            },
            resources={"gpus": 1},
        )

    with pytest.raises(InfeasibleError) as refused:
        plan_job(job(False), l40s, arch, NO_LIVE)
    assert "enable training.optimizerInBackward" in str(refused.value)

    plan = plan_job(job(None), l40s, arch, NO_LIVE)
    chosen = plan.chosen
    assert chosen.estimate.setup.optimizer_in_backward and chosen.grad_accum == 1
    assert chosen.estimate.per_gpu_bytes * NO_LIVE.safety_factor <= 48 * GIB
    assert plan.to_status(l40s).optimizer_in_backward is True
    roomy = plan_job(job(None), pools("h100"), arch, NO_LIVE)
    assert not roomy.chosen.estimate.setup.optimizer_in_backward
    assert roomy.to_status(pools("h100")).optimizer_in_backward is None


def test_the_optimizer_in_backward_applies_only_where_it_can_step() -> None:
    """Set to true, it is used by full fine-tuning configurations with one micro-batch per
    step, and left off where the step accumulates micro-batches."""
    arch = load_arch("meta-llama/Llama-3.2-1B")

    def chosen(global_batch: int) -> Any:
        training = {"globalBatchSize": global_batch, "microBatchSize": 4}
        job = spec(
            model={"uri": arch.name},
            method="full",
            training={**training, "optimizerInBackward": True},
            resources={"gpus": 1},
        )
        return plan_job(job, pools("h100"), arch, NO_LIVE).chosen

    one = chosen(4)
    assert one.grad_accum == 1 and one.estimate.setup.optimizer_in_backward
    accumulating = chosen(8)
    assert accumulating.grad_accum == 2
    assert not accumulating.estimate.setup.optimizer_in_backward
