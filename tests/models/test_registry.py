"""The from-scratch models against Hugging Face `transformers`, and the dense generation oracle.

* Tiny random LLaMA (GQA ratios 1, 3, 4; tied and untied heads; rope theta; linear and llama3
  scaling), GPT-2, Qwen2, Qwen3 (head_dim != hidden / heads) and Mistral models, saved as
  safetensors (one file or shards) and loaded back: logits equal `transformers`' on random flat
  batches of several sequences, and the engine's greedy batches equal `generate`.
* A Mistral whose sliding window is shorter than its context is served only up to the window.
* The bundled SmolLM2 GGUF: first-step logits and 32 greedy tokens for several chat prompts equal
  `transformers` loading the same file.
* Decoding step by step through the cache equals recomputing the whole sequence each step.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from tiny_models import random_gpt2, random_hf, random_llama  # noqa: E402

from minipaged.attention.contract import dense_attention  # noqa: E402
from minipaged.engine.config import EngineConfig  # noqa: E402
from minipaged.engine.engine import LLMEngine  # noqa: E402
from minipaged.models.checkpoint.loader import load_checkpoint  # noqa: E402
from minipaged.models.checkpoint.model_config import ModelConfig  # noqa: E402
from minipaged.models.checkpoint.weight_names import expected_shapes, is_transposed, to_module_name  # noqa: E402
from minipaged.models.layers import (  # noqa: E402
    ModelInputError,
    rope_inverse_frequencies,
)
from minipaged.models.registry import (  # noqa: E402
    FAMILIES,
    CheckpointMismatchError,
    build_model,
)
from minipaged.sampling.params import SamplingParams  # noqa: E402
from minipaged.sched.base import RequestRejectedError  # noqa: E402
from minipaged.testing.dense import (  # noqa: E402
    DenseAttentionBackend,
    DenseKVCache,
    decode_attention,
    generate_dense,
)

VOCAB = 97

LLAMA_CASES = {
    # name: (num_heads, num_kv_heads, head_dim, tied, rope_theta, rope_scaling)
    "mha-tied": (4, 4, 8, True, 10000.0, None),
    "gqa3-untied-theta": (6, 2, 8, False, 500.0, None),
    "gqa4-linear": (8, 2, 4, False, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "gqa3-llama3": (
        6, 2, 16, True, 500000.0,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
}
GPT2_CASES = {
    # name: (n_embd, n_head, n_inner)
    "gpt2-4heads": (32, 4, None),
    "gpt2-2heads-inner": (24, 2, 40),
}
FAMILY_CASES = {
    # name: (model_type, config beyond the shared sizes (hidden 48), saved in shards)
    "qwen2-gqa3-tied": (
        "qwen2", dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
        False,
    ),
    "qwen2-mha-untied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=4), True),
    # Qwen3's heads are not hidden / heads wide: 4 x 16 = 64 != 48, and 6 x 4 = 24.
    "qwen3-gqa2-hd16-tied": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
             tie_word_embeddings=True),
        True,
    ),
    "qwen3-mha-hd4-untied": (
        "qwen3", dict(num_attention_heads=6, num_key_value_heads=6, head_dim=4), False
    ),
    "mistral-gqa4-hd12": (
        "mistral",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, sliding_window=4096),
        True,
    ),
    "mistral-mha-tied": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
             tie_word_embeddings=True),
        False,
    ),
}
# What every family case shares; wide weights keep greedy choices clear of near-ties.
FAMILY_SIZES = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    initializer_range=0.3,
)


def _make_hf(name: str):
    """A random-init `transformers` model for a case name (seeded, so the same every time)."""
    seed = sum(map(ord, name))
    if name in LLAMA_CASES:
        heads, kv_heads, head_dim, tied, theta, scaling = LLAMA_CASES[name]
        model = random_llama(
            seed, vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=64, rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        )
    elif name in GPT2_CASES:
        n_embd, n_head, n_inner = GPT2_CASES[name]
        model = random_gpt2(
            seed, vocab_size=VOCAB, n_embd=n_embd, n_layer=2, n_head=n_head, n_inner=n_inner,
            n_positions=64, bos_token_id=1, eos_token_id=2,
        )
    else:
        model_type, config, _ = FAMILY_CASES[name]
        model = random_hf(model_type, seed, **(FAMILY_SIZES | config))
    # Random init leaves norms at 1 and biases at 0: perturb them so a mix-up would show.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@functools.cache
def _pair(name: str, tmp_root: str):
    """(transformers model, minipaged model) for a case, through a safetensors round trip."""
    hf = _make_hf(name)
    folder = Path(tmp_root) / name
    sharded = name in FAMILY_CASES and FAMILY_CASES[name][2]
    hf.save_pretrained(folder, max_shard_size="20KB" if sharded else "1GB")
    assert (folder / "model.safetensors.index.json").exists() == sharded
    config, state_dict = load_checkpoint(folder, FAMILIES, progress=False)
    return hf, build_model(config, state_dict)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_models"))


def _flat_forward(model, seqs: list[list[int]]) -> torch.Tensor:
    """Logits of every token of `seqs`, run as one flat batch through a fresh dense cache."""
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    backend = DenseAttentionBackend(DenseKVCache(model.config.num_layers), range(len(seqs)),
                                    [len(s) for s in seqs])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, backend))


token_seqs = st.lists(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=3
)


@pytest.mark.parametrize("name", [*LLAMA_CASES, *GPT2_CASES, *FAMILY_CASES])
@settings(max_examples=8)
@given(seqs=token_seqs)
def test_logits_equal_transformers(name, tmp_root, seqs):
    hf, model = _pair(name, tmp_root)
    ours = _flat_forward(model, seqs)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["gqa3-llama3", "gpt2-4heads"])
@settings(max_examples=5)
@given(data=st.data())
def test_incremental_decoding_equals_recomputation(name, tmp_root, data):
    """Feed a sequence in random chunks through one cache; every chunk's logits equal a fresh
    full forward over the prefix so far. Two other sequences share each step's flat batch."""
    _, model = _pair(name, tmp_root)
    seq = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=24), label="seq")
    other = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=24, max_size=24),
                      label="other")
    cache = DenseKVCache(model.config.num_layers)
    done = 0
    while done < len(seq):
        n = data.draw(st.integers(1, len(seq) - done), label="chunk")
        # Sequence 0 gets n new tokens, sequence 1 gets one token of `other` per step.
        ids = torch.tensor(seq[done:done + n] + [other[cache.length(1)]])
        positions = torch.tensor(list(range(done, done + n)) + [cache.length(1)])
        with torch.inference_mode():
            hidden = model(ids, positions, DenseAttentionBackend(cache, [0, 1], [n, 1]))
            step_logits = model.compute_logits(hidden)
        done += n
        full = _flat_forward(model, [seq[:done]])
        assert torch.allclose(step_logits[:n], full[-n:], atol=1e-5, rtol=0)
        other_full = _flat_forward(model, [other[:cache.length(1)]])
        assert torch.allclose(step_logits[n], other_full[-1], atol=1e-5, rtol=0)


