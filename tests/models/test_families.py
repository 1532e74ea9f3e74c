"""A model family is one declaration and one registry entry.

Every family of `FAMILIES` is filed under its own architecture and claims its own config.json
model types. A made-up family, declared here and nowhere else (a LLaMA variant under a new
model type whose final norm is renamed `final_norm`), loads from a random safetensors
checkpoint through the ordinary `load_model`, given as one more entry of the registry: no module
of minipaged names it, so this file proves adding a family touches one file and one entry.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from minipaged.models.checkpoint.loader import load_checkpoint
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.checkpoint.weight_names import CheckpointError, expected_shapes
from minipaged.models.layers import CausalLM
from minipaged.models.llama import LLAMA, LlamaForCausalLM, llama_shapes
from minipaged.models.registry import FAMILIES, build_model, load_model
from minipaged.models.tensor_parallel import SINGLE_RANK, TensorParallel, shard_state_dict
from minipaged.testing.dense import generate_dense

# -- the made-up family: everything it is, in this module ------------------------------------


class FinalNormLlamaForCausalLM(LlamaForCausalLM):
    """LLaMA whose final norm is held as `final_norm` (Hugging Face: `model.final_norm.weight`)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__(config, tp)
        self.final_norm = self.get_submodule("norm")
        delattr(self, "norm")

    @property
    def norm(self) -> torch.nn.Module:  # what LLaMA's forward pass calls
        return self.final_norm


def final_norm_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """LLaMA's table with the final norm renamed."""
    renamed = {"model.norm.weight": "model.final_norm.weight"}
    return {renamed.get(name, name): shape for name, shape in llama_shapes(config).items()}


FINAL_NORM = dataclasses.replace(
    LLAMA,
    architecture="final-norm-llama",
    hf_model_types=("final-norm-llama",),
    shapes=final_norm_shapes,
    gguf_architecture=None,  # no GGUF files of it exist
    from_gguf=None,
    model_class=FinalNormLlamaForCausalLM,
)
WITH_FINAL_NORM = FAMILIES | {FINAL_NORM.architecture: FINAL_NORM}

CONFIG_JSON = {
    "model_type": "final-norm-llama", "vocab_size": 61, "hidden_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 24, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture
def checkpoint(tmp_path):
    """A random checkpoint of the made-up family, as a Hugging Face folder."""
    config = ModelConfig.from_hf_dict(CONFIG_JSON, WITH_FINAL_NORM)
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=generator) * (0.3 if len(shape) == 2 else 1.0)
        for name, shape in expected_shapes(config).items()
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_JSON))
    return tmp_path, state


# -- the registry --------------------------------------------------------------------------------


def test_each_family_is_filed_under_its_architecture_and_owns_its_model_types():
    assert all(key == family.architecture for key, family in FAMILIES.items())
    claimed = [t for family in FAMILIES.values() for t in family.hf_model_types]
    assert len(claimed) == len(set(claimed)), claimed
    gguf = [f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture is not None]
    assert len(gguf) == len(set(gguf)), gguf
    for family in FAMILIES.values():
        assert issubclass(family.model_class, CausalLM), family


# -- the made-up family ------------------------------------------------------------------------


def test_a_family_declared_in_one_file_loads_and_runs_as_the_llama_it_renames(checkpoint):
    folder, state = checkpoint
    model, config = load_model(folder, progress=False, families=WITH_FINAL_NORM)
    assert config.family is FINAL_NORM and isinstance(model, FinalNormLlamaForCausalLM)
    assert torch.equal(model.final_norm.weight, state["model.final_norm.weight"])
    assert "final_norm.weight" in dict(model.named_parameters())
    # The same weights under LLaMA's own name make a LLaMA that generates the same tokens.
    llama_config = dataclasses.replace(config, family=LLAMA)
    renamed = {n.replace("final_norm", "norm"): w for n, w in state.items()}
    llama = build_model(llama_config, renamed)
    prompts = [[3, 14, 15, 9, 2], [6, 5]]
    assert generate_dense(model, prompts, 6) == generate_dense(llama, prompts, 6)


def test_the_made_up_family_shards_by_its_declared_splits(checkpoint):
    """Its tensor-parallel splits come with it (LLaMA's, by pattern), renamed weight and all."""
    folder, state = checkpoint
    config, loaded = load_checkpoint(folder, WITH_FINAL_NORM, progress=False)
    shard = shard_state_dict(config, loaded, TensorParallel(rank=1, world_size=2))
    assert torch.equal(shard["model.final_norm.weight"], state["model.final_norm.weight"])
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(shard["model.layers.0.self_attn.q_proj.weight"], q[q.shape[0] // 2 :])


def test_without_its_entry_the_registry_refuses_it_by_name(checkpoint):
    folder, _ = checkpoint
    assert FINAL_NORM.architecture not in FAMILIES
    with pytest.raises(CheckpointError, match="unsupported model_type 'final-norm-llama'"):
        load_model(folder, progress=False)


def test_a_checkpoint_with_the_llama_name_is_not_the_made_up_family(checkpoint):
    """The family's table is the one checked: LLaMA's `model.norm.weight` is unexpected."""
    folder, state = checkpoint
    state = {n.replace("final_norm", "norm"): w for n, w in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.final_norm.weight missing"):
        load_model(folder, progress=False, families=WITH_FINAL_NORM)
