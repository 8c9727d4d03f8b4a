"""What the planner computes once (an architecture's shapes) stays correct and private."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kubetune.planning.arch import ModelArch, find_known_model, known_models
from kubetune.planning.estimator import TrainingSetup, estimate_vram

pytestmark = pytest.mark.unit


def arch(model: str) -> ModelArch:
    found = find_known_model(model)
    assert found is not None
    return found


def fresh(a: ModelArch) -> ModelArch:
    """An equal architecture that has computed nothing yet."""
    return replace(a)


@pytest.mark.parametrize("model", known_models())
def test_shapes_computed_once_equal_a_fresh_computation(model: str) -> None:
    a = arch(model)
    for _ in range(2):  # the second round reads what the first one stored
        b = fresh(a)
        assert b is not a
        assert a.linear_layers() == b.linear_layers()
        assert (a.total_params, a.active_params, a.expert_params) == (
            b.total_params,
            b.active_params,
            b.expert_params,
        )
        assert (a.linear_params, a.non_embedding_params) == (
            b.linear_params,
            b.non_embedding_params,
        )
    assert a == fresh(a) and hash(a) == hash(fresh(a))


def test_callers_get_their_own_list_of_linears() -> None:
    a = fresh(arch("meta-llama/Llama-3.1-8B"))
    total = a.total_params
    layers = a.linear_layers()
    names = [layer.name for layer in layers]
    layers.clear()
    assert [layer.name for layer in a.linear_layers()] == names
    assert a.linear_layers() is not a.linear_layers()
    assert a.total_params == total


def test_a_changed_copy_computes_its_own_shapes() -> None:
    a = arch("Qwen/Qwen2.5-7B")
    before = a.total_params, len(a.linear_layers()), a.linear_layers()[0].count
    deeper = replace(a, num_layers=2 * a.num_layers)
    untied = replace(a, tie_embeddings=not a.tie_embeddings)
    assert deeper.total_params > a.total_params
    assert deeper.linear_layers()[0].count == 2 * before[2]
    assert len(untied.linear_layers()) == before[1] + (1 if a.tie_embeddings else -1)
    assert (a.total_params, len(a.linear_layers()), a.linear_layers()[0].count) == before


def test_estimates_do_not_depend_on_what_was_asked_before() -> None:
    """The estimator's per-architecture tables give the same numbers on a fresh copy, in any
    order of architectures."""
    setups = [
        # No dropout: PEFT adapts Mixtral's stacked experts only without it.
        TrainingSetup(method="lora", gpus=1, sharding="none", micro_batch=4, lora_dropout=0.0),
        TrainingSetup(method="qlora", gpus=2, sharding="full", grad_ckpt=False, lora_dropout=0.0),
        TrainingSetup(method="full", gpus=8, sharding="grad-op"),
        TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj"), gpus=4),
    ]
    models = ["Qwen/Qwen2.5-0.5B", "mistralai/Mixtral-8x7B-v0.1", "meta-llama/Llama-3.1-70B"]
    first = {(m, s): estimate_vram(arch(m), s) for m in models for s in setups}
    again = {(m, s): estimate_vram(fresh(arch(m)), s) for m in reversed(models) for s in setups}
    assert first == again