def _padded(contexts: list[torch.Tensor], width: int, gen: torch.Generator) -> torch.Tensor:
    """Contexts `[L_i, H_kv, D]` as rows of one `[B, H_kv, width, D]` tensor, padded with large
    random numbers (not zeros), so that attending a padding slot would show."""
    out = 100 * torch.randn(len(contexts), contexts[0].shape[1], width, contexts[0].shape[2],
                            generator=gen)
    for i, c in enumerate(contexts):
        out[i, :, :c.shape[0]] = c.transpose(0, 1)
    return out


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    extra=st.integers(0, 5),
    heads=st.sampled_from([(4, 4), (6, 2), (8, 2), (3, 1)]),
    seed=st.integers(0, 2**16),
)
def test_batched_decode_equals_per_sequence_oracle(lengths, extra, heads, seed):
    """A decode step's one-batch attention (each context a row, masked past its length) equals
    the oracle, `dense_attention`, run on each sequence alone; so does the backend that chooses
    it, with its contexts in the cache and the new tokens written in place."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, num_kv_heads, 8, generator=gen) for n in lengths]
    values = [torch.randn(n, num_kv_heads, 8, generator=gen) for n in lengths]
    q = torch.randn(len(lengths), num_heads, 8, generator=gen)
    expected = torch.cat([dense_attention(q[i:i + 1], keys[i], values[i], 0.3)
                          for i in range(len(lengths))])
    width = max(lengths) + extra
    got = decode_attention(q, _padded(keys, width, gen), _padded(values, width, gen),
                           torch.tensor(lengths), 0.3)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)

    # Through the backend: cache all but each sequence's last token, then one decode step.
    cache = DenseKVCache(num_layers=1)
    seq_ids = list(range(len(lengths)))
    for i in seq_ids:
        cache.append(i, 0, keys[i][:-1], values[i][:-1])
    backend = DenseAttentionBackend(cache, seq_ids, [1] * len(lengths))
    out = backend(0, q, torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values]),
                  0.3)
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)
    assert [cache.length(i) for i in seq_ids] == lengths


@pytest.mark.parametrize(
    ("scaling", "words"),
    [({"rope_type": "linear"}, "'linear' needs a positive number factor, got None"),
     ({"rope_type": "linear", "factor": "2"}, "positive number factor, got '2'"),
     ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 64}, "positive number low_freq_factor"),
     ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 64}, "high_freq_factor (4.0) above low_freq_factor"),
     ({"rope_type": "yarn", "factor": 2.0}, "unsupported rope scaling 'yarn'")],
)
def test_rope_scaling_without_its_numbers_is_refused_naming_them(scaling, words):
    config = ModelConfig(family=FAMILIES["llama"], vocab_size=64, hidden_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64,
                         max_position_embeddings=64, rope_scaling=scaling)
    with pytest.raises(ValueError, match=re.escape(words)):
        rope_inverse_frequencies(config)


def test_decode_attention_rejects_mismatched_batch():
    q = torch.randn(2, 4, 8)
    kv = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="2 queries but 1 keys"):
        decode_attention(q, kv, kv, torch.tensor([3]), 1.0)


@settings(max_examples=30)
@given(data=st.data())
def test_dense_cache_steps_equal_attention_over_kept_contexts(data):
    """Random steps through one cache that starts small, so that its rows and capacity must
    grow: new sequences (arbitrary ids) arrive with a prompt chunk, live ones get a chunk or one
    token (all-one-token steps take the batched decode path), finished ones are freed and their
    rows reused, leaving holes. Every step's output equals `dense_attention` over each
    sequence's whole context, kept aside as a plain list of the K/V handed to the backend."""
    num_layers, num_heads, num_kv_heads, head_dim = 2, 4, 2, 8
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    cache = DenseKVCache(num_layers, max_seq_len=data.draw(st.integers(0, 4), label="len hint"),
                         max_num_seqs=data.draw(st.integers(0, 2), label="rows hint"))
    kept: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
    ids = iter(range(1000, 0, -7))
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(kept)), unique=True), label="live") \
            if kept else []
        seq_ids += [next(ids) for _ in range(data.draw(st.integers(0 if seq_ids else 1, 3)))]
        seq_ids = data.draw(st.permutations(seq_ids), label="order")
        decode = data.draw(st.booleans(), label="decode step")
        lens = [1 if decode else data.draw(st.integers(1, 5)) for _ in seq_ids]
        backend = DenseAttentionBackend(cache, seq_ids, lens)
        for layer in range(num_layers):
            q = torch.randn(sum(lens), num_heads, head_dim, generator=gen)
            k = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
            v = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
            out = backend(layer, q, k, v, 0.5)
            start = 0
            for seq_id, n in zip(seq_ids, lens, strict=True):
                ks, vs = kept.setdefault(seq_id, [([], []) for _ in range(num_layers)])[layer]
                ks.append(k[start:start + n])
                vs.append(v[start:start + n])
                expected = dense_attention(q[start:start + n], torch.cat(ks), torch.cat(vs), 0.5)
                assert torch.allclose(out[start:start + n], expected, atol=1e-5, rtol=0)
                start += n
        for seq_id in seq_ids:
            assert cache.length(seq_id) == sum(len(c) for c in kept[seq_id][0][0])
        for seq_id in data.draw(st.lists(st.sampled_from(sorted(kept)), unique=True),
                                label="freed"):
            cache.free(seq_id)
            del kept[seq_id]
            assert cache.length(seq_id) == 0
    assert len(cache.row_of) == len(kept)


