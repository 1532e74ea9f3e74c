"""Models with random weights for the GPU benchmarks, built in code: a GPU machine may have no
network, and a throughput benchmark needs real shapes, not trained weights.

* `QWEN3_0_6B`, `LLAMA3_8B`: the published models' configurations (`transformers` names);
  `TINY_QWEN3`, `TINY_LLAMA`: the same families at test size, for `--smoke` on a CPU.
* `build_hf`: a `transformers` model of a configuration, initialised on the device, or built on
  "meta" and filled on the device (an 8B model: no slow initialisation, no host copy).
* `save_folder`: the model as a Hugging Face folder (config.json + safetensors) with a stand-in
  byte-level tokenizer whose vocabulary covers every token id, so `minipaged.LLM(folder)` loads
  it like any checkpoint and can turn any generated id into text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Qwen/Qwen3-0.6B's config.json (the fields that shape the model).
QWEN3_0_6B: dict[str, Any] = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# meta-llama/Meta-Llama-3-8B's.
LLAMA3_8B: dict[str, Any] = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# Test-size models of both families (head_dim unlike hidden / heads, as Qwen3's).
TINY_QWEN3: dict[str, Any] = dict(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=256, tie_word_embeddings=True,
)
TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=False,
)


def build_hf(config: dict[str, Any], device: str, dtype: torch.dtype, on_meta: bool = False):
    """A `transformers` causal LM of `config` on `device`, in eval mode, seeded.

    `on_meta`: built without storage, then given uninitialised storage on the device
    (`to_empty`) and filled there: normal(0, 0.02) matrices and unit norms, as an initialisation
    would, without its cost."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    if not on_meta:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)  # the norms' scales
            else:
                parameter.normal_(0.0, 0.02)
    return model.eval()


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights, a tied matrix once: what a decode step reads of them."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def save_folder(model, folder: Path) -> Path:
    """`model` as a Hugging Face folder with a stand-in tokenizer; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, model.config.vocab_size)
    return folder


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json: the 256 bytes, then "t<id>" for every other id up to
    `vocab_size`, no merges. Text encodes to bytes; every id the model can emit decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(alphabet)}
    vocab |= {f"t{i}": i for i in range(len(vocab), vocab_size)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
