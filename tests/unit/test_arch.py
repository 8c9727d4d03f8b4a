"""kubetune.planning.arch: the architecture table, config.json parsing, parameter counts."""

from __future__ import annotations

import io
import json
import shutil
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

import pytest

from kubetune.planning import arch as arch_mod
from kubetune.planning.arch import (
    ArchitectureError,
    LinearLayer,
    ModelArch,
    arch_from_hf_config,
    find_known_model,
    known_archs,
    known_models,
)
from kubetune.planning.models_table import MODELS
from kubetune.sources import load_arch

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def _fixture(name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def _by_name(a: ModelArch) -> dict[str, LinearLayer]:
    return {layer.name: layer for layer in a.linear_layers()}


# --------------------------------------------------------------------------- the built-in table

REQUIRED = [
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-13b-hf",
    "meta-llama/Llama-2-70b-hf",
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Meta-Llama-3-70B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-405B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Mistral-7B-v0.3",
    "mistralai/Mixtral-8x7B-v0.1",
    "mistralai/Mixtral-8x22B-v0.1",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-3B",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-14B",
    "Qwen/Qwen2.5-32B",
    "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-4B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B",
    "google/gemma-2-2b",
    "google/gemma-2-9b",
    "google/gemma-2-27b",
    "google/gemma-3-4b-pt",
    "google/gemma-3-12b-pt",
    "google/gemma-3-27b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/Phi-3-medium-4k-instruct",
    "microsoft/phi-4",
]


def test_table_holds_the_required_models() -> None:
    names = known_models()
    assert len(names) >= 24
    missing = [m for m in REQUIRED if m not in names]
    assert not missing, f"missing from the built-in table: {missing}"
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("a", known_archs(), ids=lambda a: a.name)
def test_table_total_params_within_2_percent_of_published(a: ModelArch) -> None:
    assert a.published_params is not None
    error = abs(a.total_params - a.published_params) / a.published_params
    assert error <= 0.02, (
        f"{a.name}: computed {a.total_params:,} vs published {a.published_params:,} "
        f"({error:.2%} off)"
    )
    assert a.param_error is not None
    assert abs(a.param_error) == pytest.approx(error)


@pytest.mark.parametrize(
    "a", [a for a in known_archs() if a.published_active_params], ids=lambda a: a.name
)
def test_table_moe_active_params_within_3_percent_of_published(a: ModelArch) -> None:
    assert a.is_moe
    assert a.published_active_params is not None
    error = abs(a.active_params - a.published_active_params) / a.published_active_params
    assert error <= 0.03, (
        f"{a.name}: computed active {a.active_params:,} vs published "
        f"{a.published_active_params:,} ({error:.2%} off)"
    )


def test_every_table_entry_resolves_to_itself() -> None:
    for name in known_models():
        found = find_known_model(name)
        assert found is not None and found.name == name
        assert load_arch(name).name == name


def test_table_entries_are_all_parsable_model_types() -> None:
    for entry in MODELS:
        assert entry.config["model_type"] in arch_mod.SUPPORTED_MODEL_TYPES
        assert entry.published_params > 0


def test_mixtral_8x7b_active_params() -> None:
    m = load_arch("mixtral-8x7b")
    assert m.is_moe
    assert m.active_params == pytest.approx(12.9e9, rel=0.03)
    assert m.total_params == pytest.approx(46.7e9, rel=0.02)
    assert m.active_params < m.total_params


def test_dense_active_equals_total() -> None:
    for a in known_archs():
        if not a.is_moe:
            assert a.active_params == a.total_params
            assert a.expert_params == 0


def test_subtleties_of_the_table() -> None:
    qwen = load_arch("Qwen/Qwen2.5-7B")
    layers = _by_name(qwen)
    assert layers["q_proj"].bias and layers["k_proj"].bias and layers["v_proj"].bias
    assert not layers["o_proj"].bias

    gemma = load_arch("gemma-2-9b")
    assert gemma.tie_embeddings and gemma.head_dim == 256
    assert gemma.num_heads * gemma.head_dim != gemma.hidden_size
    assert _by_name(gemma)["q_proj"].out_features == 16 * 256
    assert "lm_head" not in _by_name(gemma)

    g3 = load_arch("gemma-3-27b")
    assert g3.head_dim == 128 and g3.vocab_size == 262208 and g3.qk_norm

    for tied in ("llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"):
        assert load_arch(tied).tie_embeddings, tied
    assert not load_arch("llama-3.1-8b").tie_embeddings

    qwen3 = load_arch("qwen3-8b")
    assert qwen3.qk_norm
    assert qwen3.norm_params == 36 * (2 * 4096 + 2 * 128) + 4096

    moe = load_arch("Qwen/Qwen3-30B-A3B")
    assert moe.expert_intermediate_size == 768
    assert _by_name(moe)["gate_proj"].per_expert
    assert _by_name(moe)["gate_proj"].out_features == 768


# --------------------------------------------------------------------------- linear layers


def test_llama_has_seven_linears_per_layer_plus_lm_head() -> None:
    a = load_arch("meta-llama/Llama-3.1-8B")
    layers = a.linear_layers()
    per_layer = [layer for layer in layers if layer.name != "lm_head"]
    assert [layer.name for layer in per_layer] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert all(layer.count == a.num_layers for layer in per_layer)
    by = _by_name(a)
    assert (by["q_proj"].in_features, by["q_proj"].out_features) == (4096, 4096)
    assert (by["k_proj"].in_features, by["k_proj"].out_features) == (4096, 1024)
    assert (by["gate_proj"].in_features, by["gate_proj"].out_features) == (4096, 14336)
    assert (by["down_proj"].in_features, by["down_proj"].out_features) == (14336, 4096)
    assert (by["lm_head"].out_features, by["lm_head"].count) == (128256, 1)
    assert by["q_proj"].path == "self_attn.q_proj"


def test_tied_model_lists_no_lm_head() -> None:
    a = load_arch("llama-3.2-1b")
    assert "lm_head" not in _by_name(a)
    assert a.lm_head_params == 0


def test_phi3_uses_fused_qkv_and_gate_up() -> None:
    a = load_arch("microsoft/Phi-3-mini-4k-instruct")
    per_layer = [layer for layer in a.linear_layers() if layer.name != "lm_head"]
    assert [layer.name for layer in per_layer] == [
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    ]
    by = _by_name(a)
    assert (by["qkv_proj"].in_features, by["qkv_proj"].out_features) == (3072, 3 * 3072)
    assert (by["gate_up_proj"].in_features, by["gate_up_proj"].out_features) == (3072, 2 * 8192)
    assert (by["down_proj"].in_features, by["down_proj"].out_features) == (8192, 3072)

    medium = _by_name(load_arch("phi-3-medium"))
    assert medium["qkv_proj"].out_features == (40 + 2 * 10) * 128


def test_mixtral_expert_linears_and_router() -> None:
    a = load_arch("mistralai/Mixtral-8x7B-v0.1")
    by = _by_name(a)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "w1", "w2", "w3"} <= set(by)
    assert "gate_proj" not in by
    for name in ("w1", "w2", "w3"):
        assert by[name].per_expert
        assert by[name].count == 32 * 8
    assert (by["w1"].in_features, by["w1"].out_features) == (4096, 14336)
    assert (by["w2"].in_features, by["w2"].out_features) == (14336, 4096)
    assert not by["gate"].per_expert
    assert (by["gate"].in_features, by["gate"].out_features, by["gate"].count) == (4096, 8, 32)
    assert by["w1"].path == "block_sparse_moe.experts.*.w1"