def test_dense_cache_reserves_the_hinted_maximum_and_doubles_past_it():
    cache = DenseKVCache(1, max_seq_len=10, max_num_seqs=3)
    k = torch.randn(4, 2, 8)
    cache.append(7, 0, k, k)
    assert tuple(cache.keys[0].shape) == (3, 2, 10, 8)  # every row reserved up front
    cache.append(7, 0, k, k)
    cache.append(7, 0, k, k)  # 12 tokens: capacity 10 doubles
    assert tuple(cache.keys[0].shape) == (3, 2, 20, 8)
    for seq_id in (1, 2, 3):  # a fourth sequence: the rows double
        cache.append(seq_id, 0, k[:1], k[:1])
    assert tuple(cache.keys[0].shape) == (6, 2, 20, 8)
    keys, _ = cache.append(7, 0, k[:1], k[:1])
    assert torch.equal(keys, torch.cat([k, k, k, k[:1]]))
    cache.free(1)
    cache.append(9, 0, k[:2], k[:2])
    assert cache.row_of[9] == 1 and cache.length(9) == 2  # the freed row, lowest first


def test_dense_backend_rejects_bad_steps():
    with pytest.raises(ValueError, match="twice"):
        DenseAttentionBackend(DenseKVCache(1), [3, 3], [1, 1])
    with pytest.raises(ValueError, match="at least one new token"):
        DenseAttentionBackend(DenseKVCache(1), [3], [0])
    with pytest.raises(ValueError, match="capacity hints"):
        DenseKVCache(1, max_seq_len=-1)
    backend = DenseAttentionBackend(DenseKVCache(1), [0, 1], [1, 1])
    with pytest.raises(ValueError, match="3 query tokens but query_lens sum to 2"):
        backend(0, torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), 1.0)


