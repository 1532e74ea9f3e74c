"""`ModelConfig` read from a Hugging Face config.json equals the config transformers builds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import assert_llama_config_matches
from transformers import GPT2Config, LlamaConfig

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES

ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


def saved(hf_config, tmp_path) -> ModelConfig:
    """Write the config as save_pretrained does and read it back."""
    hf_config.save_pretrained(tmp_path)
    return ModelConfig.from_json_file(tmp_path / "config.json", FAMILIES)


def hf_rope_scaling(hf: LlamaConfig) -> dict | None:
    """What transformers will apply: its rope parameters without the base, None when default."""
    params = {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    return None if params.get("rope_type", "default") == "default" else params


@pytest.mark.parametrize("rope_scaling", ROPE_SCALINGS, ids=lambda r: (r or {}).get("rope_type"))
def test_llama_config_matches_transformers(tmp_path, rope_scaling) -> None:
    hf = LlamaConfig(
        vocab_size=300,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=200,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=True,
        bos_token_id=5,
        eos_token_id=[6, 7],
    )
    ours = saved(hf, tmp_path)
    assert ours.architecture == "llama"
    assert_llama_config_matches(ours, hf)
    assert ours.rope_scaling == hf_rope_scaling(hf)
    assert ours.tie_word_embeddings is True
    assert (ours.bos_token_id, ours.eos_token_ids) == (5, (6, 7))
    assert ours.num_queries_per_kv == 3


@given(
    heads=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3), (8, 8)]),
    head_dim=st.sampled_from([8, 16, 32]),
    layers=st.integers(1, 40),
    explicit_head_dim=st.booleans(),
)
def test_llama_sizes_round_trip(tmp_path_factory, heads, head_dim, layers, explicit_head_dim):
    num_heads, num_kv = heads
    extra = {"head_dim": head_dim} if explicit_head_dim else {}
    hidden = num_heads * head_dim * (2 if explicit_head_dim else 1)
    if not explicit_head_dim:
        head_dim = hidden // num_heads
    hf = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv,
        intermediate_size=3 * hidden,
        **extra,
    )
    ours = saved(hf, tmp_path_factory.mktemp("cfg"))
    assert (ours.hidden_size, ours.num_layers) == (hf.hidden_size, hf.num_hidden_layers)
    assert (ours.num_heads, ours.num_kv_heads) == (num_heads, num_kv)
    assert ours.head_dim == hf.head_dim == head_dim


def test_older_config_spellings() -> None:
    """Before transformers 5: `rope_theta` at top level and `rope_scaling` with a `type` key."""
    cfg = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": 3,
    }
    ours = ModelConfig.from_hf_dict(cfg, FAMILIES)
    assert ours.rope_theta == 500000.0
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ours.num_kv_heads == 4 and ours.head_dim == 16
    assert ours.eos_token_ids == (3,) and not ours.tie_word_embeddings


@pytest.mark.parametrize("n_inner", [None, 100])
def test_gpt2_config_matches_transformers(tmp_path, n_inner) -> None:
    hf = GPT2Config(
        n_embd=48,
        n_layer=3,
        n_head=6,
        n_positions=128,
        vocab_size=500,
        n_inner=n_inner,
        layer_norm_epsilon=1e-6,
        bos_token_id=0,  # GPT-2's 50256 is not a token of this 500-token vocabulary
        eos_token_id=1,
    )
    ours = saved(hf, tmp_path)
    assert ours.architecture == "gpt2"
    assert (ours.hidden_size, ours.num_layers, ours.num_heads) == (48, 3, 6)
    assert ours.num_kv_heads == ours.num_heads and ours.head_dim == 8
    assert ours.intermediate_size == (n_inner or 4 * 48)
    assert ours.max_position_embeddings == hf.n_positions
    assert ours.vocab_size == hf.vocab_size
    assert ours.norm_eps == hf.layer_norm_epsilon
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.eos_token_ids == (hf.eos_token_id,)


# --------------------------------------------------------------------------------------------
# Bad configs.
# --------------------------------------------------------------------------------------------

VALID = dict(
    family=FAMILIES["llama"],
    vocab_size=10,
    hidden_size=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    max_position_embeddings=32,
)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"family": "bert"}, "family must be a FamilySpec, got 'bert'"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"num_layers": -1}, "num_layers must be a positive integer"),
        ({"vocab_size": 2.5}, "vocab_size must be a positive integer"),
        ({"max_position_embeddings": 2**40}, "max_position_embeddings must be a positive integer "
                                             "of at most 2**31 - 1"),
        ({"norm_eps": 0.0}, "must be positive"),
        ({"family": FAMILIES["gpt2"], "num_kv_heads": 2, "head_dim": 3}, "num_heads * head_dim"),
    ],
)
def test_invalid_config_values(change, words) -> None:
    ModelConfig(**VALID)  # the baseline is valid
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        ModelConfig(**(VALID | change))


def test_config_json_problems(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable config.json"):
        ModelConfig.from_json_file(path, FAMILIES)
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 3}))
    with pytest.raises(ValueError, match="lacks the required key 'num_attention_heads'"):
        ModelConfig.from_json_file(path, FAMILIES)
    path.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="unsupported model_type 't5'"):
        ModelConfig.from_json_file(path, FAMILIES)


# --------------------------------------------------------------------------------------------
# LLaMA's relatives: Mistral, Qwen2 / Qwen2.5, Qwen3.
# --------------------------------------------------------------------------------------------

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [("num_hidden_layers", "2", "int"), ("rope_scaling", 3, "object"),
     ("tie_word_embeddings", "yes", "bool"), ("eos_token_id", [1, "x"], "int or list of int"),
     ("rms_norm_eps", True, "number"), ("model_type", ["llama"], "string"),
     ("bos_token_id", 1.0, "int")],
)
def test_config_json_values_of_the_wrong_type_are_refused_naming_the_key(key, value, kind):
    cfg = {"model_type": "llama", **SMALL, key: value}
    with pytest.raises(ValueError, match=f"config.json: {key} must be {kind}, not"):
        ModelConfig.from_hf_dict(cfg, FAMILIES)
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ModelConfig.from_hf_dict([cfg], FAMILIES)


@pytest.mark.parametrize(
    ("model_type", "extra", "switches"),
    [
        ("qwen2", {}, dict(qkv_bias=True, o_bias=False, qk_norm=False)),
        ("qwen2", {"tie_word_embeddings": True}, dict(qkv_bias=True, o_bias=False, qk_norm=False)),
        ("qwen3", {"head_dim": 32}, dict(qkv_bias=False, o_bias=False, qk_norm=True)),
        ("qwen3", {"head_dim": 8, "attention_bias": True}, dict(qkv_bias=True, o_bias=True)),
        ("mistral", {"sliding_window": None}, dict(qkv_bias=False, o_bias=False, qk_norm=False)),
        ("llama", {"attention_bias": True}, dict(qkv_bias=True, o_bias=True, qk_norm=False)),
    ],
)
def test_family_config_matches_transformers(tmp_path, model_type, extra, switches) -> None:
    """Every family's config.json, as transformers writes it, reads as the same sizes, and sets
    the switches that family differs from LLaMA by."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(model_type, **(SMALL | extra))
    ours = saved(hf, tmp_path)
    assert ours.architecture == {"mistral": "llama"}.get(model_type, model_type)
    assert_llama_config_matches(ours, hf)
    for name, value in switches.items():
        assert getattr(ours, name) is value, name
    assert ours.sliding_window is None