def test_qwen2_moe_shared_expert_is_always_active() -> None:
    a = load_arch("Qwen/Qwen1.5-MoE-A2.7B")
    shared = [layer for layer in a.linear_layers() if ".shared_expert." in layer.path]
    assert [layer.name for layer in shared] == ["gate_proj", "up_proj", "down_proj"]
    assert not any(layer.per_expert for layer in shared)
    assert "shared_expert_gate" in _by_name(a)


# --------------------------------------------------------------------------- exact arithmetic


def test_tiny_llama_param_count_is_exact() -> None:
    cfg: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 10,
        "tie_word_embeddings": False,
    }
    a = arch_from_hf_config(cfg, "tiny")
    assert a.head_dim == 4
    embed = 10 * 8
    attn = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8
    mlp = 3 * 8 * 16
    norms = 2 * 8
    per_layer = attn + mlp + norms
    lm_head = 8 * 10
    final_norm = 8
    assert a.embedding_params == embed
    assert a.total_params == embed + 2 * per_layer + final_norm + lm_head == 1352
    assert a.non_embedding_params == 2 * per_layer + final_norm

    tied = arch_from_hf_config({**cfg, "tie_word_embeddings": True}, "tiny-tied")
    assert tied.total_params == 1352 - lm_head


def test_tiny_qwen2_counts_qkv_biases() -> None:
    cfg: dict[str, object] = {
        "model_type": "qwen2",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 10,
        "tie_word_embeddings": True,
    }
    a = arch_from_hf_config(cfg)
    attn = (8 * 8 + 8) + (8 * 4 + 4) + (8 * 4 + 4) + 8 * 8
    assert a.total_params == 10 * 8 + attn + 3 * 8 * 16 + 2 * 8 + 8