def _greedy_by_recomputation(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy decoding with no cache at all: the whole sequence is recomputed for each token."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_new:
        token = int(_flat_forward(model, [tokens])[-1].argmax())
        out.append(token)
        tokens.append(token)
        if token in eos:
            break
    return out


@pytest.mark.parametrize("name", ["gqa4-linear", "gpt2-2heads-inner"])
@settings(max_examples=5)
@given(
    prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
                     min_size=1, max_size=3),
    max_new=st.integers(0, 6),
    eos=st.sets(st.integers(0, VOCAB - 1), max_size=20),
)
def test_generate_dense_equals_recomputation(name, tmp_root, prompts, max_new, eos):
    _, model = _pair(name, tmp_root)
    got = generate_dense(model, prompts, max_new, eos_token_ids=eos)
    assert got == [_greedy_by_recomputation(model, p, max_new, eos) for p in prompts]


def test_generate_dense_equals_transformers_generate(tmp_root):
    hf, model = _pair("gqa3-untied-theta", tmp_root)
    prompt = [5, 17, 33, 4, 80, 61]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert generate_dense(model, [prompt], 12) == [ref[0, len(prompt):].tolist()]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_is_close_to_float32(tmp_root, dtype, tol):
    hf, model32 = _pair("gqa3-untied-theta", tmp_root)
    config_json = Path(tmp_root) / "gqa3-untied-theta" / "config.json"
    config = ModelConfig.from_json_file(config_json, FAMILIES)
    model = build_model(config, hf.state_dict(), dtype=dtype)
    assert model.embed_tokens.weight.dtype == dtype
    seqs = [[3, 9, 27, 81, 50], [7, 7]]
    assert (_flat_forward(model, seqs) - _flat_forward(model32, seqs)).abs().max() < tol


