"""The model FLOPs behind the trainer's MFU figure (`modeling._flops_per_token`): the weights
that take part in a matmul, counted once each, whether or not the output projection shares
the input embedding's table."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("transformers", reason="trainer tests need the trainer extra")

from kubetune_trainer.modeling import _count_params, _flops_per_token, _head_is_tied

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize("full", [True, False])
def test_a_tied_output_projection_costs_the_same_flops_as_an_untied_one(full: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    common = {
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    flops = {}
    for tied in (True, False):
        config = LlamaConfig(**common, tie_word_embeddings=tied)
        model = LlamaForCausalLM(config)
        assert _head_is_tied(model) is tied
        n_params, _ = _count_params(model)
        flops[tied] = _flops_per_token(config, n_params, 256, full=full, tied=_head_is_tied(model))
    # The untied model has one more table, the input embedding, which is a lookup: the same
    # matmuls either way.
    assert flops[True] == flops[False]
    blocks = sum(p.numel() for p in model.model.layers.parameters())
    head = 1000 * 64
    norm = 64
    per_weight = 6 if full else 4
    attention = (3 if full else 2) * 2 * 2 * 64 * 256
    assert flops[True] == per_weight * (blocks + head + norm) + attention