def test_tiny_moe_total_and_active_are_exact() -> None:
    cfg: dict[str, object] = {
        "model_type": "qwen3_moe",
        "hidden_size": 8,
        "intermediate_size": 32,
        "moe_intermediate_size": 4,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 10,
        "tie_word_embeddings": True,
        "mlp_only_layers": [1],
    }
    a = arch_from_hf_config(cfg)
    assert a.num_dense_layers == 1 and a.moe_layers == 1
    attn = 4 * 8 * 8
    norms = 2 * 8 + 2 * 4  # input/post-attention + q_norm/k_norm
    dense_mlp = 3 * 8 * 32
    router = 8 * 4
    expert = 3 * 8 * 4
    total = 10 * 8 + 2 * (attn + norms) + dense_mlp + router + 4 * expert + 8
    assert a.total_params == total
    assert a.expert_params == 4 * expert
    assert a.active_params == total - 2 * expert
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts.
    renamed = {k: v for k, v in cfg.items() if k != "num_experts"}
    assert arch_from_hf_config({**renamed, "num_local_experts": 4}) == a


def test_falcon_7b_multi_query_param_count() -> None:
    a = arch_from_hf_config(_fixture("falcon-7b.json"), "tiiuae/falcon-7b")
    assert (a.num_kv_heads, a.head_dim, a.tie_embeddings) == (1, 64, True)
    h, n = 4544, 32
    per_layer = h * (71 + 2) * 64 + h * h + 2 * h * 4 * h + 2 * h  # qkv, dense, MLP, 1 LayerNorm
    assert a.total_params == 65024 * h + n * per_layer + 2 * h == 6_921_720_704
    assert [layer.name for layer in a.linear_layers()] == [
        "query_key_value",
        "dense",
        "dense_h_to_4h",
        "dense_4h_to_h",
    ]


def test_phi2_counts_biases_and_layernorms() -> None:
    a = arch_from_hf_config(_fixture("phi-2.json"))
    assert a.name == "microsoft/phi-2"
    assert a.total_params == 2_779_683_840  # the size of the published checkpoint
    assert [layer.name for layer in a.linear_layers()] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "dense",
        "fc1",
        "fc2",
        "lm_head",
    ]


def test_kv_bytes_per_token() -> None:
    a = load_arch("llama-3.1-8b")
    assert a.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


# --------------------------------------------------------------------------- config.json files


@pytest.mark.parametrize(
    ("fixture", "table_id"),
    [
        ("llama-3.1-8b.json", "meta-llama/Llama-3.1-8B"),
        ("qwen2.5-7b-instruct.json", "Qwen/Qwen2.5-7B"),
        ("gemma-2-9b.json", "google/gemma-2-9b"),
        ("gemma-3-4b-it.json", "google/gemma-3-4b-pt"),
        ("phi-3-mini-4k-instruct.json", "microsoft/Phi-3-mini-4k-instruct"),
        ("mixtral-8x7b-v0.1.json", "mistralai/Mixtral-8x7B-v0.1"),
        ("qwen3-30b-a3b.json", "Qwen/Qwen3-30B-A3B"),
    ],
)
def test_fixture_file_matches_table(fixture: str, table_id: str) -> None:
    parsed = load_arch(str(FIXTURES / fixture))
    table = load_arch(table_id)
    assert parsed.total_params == table.total_params
    assert parsed.active_params == table.active_params
    assert parsed.linear_layers() == table.linear_layers()
    assert parsed.published_params is None


def test_config_from_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    shutil.copy(FIXTURES / "llama-3.1-8b.json", model_dir / "config.json")
    a = load_arch(str(model_dir))
    assert a.name == "my-llama"
    assert a.total_params == 8_030_261_248
    assert load_arch(f"file://{model_dir}").total_params == a.total_params
    assert load_arch(str(model_dir / "config.json")).total_params == a.total_params


