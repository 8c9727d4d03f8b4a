"""Model families as transformers writes them (pure data): the module names of each family's
decoder block, which ``model_type`` values kubetune sizes, and the defaults a ``config.json``
may leave out. :mod:`kubetune.planning.arch` reads configs and counts parameters with them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LLAMA_NAMES",
    "MODEL_TYPE_ALIASES",
    "MODULE_NAMES",
    "SUBCONFIG_DEFAULTS",
    "SUPPORTED_MODEL_TYPES",
    "TEXT_TYPE_FOR",
    "TIED_BY_DEFAULT",
    "ModuleNames",
]


@dataclass(frozen=True)
class ModuleNames:
    """The leaf names and paths of a family's linears (Llama's by default), as PEFT's
    ``target_modules`` match them."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    qkv: str = ""  # fused q/k/v projection, when non-empty
    o: str = "o_proj"
    gate: str = "gate_proj"
    up: str = "up_proj"
    gate_up: str = ""  # fused gate/up projection, when non-empty
    down: str = "down_proj"
    gated: bool = True  # SwiGLU/GeGLU (gate, up, down) vs plain two-matrix MLP
    attn_prefix: str = "self_attn"
    mlp_prefix: str = "mlp"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"
    experts_prefix: str = "mlp.experts.*"
    router: str = "gate"
    router_prefix: str = "mlp"
    peft_experts: bool = True
    """PEFT's ``all-linear`` puts adapters on the stacked experts and the router (transformers
    >= 5 stores them as parameters, not ``nn.Linear``; PEFT maps them per model family)."""


LLAMA_NAMES = ModuleNames()
MODULE_NAMES: dict[str, ModuleNames] = {
    "mixtral": ModuleNames(
        expert_gate="w1",
        expert_up="w3",
        expert_down="w2",
        experts_prefix="block_sparse_moe.experts.*",
        router_prefix="block_sparse_moe",
    ),
    # PEFT 0.21 adapts only the shared expert of Qwen2-MoE under all-linear (tests pin it).
    "qwen2_moe": ModuleNames(peft_experts=False),
    "phi3": ModuleNames(qkv="qkv_proj", gate_up="gate_up_proj"),
    "phi": ModuleNames(o="dense", up="fc1", down="fc2", gated=False),
    "falcon": ModuleNames(
        qkv="query_key_value",
        o="dense",
        up="dense_h_to_4h",
        down="dense_4h_to_h",
        gated=False,
        attn_prefix="self_attention",
    ),
}


TEXT_TYPE_FOR: dict[str, str] = {
    "gemma3": "gemma3_text",
    "mistral3": "mistral",
    "llava": "llama",
}
MODEL_TYPE_ALIASES: dict[str, str] = {
    "refinedweb": "falcon",
    "refinedwebmodel": "falcon",
    "gemma3": "gemma3_text",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "phi",
    "falcon",
)

# transformers config-class defaults for the fields a composite config may leave out of its
# nested ``text_config`` (sub-configs are serialised as a diff against these defaults).
SUBCONFIG_DEFAULTS: dict[str, dict[str, object]] = {
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
    },
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    },
}

# transformers' default for tie_word_embeddings per model_type (a config.json may omit it when
# it equals the default).
TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3_text", "falcon"})