def test_qwen_window_counts_only_when_used() -> None:
    """Qwen's configs name a `sliding_window` that applies only with `use_sliding_window`."""
    cfg = dict(model_type="qwen2", vocab_size=32, hidden_size=32, num_hidden_layers=1,
               num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
               sliding_window=16, use_sliding_window=False)
    assert ModelConfig.from_hf_dict(cfg, FAMILIES).max_position_embeddings == 128
    with pytest.warns(UserWarning, match="sliding_window 16"):
        used = ModelConfig.from_hf_dict(cfg | {"use_sliding_window": True}, FAMILIES)
    assert (used.sliding_window, used.max_position_embeddings) == (16, 16)


@pytest.mark.parametrize(("window", "context"), [(16, 64), (64, 64), (100, 64), (None, 64)])
def test_mistral_context_capped_to_its_window(tmp_path, window, context) -> None:
    """minipaged has no sliding-window attention: a Mistral whose window is shorter than its
    context is served up to the window, with a warning that says why; never past it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.MistralConfig(**(SMALL | {"max_position_embeddings": context}),
                                    sliding_window=window)
    if window is not None and window < context:
        with pytest.warns(UserWarning, match=f"sliding_window {window} < context length "
                                             f"{context}.*no sliding-window attention"):
            ours = saved(hf, tmp_path)
    else:
        ours = saved(hf, tmp_path)
    assert ours.sliding_window == window
    assert ours.max_position_embeddings == min(context, window or context)


def test_window_shorter_than_context_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"max_position_embeddings \(32\) exceeds sliding_window"):
        ModelConfig(**(VALID | {"sliding_window": 16}))
    assert ModelConfig(**(VALID | {"sliding_window": 32})).sliding_window == 32


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"eos_token_ids": (3, 10)}, "eos_token_id 10 is outside the vocabulary of 10 tokens"),
        ({"bos_token_id": -1}, "bos_token_id -1 is outside"),
        ({"pad_token_id": 99}, "pad_token_id 99 is outside"),
        ({"family": FAMILIES["gpt2"], "num_kv_heads": 2, "qk_norm": True}, "qk_norm"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ],
)
def test_invalid_family_values(change, words) -> None:
    with pytest.raises(ValueError, match=words):
        ModelConfig(**(VALID | change))


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        ({"model_type": "llama", "hidden_size": 50, "num_attention_heads": 4},
         "num_attention_heads 4 does not divide hidden_size 50"),
        ({"model_type": "gpt2", "n_embd": 30, "n_head": 4, "n_layer": 1, "n_positions": 8},
         "n_head 4 does not divide n_embd 30"),
        ({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4},
         "lacks the required key 'head_dim'"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ],
)
def test_head_size_problems(cfg, words) -> None:
    base = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 64}
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_hf_dict(base | cfg, FAMILIES)