def test_gemma3_nested_text_config_uses_class_defaults() -> None:
    a = arch_from_hf_config(_fixture("gemma-3-4b-it.json"), "google/gemma-3-4b-it")
    assert a.model_type == "gemma3_text"
    assert (a.num_layers, a.hidden_size, a.intermediate_size) == (34, 2560, 10240)
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (8, 4, 256)
    assert a.vocab_size == 262208
    assert a.tie_embeddings and a.qk_norm and a.norms_per_layer == 4
    assert a.max_position_embeddings == 131072


def test_gemma2_config_without_tie_flag_is_tied() -> None:
    cfg = _fixture("gemma-2-9b.json")
    assert "tie_word_embeddings" not in cfg
    assert arch_from_hf_config(cfg).tie_embeddings


# --------------------------------------------------------------------------- lookups


@pytest.mark.parametrize(
    "query",
    [
        "meta-llama/Llama-3.1-8B",
        "llama-3.1-8b",
        "LLAMA-3.1-8B",
        "hf://meta-llama/Llama-3.1-8B",
        "hf://meta-llama/Llama-3.1-8B@main",
        "https://huggingface.co/meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "  llama-3.1-8b  ",
    ],
)
def test_lookup_variants(query: str) -> None:
    assert load_arch(query).name == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B"),
        ("llama-2-7b", "meta-llama/Llama-2-7b-hf"),
        ("Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
        ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
        ("qwen3-8b-base", "Qwen/Qwen3-8B"),
        ("gemma-3-4b-it", "google/gemma-3-4b-pt"),
        ("google/gemma-2-9b-it", "google/gemma-2-9b"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1"),
        ("phi-3-mini-128k-instruct", "microsoft/Phi-3-mini-4k-instruct"),
        ("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct"),
    ],
)
def test_lookup_aliases(query: str, expected: str) -> None:
    assert load_arch(query).name == expected


def test_unknown_model_without_network_fails_with_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network must not be used")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(ArchitectureError) as exc:
        load_arch("acme/totally-unknown-model")
    message = str(exc.value)
    assert "To fix" in message
    assert "acme/totally-unknown-model" in message
    assert isinstance(exc.value, ValueError)


def test_unknown_model_suggests_close_matches() -> None:
    with pytest.raises(ArchitectureError, match=r"Did you mean: .*Llama-3\.1-8B"):
        load_arch("llama-3.1-8c")


class _FakeResponse(io.BytesIO):
    def __enter__(self) -> _FakeResponse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_unknown_model_is_fetched_when_network_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}
    body = (FIXTURES / "qwen2.5-7b-instruct.json").read_bytes()

    def fake_urlopen(request: urllib.request.Request, timeout: float) -> _FakeResponse:
        seen["url"] = request.full_url
        seen["auth"] = request.get_header("Authorization")
        seen["timeout"] = timeout
        return _FakeResponse(body)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    a = load_arch(
        "hf://acme/qwen-finetune", allow_network=True, timeout_s=2.5, token="t0k", revision="v1"
    )
    assert seen["url"] == "https://huggingface.co/acme/qwen-finetune/resolve/v1/config.json"
    assert seen["auth"] == "Bearer t0k"
    assert seen["timeout"] == 2.5
    assert a.name == "acme/qwen-finetune"
    assert a.total_params == load_arch("Qwen/Qwen2.5-7B").total_params


@pytest.mark.parametrize(
    ("error", "needle"),
    [
        (urllib.error.HTTPError("u", 401, "Unauthorized", Message(), None), "gated"),
        (urllib.error.HTTPError("u", 404, "Not Found", Message(), None), "no such model"),
        (urllib.error.URLError("connection refused"), "connection refused"),
        (TimeoutError("timed out"), "timed out"),
    ],
)
def test_network_failures_are_actionable(
    monkeypatch: pytest.MonkeyPatch, error: Exception, needle: str
) -> None:
    def failing_urlopen(request: urllib.request.Request, timeout: float) -> None:
        raise error

    monkeypatch.setattr(urllib.request, "urlopen", failing_urlopen)
    with pytest.raises(ArchitectureError) as exc:
        load_arch("acme/private-model", allow_network=True)
    assert needle in str(exc.value)
    assert "To fix" in str(exc.value)


def test_invalid_hub_id_is_rejected_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network must not be used")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(ArchitectureError, match="not a Hugging Face model id"):
        load_arch("hf://a/b/c?x=1", allow_network=True)