def test_tied_head_shares_the_embedding(tmp_root):
    _, tied = _pair("mha-tied", tmp_root)
    _, untied = _pair("gqa3-untied-theta", tmp_root)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_gpt2_accepts_names_without_prefix(tmp_root):
    hf, model = _pair("gpt2-4heads", tmp_root)
    bare = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_dict(hf.config.to_dict(), FAMILIES)
    seqs = [[1, 2, 3, 4]]
    assert torch.equal(_flat_forward(build_model(config, bare), seqs), _flat_forward(model, seqs))


def test_bad_state_dict_names_the_tensor(tmp_root):
    hf, _ = _pair("gqa3-untied-theta", tmp_root)
    config = ModelConfig.from_hf_dict(hf.config.to_dict(), FAMILIES)
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointMismatchError, match="layers.1.mlp.up_proj.weight"):
        build_model(config, sd)
    sd = dict(hf.state_dict())
    sd["model.norm.weight"] = torch.ones(7)
    with pytest.raises(CheckpointMismatchError, match="norm.weight: expected"):
        build_model(config, sd)


def test_bad_inputs_raise(tmp_root):
    _, model = _pair("gpt2-4heads", tmp_root)
    backend = DenseAttentionBackend(DenseKVCache(2), [0], [1])
    with pytest.raises(ModelInputError, match="position"):
        model(torch.tensor([1]), torch.tensor([64]), backend)
    with pytest.raises(ModelInputError, match="token id"):
        model(torch.tensor([VOCAB]), torch.tensor([0]), backend)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_dense(model, [[1], []], 4)
    with pytest.raises(ValueError, match="exceeds"):
        generate_dense(model, [[1] * 60], 5)


# ---------------------------------------------------------------------------------------------
# LLaMA's relatives (Qwen2, Qwen3, Mistral) through the engine
# ---------------------------------------------------------------------------------------------


