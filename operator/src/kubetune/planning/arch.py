"""Model architectures: shapes, parameter counts and ``config.json`` parsing.

The planner needs to know, for the model a job fine-tunes, how many parameters it has (all of
them and the ones active per token), the shape of every ``nn.Linear`` a LoRA adapter can attach
to, and the attention geometry that sizes activations and the KV cache.  This module derives
all of that from a Hugging Face ``config.json`` (downloaded, read from disk, or taken from the
built-in table in :mod:`kubetune.planning.models_table`) without importing torch or transformers.

Parameter counting follows the modelling code of each supported ``model_type``:

* embeddings: ``vocab_size * hidden_size`` (one table; an untied output projection is the
  separate ``lm_head`` linear);
* every linear inside a decoder block (attention, MLP or experts, MoE router), with biases
  where the architecture has them;
* normalisation weights (RMSNorm: one vector; LayerNorm: weight and bias), including the final
  norm and per-head ``q_norm``/``k_norm`` where present.

Rotary embeddings, attention soft-capping and similar have no parameters and are ignored.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import NamedTuple, Protocol

from kubetune.planning.families import (
    LLAMA_NAMES,
    MODEL_TYPE_ALIASES,
    MODULE_NAMES,
    SUBCONFIG_DEFAULTS,
    SUPPORTED_MODEL_TYPES,
    TEXT_TYPE_FOR,
    TIED_BY_DEFAULT,
    ModuleNames,
)
from kubetune.planning.models_table import MODELS, KnownModel

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ArchitectureError",
    "LinearLayer",
    "ModelArch",
    "arch_from_hf_config",
    "find_known_model",
    "known_archs",
    "known_in_volume_path",
    "known_models",
    "suggestions",
]

FIX_UNKNOWN = (
    "To fix: use a model id from the built-in table (`kubetune estimate --list-models`), "
    "point --config at a local config.json, or set spec.model.architecture to a known model id "
    "with the same architecture (e.g. `Qwen/Qwen2.5-7B`)."
)


class ArchitectureError(ValueError):
    """A model architecture could not be determined or is inconsistent.

    The message always says what went wrong and ends with a ``To fix:`` hint.
    """


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class LinearLayer:
    """One kind of ``nn.Linear`` module and how many of it the model holds."""

    name: str
    """Leaf module name as PEFT ``target_modules`` matches it (``q_proj``, ``w1``, ``lm_head``)."""
    in_features: int
    out_features: int
    count: int
    """Number of such modules in the whole model (e.g. ``num_layers * num_experts``)."""
    per_expert: bool = False
    """True for MoE expert linears: only ``experts_per_token / num_experts`` are active."""
    router: bool = False
    """True for the MoE router (a linear in older transformers, its own module since 5.0)."""
    bias: bool = False
    path: str = ""
    """Module path inside a decoder layer, ``*`` standing for the expert index."""

    @property
    def params(self) -> int:
        """Parameters of one module (weight plus bias)."""
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)

    @property
    def total_params(self) -> int:
        """Parameters of all ``count`` modules."""
        return self.params * self.count


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, enough to size a fine-tuning run."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (the per-expert width for MoE unless ``moe_intermediate_size`` is set)."""
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 1
    experts_per_token: int = 1
    moe_intermediate_size: int = 0
    attention_bias: bool = False
    """Biases on the q/k/v projections."""
    published_params: int | None = None
    max_position_embeddings: int = 0
    # ---- refinements beyond the common core; defaults describe a Llama-style block
    published_active_params: int | None = None
    attention_out_bias: bool = False
    """Bias on the attention output projection (``o_proj``/``dense``)."""
    mlp_bias: bool = False
    norm_bias: bool = False
    """LayerNorm (weight and bias) instead of RMSNorm (weight only)."""
    norms_per_layer: int = 2
    qk_norm: bool = False
    """Per-head ``q_norm``/``k_norm`` (Qwen3, Gemma 3)."""
    lm_head_bias: bool = False
    shared_expert_intermediate_size: int = 0
    """Width of the always-active shared expert (Qwen2-MoE); 0 when absent."""
    num_dense_layers: int = 0
    """For MoE models: decoder layers that use a dense MLP instead of experts."""
    python_tanh_gelu: bool = False
    """The MLP activation is transformers' Python tanh-GELU formula (``hidden_act: gelu_new``,
    Phi's default), whose autograd keeps more tensors than a fused GELU kernel."""

    def __post_init__(self) -> None:
        positive = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
        }
        for field_name, value in positive.items():
            if value <= 0:
                raise ArchitectureError(
                    f"architecture {self.name!r}: {field_name} must be positive, got {value}. "
                    "To fix: check the model's config.json."
                )
        if self.num_heads % self.num_kv_heads != 0:
            raise ArchitectureError(
                f"architecture {self.name!r}: num_attention_heads ({self.num_heads}) is not a "
                f"multiple of num_key_value_heads ({self.num_kv_heads}). "
                "To fix: check the model's config.json."
            )
        if self.experts_per_token > self.num_experts:
            raise ArchitectureError(
                f"architecture {self.name!r}: experts_per_token ({self.experts_per_token}) "
                f"exceeds num_experts ({self.num_experts}). To fix: check num_experts_per_tok."
            )
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ArchitectureError(
                f"architecture {self.name!r}: num_dense_layers ({self.num_dense_layers}) must "
                f"be between 0 and num_layers ({self.num_layers}). "
                "To fix: check mlp_only_layers / decoder_sparse_step."
            )
        if min(self.moe_intermediate_size, self.shared_expert_intermediate_size) < 0:
            raise ArchitectureError(
                f"architecture {self.name!r}: expert widths must not be negative. "
                "To fix: check moe_intermediate_size / shared_expert_intermediate_size."
            )

    # ------------------------------------------------------------------ derived shapes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one routed expert's MLP."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def peft_adapts_experts(self) -> bool:
        """Whether LoRA ``all-linear`` adapts the stacked experts and the router (MoE only)."""
        return MODULE_NAMES.get(self.model_type, LLAMA_NAMES).peft_experts

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is a mixture of experts (0 for dense models)."""
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the K (or V) projection output: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    def linear_layers(self) -> list[LinearLayer]:
        """Every ``nn.Linear`` in the decoder blocks, then ``lm_head`` when it is not tied.

        Embeddings are not listed.  Names can repeat when the same leaf name lives in several
        sub-modules (Qwen2-MoE's experts and shared expert both have ``gate_proj``); ``path``
        tells them apart.
        """
        return list(self._linear_layers)

    # The shapes below derive from the frozen fields alone, so each is computed once per
    # instance: the planner asks for them for every configuration it sizes.

    @cached_property
    def _linear_layers(self) -> tuple[LinearLayer, ...]:
        lay = MODULE_NAMES.get(self.model_type, LLAMA_NAMES)
        h, n = self.hidden_size, self.num_layers
        layers: list[LinearLayer] = []

        def add(
            name: str,
            fan_in: int,
            fan_out: int,
            count: int,
            prefix: str,
            *,
            bias: bool = False,
            per_expert: bool = False,
            router: bool = False,
        ) -> None:
            if count > 0:
                layers.append(
                    LinearLayer(
                        name=name,
                        in_features=fan_in,
                        out_features=fan_out,
                        count=count,
                        per_expert=per_expert,
                        router=router,
                        bias=bias,
                        path=f"{prefix}.{name}",
                    )
                )

        # attention
        ap = lay.attn_prefix
        if lay.qkv:
            add(lay.qkv, h, self.q_size + 2 * self.kv_size, n, ap, bias=self.attention_bias)
        else:
            add(lay.q, h, self.q_size, n, ap, bias=self.attention_bias)
            add(lay.k, h, self.kv_size, n, ap, bias=self.attention_bias)
            add(lay.v, h, self.kv_size, n, ap, bias=self.attention_bias)
        add(lay.o, self.q_size, h, n, ap, bias=self.attention_out_bias)

        # dense MLP (every layer of a dense model, the dense layers of a MoE model)
        dense = n - self.moe_layers
        self._add_mlp(add, lay, self.intermediate_size, dense, lay.mlp_prefix)

        # mixture of experts
        moe = self.moe_layers
        if moe:
            add(lay.router, h, self.num_experts, moe, lay.router_prefix, router=True)
            e, w, xp = self.num_experts, self.expert_intermediate_size, lay.experts_prefix
            add(lay.expert_gate, h, w, moe * e, xp, bias=self.mlp_bias, per_expert=True)
            add(lay.expert_up, h, w, moe * e, xp, bias=self.mlp_bias, per_expert=True)
            add(lay.expert_down, w, h, moe * e, xp, bias=self.mlp_bias, per_expert=True)
            if self.shared_expert_intermediate_size:
                self._add_mlp(
                    add,
                    lay,
                    self.shared_expert_intermediate_size,
                    moe,
                    f"{lay.mlp_prefix}.shared_expert",
                )
                add("shared_expert_gate", h, 1, moe, lay.mlp_prefix)

        if not self.tie_embeddings:
            layers.append(
                LinearLayer(
                    name="lm_head",
                    in_features=h,
                    out_features=self.vocab_size,
                    count=1,
                    bias=self.lm_head_bias,
                    path="lm_head",
                )
            )
        return tuple(layers)

    def _add_mlp(self, add: _AddFn, lay: ModuleNames, width: int, count: int, prefix: str) -> None:
        h, b = self.hidden_size, self.mlp_bias
        if lay.gate_up:
            add(lay.gate_up, h, 2 * width, count, prefix, bias=b)
        elif lay.gated:
            add(lay.gate, h, width, count, prefix, bias=b)
            add(lay.up, h, width, count, prefix, bias=b)
        else:
            add(lay.up, h, width, count, prefix, bias=b)
        add(lay.down, width, h, count, prefix, bias=b)

    # ------------------------------------------------------------------ parameter counts

    @property
    def embedding_params(self) -> int:
        """The input embedding table (an untied ``lm_head`` is counted with the linears)."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embeddings."""
        if self.tie_embeddings:
            return 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def norm_params(self) -> int:
        per_norm = self.hidden_size * (2 if self.norm_bias else 1)
        per_qk = self.head_dim * (2 if self.norm_bias else 1)
        per_layer = self.norms_per_layer * per_norm + (2 * per_qk if self.qk_norm else 0)
        return self.num_layers * per_layer + per_norm  # + the final norm

    @cached_property
    def linear_params(self) -> int:
        """All linears including an untied ``lm_head``."""
        return sum(layer.total_params for layer in self.linear_layers())

    @cached_property
    def total_params(self) -> int:
        """Every parameter of the model; MoE models count all experts."""
        return self.embedding_params + self.linear_params + self.norm_params

    @cached_property
    def expert_params(self) -> int:
        """Parameters held by routed experts (0 for dense models)."""
        return sum(layer.total_params for layer in self.linear_layers() if layer.per_expert)

    @cached_property
    def active_params(self) -> int:
        """Parameters used for one token: MoE models count ``experts_per_token`` experts."""
        if not self.is_moe:
            return self.total_params
        active_experts = self.expert_params * self.experts_per_token // self.num_experts
        return self.total_params - self.expert_params + active_experts

    @cached_property
    def non_embedding_params(self) -> int:
        return self.total_params - self.embedding_params - self.lm_head_params

    @property
    def param_error(self) -> float | None:
        """Relative difference between the computed and the published size, if published."""
        if not self.published_params:
            return None
        return (self.total_params - self.published_params) / self.published_params

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token at 16-bit precision, all layers."""
        return 2 * self.num_layers * self.kv_size * 2


class _AddFn(Protocol):
    def __call__(
        self,
        name: str,
        fan_in: int,
        fan_out: int,
        count: int,
        prefix: str,
        *,
        bias: bool = False,
        per_expert: bool = False,
        router: bool = False,
    ) -> None: ...


# --------------------------------------------------------------------------- config.json parsing


class _Reader:
    """Typed access to a config dict with actionable errors."""

    def __init__(self, cfg: Mapping[str, object], source: str, defaults: Mapping[str, object]):
        self.cfg = cfg
        self.source = source
        self.defaults = defaults

    def _raw(self, keys: Sequence[str]) -> object | None:
        for key in keys:
            value = self.cfg.get(key)
            if value is not None:
                return value
        for key in keys:
            value = self.defaults.get(key)
            if value is not None:
                return value
        return None

    def _as_int(self, key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ArchitectureError(
                f"config.json at {self.source} has {key}={value!r}, expected an integer; "
                "To fix: correct the value in config.json."
            )
        if isinstance(value, float):
            if not value.is_integer():
                raise ArchitectureError(
                    f"config.json at {self.source} has {key}={value!r}, expected an integer; "
                    "To fix: correct the value in config.json."
                )
            return int(value)
        return value

    def req_int(self, *keys: str) -> int:
        value = self._raw(keys)
        if value is None:
            raise ArchitectureError(
                f"config.json at {self.source} lacks {keys[0]}; To fix: add {keys[0]} to the "
                "config (copy it from the model's hub page), or set spec.model.architecture to "
                "a known model id with the same architecture."
            )
        return self._as_int(keys[0], value)

    def opt_int(self, *keys: str, default: int) -> int:
        value = self._raw(keys)
        return default if value is None else self._as_int(keys[0], value)

    def opt_bool(self, key: str, *, default: bool) -> bool:
        value = self._raw((key,))
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ArchitectureError(
                f"config.json at {self.source} has {key}={value!r}, expected true or false; "
                "To fix: correct the value in config.json."
            )
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._raw((key,))
        if value is None:
            return []
        if not isinstance(value, list):
            raise ArchitectureError(
                f"config.json at {self.source} has {key}={value!r}, expected a list; "
                "To fix: correct the value in config.json."
            )
        return [self._as_int(key, item) for item in value]


def _select_text_config(
    cfg: Mapping[str, object], source: str
) -> tuple[Mapping[str, object], bool, str]:
    """Return (the language-model config, whether it is nested, its model_type)."""
    top_type = str(cfg.get("model_type") or "").lower()
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in cfg:
        nested: dict[str, object] = {str(k): v for k, v in text.items()}
        text_type = str(nested.get("model_type") or TEXT_TYPE_FOR.get(top_type, "")).lower()
        if "tie_word_embeddings" not in nested and "tie_word_embeddings" in cfg:
            nested["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return nested, True, text_type
    if not top_type:
        raise ArchitectureError(
            f'config.json at {source} lacks model_type; To fix: add "model_type" (one of '
            f"{', '.join(SUPPORTED_MODEL_TYPES)}) or use a known model id."
        )
    return cfg, False, top_type


def _num_dense_layers(r: _Reader, num_layers: int, num_experts: int) -> int:
    """Qwen-MoE style: layers listed in mlp_only_layers or off the sparse step are dense."""
    if num_experts <= 1:
        return 0
    mlp_only = set(r.int_list("mlp_only_layers"))
    step = r.opt_int("decoder_sparse_step", default=1)
    if step <= 0:
        raise ArchitectureError(
            f"config.json at {r.source} has decoder_sparse_step={step}; To fix: use a positive "
            "value (1 means every layer is sparse)."
        )
    dense = 0
    for i in range(num_layers):
        if i in mlp_only or (i + 1) % step != 0:
            dense += 1
    return dense


def arch_from_hf_config(
    cfg: Mapping[str, object], name: str = "", *, source: str | None = None
) -> ModelArch:
    """Build a :class:`ModelArch` from a Hugging Face ``config.json`` dict.

    Composite (vision-language) configs are reduced to their ``text_config``.  ``source`` names
    where the config came from in error messages (a path or URL); it defaults to ``name``.
    """
    if not isinstance(cfg, Mapping):
        raise ArchitectureError(
            f"config for {name or 'model'} is a {type(cfg).__name__}, not a JSON object; "
            "To fix: pass the parsed contents of config.json."
        )
    where = source or name or "<config dict>"
    text, nested, raw_type = _select_text_config(cfg, where)
    model_type = MODEL_TYPE_ALIASES.get(raw_type, raw_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ArchitectureError(
            f"config.json at {where} has model_type {raw_type or '(missing)'!r}, which kubetune "
            f"cannot size (supported: {', '.join(SUPPORTED_MODEL_TYPES)}). {FIX_UNKNOWN}"
        )
    r = _Reader(text, where, SUBCONFIG_DEFAULTS.get(model_type, {}) if nested else {})
    display = name or str(cfg.get("_name_or_path") or "") or model_type

    hidden = r.req_int("hidden_size", "n_embed", "d_model")
    layers = r.req_int("num_hidden_layers", "n_layer")
    heads = r.req_int("num_attention_heads", "n_head")
    vocab = r.req_int("vocab_size")
    if heads <= 0:
        raise ArchitectureError(
            f"config.json at {where} has num_attention_heads={heads}; To fix: use a positive value."
        )
    head_dim = r.opt_int("head_dim", default=hidden // heads)
    kv_heads = r.opt_int("num_key_value_heads", default=heads)
    tied = r.opt_bool("tie_word_embeddings", default=model_type in TIED_BY_DEFAULT)
    max_pos = r.opt_int("max_position_embeddings", "n_positions", default=0)
    family = _family_fields(r, model_type, hidden, heads, kv_heads)
    experts = _expert_fields(r, model_type, layers)
    try:
        return ModelArch(
            name=display,
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            head_dim=head_dim,
            vocab_size=vocab,
            tie_embeddings=tied,
            max_position_embeddings=max_pos,
            **family._asdict(),
            **experts._asdict(),
        )
    except ArchitectureError as exc:
        raise ArchitectureError(f"config.json at {where}: {exc}") from None


class _Family(NamedTuple):
    """The fields each model family reads its own way: K/V heads, MLP width, biases, norms."""

    num_kv_heads: int
    intermediate_size: int
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    norms_per_layer: int = 2
    qk_norm: bool = False
    lm_head_bias: bool = False
    python_tanh_gelu: bool = False


def _family_fields(r: _Reader, model_type: str, hidden: int, heads: int, kv_heads: int) -> _Family:
    if model_type == "falcon":
        if r.opt_bool("new_decoder_architecture", default=False):
            kv_heads = r.opt_int("num_kv_heads", "n_head_kv", default=heads)
            norms_per_layer = r.opt_int("num_ln_in_parallel_attn", default=2)
        else:
            kv_heads = 1 if r.opt_bool("multi_query", default=True) else heads
            norms_per_layer = 1 if r.opt_bool("parallel_attn", default=True) else 2
        bias = r.opt_bool("bias", default=False)
        width = r.opt_int("ffn_hidden_size", default=4 * hidden)
        return _Family(
            kv_heads,
            width,
            attention_bias=bias,
            attention_out_bias=bias,
            mlp_bias=bias,
            norm_bias=True,
            norms_per_layer=norms_per_layer,
        )
    if model_type == "phi":
        qk_norm = r.opt_bool("qk_layernorm", default=False)
        width = r.req_int("intermediate_size", "n_inner")
        return _Family(
            kv_heads,
            width,
            attention_bias=True,
            attention_out_bias=True,
            mlp_bias=True,
            norm_bias=True,
            norms_per_layer=1,  # parallel attention/MLP block with one input LayerNorm
            qk_norm=qk_norm,
            lm_head_bias=True,
            python_tanh_gelu=r.cfg.get("hidden_act", "gelu_new") == "gelu_new",
        )
    width = r.req_int("intermediate_size")
    attention_bias = attention_out_bias = mlp_bias = False
    if model_type in ("qwen2", "qwen2_moe"):
        attention_bias = True  # hard-coded on q/k/v; o_proj has none
    elif model_type != "phi3":
        attention_bias = attention_out_bias = r.opt_bool("attention_bias", default=False)
    if model_type == "llama":
        mlp_bias = r.opt_bool("mlp_bias", default=False)
    return _Family(
        kv_heads,
        width,
        attention_bias,
        attention_out_bias,
        mlp_bias,
        # pre/post attention and pre/post feed-forward
        norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
    )


class _Experts(NamedTuple):
    num_experts: int = 1
    experts_per_token: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0


def _expert_fields(r: _Reader, model_type: str, layers: int) -> _Experts:
    # transformers >= 5 writes num_local_experts for Qwen3-MoE too (num_experts is an alias).
    if model_type == "mixtral":
        num_experts = r.req_int("num_local_experts", "num_experts")
        return _Experts(num_experts, r.opt_int("num_experts_per_tok", default=2))
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return _Experts()
    num_experts = r.req_int("num_experts", "num_local_experts")
    per_token = r.req_int("num_experts_per_tok")
    width = r.req_int("moe_intermediate_size")
    dense = _num_dense_layers(r, layers, num_experts)
    shared = 0
    if model_type == "qwen2_moe":
        shared = r.opt_int("shared_expert_intermediate_size", default=0)
    return _Experts(num_experts, per_token, width, shared, dense)


# --------------------------------------------------------------------------- built-in table


def _normalize(model_id: str) -> str:
    """Lookup key: no org, lower case, without -hf/-instruct/-chat/-it/-pt/-base and Meta-."""
    short = model_id.strip().rstrip("/").lower().rsplit("/", 1)[-1]
    tokens = short.replace("_", "-").split("-")
    if len(tokens) > 1 and tokens[0] == "meta":
        tokens = tokens[1:]
    kept = [t for t in tokens if t not in {"hf", "instruct", "chat", "it", "pt", "base"}]
    return "-".join(kept)


@cache
def _table() -> dict[str, tuple[KnownModel, ModelArch]]:
    index: dict[str, tuple[KnownModel, ModelArch]] = {}
    for entry in MODELS:
        arch = arch_from_hf_config(entry.config, entry.hf_id, source=f"built-in:{entry.hf_id}")
        arch = replace(
            arch,
            published_params=entry.published_params,
            published_active_params=entry.published_active_params,
        )
        keys = {entry.hf_id.lower(), _normalize(entry.hf_id)}
        keys.update(_normalize(alias) for alias in entry.aliases)
        for key in keys:
            if key in index and index[key][0] is not entry:
                raise RuntimeError(  # pragma: no cover - a table bug, caught by the unit tests
                    f"models table: {entry.hf_id} and {index[key][0].hf_id} share key {key!r}"
                )
            index[key] = (entry, arch)
    return index


def known_models() -> list[str]:
    """Canonical ids of every model in the built-in table, in table order."""
    return [entry.hf_id for entry in MODELS]


def known_archs() -> list[ModelArch]:
    """Every built-in architecture, in table order, with its published size."""
    table = _table()
    return [table[entry.hf_id.lower()][1] for entry in MODELS]


def find_known_model(model: str) -> ModelArch | None:
    """Look ``model`` up in the built-in table (case-insensitive, org prefix optional)."""
    table = _table()
    key = model.strip().rstrip("/").lower()
    hit = table.get(key) or table.get(_normalize(key))
    return None if hit is None else hit[1]


def suggestions(model: str) -> str:
    """ " Did you mean: ...?" with the closest built-in ids, or "" when none is close."""
    keys = [_normalize(entry.hf_id) for entry in MODELS]
    close = difflib.get_close_matches(_normalize(model), keys, n=3, cutoff=0.6)
    if not close:
        return ""
    ids = [entry.hf_id for entry in MODELS if _normalize(entry.hf_id) in close]
    return f" Did you mean: {', '.join(ids)}?"


def known_in_volume_path(path: str, name: str) -> ModelArch | None:
    """The built-in architecture a path on a volume names (``Llama-3.1-8B`` of
    ``pvc://models/Llama-3.1-8B``: `path` is what follows the claim or bucket), called `name`."""
    for part in reversed([p for p in path.split("/") if p]):
        arch = find_known_model(part)
        if arch is not None:
            return replace(arch, name=name)
    return None