def test_pvc_uri_resolves_known_directory_name() -> None:
    a = load_arch("pvc://models/base/Llama-3.1-8B-Instruct")
    assert a.name == "pvc://models/base/Llama-3.1-8B-Instruct"
    assert a.total_params == load_arch("llama-3.1-8b").total_params


def test_pvc_uri_with_mounted_root(tmp_path: Path) -> None:
    model_dir = tmp_path / "claim" / "ckpt"
    model_dir.mkdir(parents=True)
    shutil.copy(FIXTURES / "phi-3-mini-4k-instruct.json", model_dir / "config.json")
    a = load_arch("pvc://claim/ckpt", pvc_root=tmp_path)
    assert a.model_type == "phi3"


def test_pvc_uri_unknown_fails_with_fix() -> None:
    with pytest.raises(ArchitectureError, match=r"To fix: set spec\.model\.architecture"):
        load_arch("pvc://models/my-private-model")
    with pytest.raises(ArchitectureError, match="To fix"):
        load_arch("s3://bucket/weights/custom")


# --------------------------------------------------------------------------- bad configs


def test_missing_field_message_names_field_and_source(tmp_path: Path) -> None:
    cfg = _fixture("llama-3.1-8b.json")
    del cfg["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(ArchitectureError) as exc:
        load_arch(str(path))
    message = str(exc.value)
    assert f"config.json at {path} lacks num_hidden_layers; To fix:" in message


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "t5"}, "model_type 't5'"),
        ({"model_type": None}, "lacks model_type"),
        ({"hidden_size": "4096"}, "expected an integer"),
        ({"hidden_size": 4096.5}, "expected an integer"),
        ({"tie_word_embeddings": "no"}, "expected true or false"),
        ({"num_key_value_heads": 7}, "not a multiple"),
        ({"intermediate_size": 0}, "must be positive"),
    ],
)
def test_bad_configs_raise_architecture_error(change: dict[str, object], needle: str) -> None:
    cfg = {**_fixture("llama-3.1-8b.json"), **change}
    with pytest.raises(ArchitectureError) as exc:
        arch_from_hf_config(cfg, "bad")
    assert needle in str(exc.value)
    assert "To fix" in str(exc.value)


def test_moe_config_errors() -> None:
    cfg = _fixture("qwen3-30b-a3b.json")
    with pytest.raises(ArchitectureError, match="exceeds num_experts"):
        arch_from_hf_config({**cfg, "num_experts_per_tok": 129})
    with pytest.raises(ArchitectureError, match="decoder_sparse_step"):
        arch_from_hf_config({**cfg, "decoder_sparse_step": 0})
    with pytest.raises(ArchitectureError, match="lacks moe_intermediate_size"):
        arch_from_hf_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ArchitectureError, match="does not exist"):
        load_arch(str(tmp_path / "nope" / "config.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArchitectureError, match=r"no config\.json"):
        load_arch(f"file://{tmp_path / 'empty'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ArchitectureError, match="not valid JSON"):
        load_arch(str(bad))
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ArchitectureError, match="not a JSON object"):
        load_arch(str(arr))


def test_empty_model_name() -> None:
    with pytest.raises(ArchitectureError, match="To fix"):
        load_arch("   ")


def test_docs_list_every_built_in_model() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
    text = doc.read_text(encoding="utf-8")
    missing = [name for name in known_models() if f"`{name}`" not in text]
    assert not missing, f"docs/architectures.md lacks rows for {missing}"


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("/" + "m" * 300, "cannot use"),
        ("~no-such-user-here/config.json", "cannot use"),
        ("/dev/zero", "not a regular file"),
    ],
)
def test_odd_paths_are_architecture_errors(model: str, needle: str) -> None:
    with pytest.raises(ArchitectureError, match=needle):
        load_arch(model)


def test_a_huge_file_is_not_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    big.write_bytes(b" " * (16 * 1024 * 1024 + 10))
    with pytest.raises(ArchitectureError, match="larger than 16 MiB"):
        load_arch(str(big))


def test_the_operator_does_not_read_its_own_files(tmp_path: Path) -> None:
    with pytest.raises(ArchitectureError, match=r"spec\.model\.architecture"):
        load_arch(str(tmp_path / "config.json"), local_files=False)
    assert load_arch("Qwen/Qwen2.5-0.5B", local_files=False).num_layers > 0