def _hf_generate(hf, prompt: list[int], max_new: int, min_new: int, eos: int) -> list[int]:
    """`transformers`' greedy `generate` of one prompt: its new tokens, EOS included."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("min_tokens", [4, 10])
@pytest.mark.parametrize("name", sorted(FAMILY_CASES))
def test_engine_greedy_equals_transformers_generate(name, tmp_root, min_tokens):
    """Several prompts as one engine batch, token for token what `generate` gives each alone.
    The end-of-sequence token is one that some prompt's continuation first produces after its
    4th token, so with `min_tokens` 4 (both sides mask EOS until then: `min_tokens` here,
    `min_new_tokens` there) that prompt stops early, and with 10 it runs to the end."""
    hf, model = _pair(name, tmp_root)
    prompts = [[5, 17, 33, 4, 80, 61], [9, 3], [44, 12, 90, 7, 7, 7, 21, 60, 3, 11, 50], [88]]
    free = generate_dense(model, prompts, 10)
    first, eos = next((i, t) for i, out in enumerate(free) for t in out[4:9] if t not in out[:4])
    expected = [_hf_generate(hf, p, 10, min_tokens, eos) for p in prompts]
    engine = LLMEngine(model, dataclasses.replace(model.config, eos_token_ids=(eos,)), None,
                       EngineConfig(num_gpu_blocks=32, num_cpu_blocks=0, block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=min_tokens)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert (len(expected[first]) < 10) == (min_tokens < 10)


def test_mistral_window_caps_the_context(tmp_path):
    """A Mistral whose sliding window (16) is shorter than its context (64) is served up to the
    window: there its attention is exactly transformers' sliding-window attention, and past it
    (where transformers attends differently) the model, the engine and its scheduler refuse."""
    hf = random_hf("mistral", 7, **(FAMILY_SIZES | dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)))
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="sliding_window 16 < context length 64"):
        config, state = load_checkpoint(tmp_path, FAMILIES, progress=False)
    assert (config.sliding_window, config.max_position_embeddings) == (16, 16)
    model = build_model(config, state)
    seq = [(7 * i + 3) % VOCAB for i in range(24)]
    with torch.no_grad():
        windowed = hf(torch.tensor([seq])).logits[0]
        hf.config.sliding_window = None
        full = hf(torch.tensor([seq])).logits[0]
    assert (windowed[16:] - full[16:]).abs().max() > 1e-3  # past the window, the two differ
    assert (_flat_forward(model, [seq[:16]]) - windowed[:16]).abs().max() <= 1e-4
    with pytest.raises(ModelInputError, match="position"):
        model(torch.tensor([1]), torch.tensor([16]), DenseAttentionBackend(DenseKVCache(2), [0],
                                                                           [1]))
    engine = LLMEngine(model, config, None, EngineConfig(num_gpu_blocks=16, block_size=4))
    assert engine.max_model_len == 16
    with pytest.raises(RequestRejectedError, match="context of 16 tokens"):
        engine.add_request(None, seq[:16], SamplingParams(max_tokens=1))
    request = engine.add_request(None, seq[:12], SamplingParams(temperature=0.0, max_tokens=10,
                                                                 ignore_eos=True))
    out = engine.run_until_done()[request].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4  # 12 + 4 = the window
    assert out.token_ids == generate_dense(model, [seq[:12]], 4)[0]


def test_weight_table_names_the_modules_parameters():
    """The table of names and shapes each family declares (`FamilySpec.shapes`) is exactly what
    its modules hold, for every switch: biases, q/k norms, head sizes, tied and untied
    heads."""
    base = dict(vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=4, intermediate_size=12, max_position_embeddings=16)
    configs = [
        ModelConfig(family=FAMILIES["llama"], **base),
        ModelConfig(family=FAMILIES["llama"], **base, qkv_bias=True, o_bias=True),
        ModelConfig(family=FAMILIES["qwen2"], **base, qkv_bias=True, tie_word_embeddings=True),
        ModelConfig(family=FAMILIES["qwen3"], **(base | dict(head_dim=6)), qk_norm=True),
        ModelConfig(family=FAMILIES["gpt2"], **(base | dict(num_kv_heads=2))),
        ModelConfig(family=FAMILIES["gpt2"], **(base | dict(num_kv_heads=2)),
                    tie_word_embeddings=False),
    ]
    for config in configs:
        with torch.device("meta"):
            model = config.family.model_class(config)
        held = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if config.tie_word_embeddings:
            del held["lm_head.weight"]
        table = {
            to_module_name(config, name): shape[::-1] if is_transposed(config, name) else shape
            for name, shape in expected_shapes(config).items()
        }
        assert table == held, config


# ---------------------------------------------------------------------------------------------
# The bundled SmolLM2 GGUF
# ---------------------------------------------------------------------------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain gravity in one sentence.",
    "Name three primary colors.",
]


def _chat_ids(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}],
                                   add_generation_prompt=True, tokenize=True)


def test_smollm2_first_step_logits(bundled_hf_model, bundled_tokenizer, bundled_model):
    """minipaged dequantises the GGUF with `minipaged.models.checkpoint.loader`, transformers on its
    own."""
    hf, tok, (model, _) = bundled_hf_model, bundled_tokenizer, bundled_model
    seqs = [_chat_ids(tok, p) for p in CHAT_PROMPTS[:2]]
    ours = _flat_forward(model, seqs)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert (ours - ref).abs().max().item() <= 1e-3


def test_smollm2_greedy_tokens_equal_transformers(
    bundled_hf_model, bundled_tokenizer, bundled_model
):
    hf, tok, (model, config) = bundled_hf_model, bundled_tokenizer, bundled_model
    prompts = [_chat_ids(tok, p) for p in CHAT_PROMPTS]
    ours = generate_dense(model, prompts, 32, eos_token_ids=config.eos_token_ids)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                          eos_token_id=list(config.eos_token_ids), pad_token_id=0)
    for got, row in zip(ours, ref[:, width:].tolist(), strict=True):
        assert got == row[:len(got)]
        assert len(got) == 32 or got[-1] in config.eos_token_ids
    assert tok.decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."
