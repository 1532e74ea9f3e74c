"""`lay_out_weights`: a CPU model's weights in one buffer.

After the layout every parameter and int8 weight of a model lies in one storage, back to back in
module registration order, each on a cache line (whatever alignment the checkpoint's tensors
had), holding the values it held; ties stay one object; the model computes what it computed;
modules hold new weight objects. Models loaded by the CPU platform come laid out, int8 ones
without keeping the float buffer alive; a laid-out model's checkpoint state dict (what tensor
parallelism pickles to its ranks) holds copies, not views of the buffer.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import dense_last_logits, random_llama, tiny_llama_parts

from minipaged.kernels.cpu.gemv import Int8Weight
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES, build_model
from minipaged.models.tensor_parallel import checkpoint_state_dict
from minipaged.platforms.cpu import CPUPlatform
from minipaged.platforms.cpu.weight_layout import ALIGNMENT, lay_out_weights


def held_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and int8 weight's values and scales, in module
    registration order, each object once."""
    seen, out = set(), []
    for module_name, module in model.named_modules():
        values = [(n, p) for n, p in module.named_parameters(recurse=False)]
        values += [(n, v) for n, v in vars(module).items() if isinstance(v, Int8Weight)]
        for name, value in values:
            if id(value) in seen:
                continue
            seen.add(id(value))
            parts = ([("data", value.data), ("scales", value.scales)]
                     if isinstance(value, Int8Weight) else [("", value)])
            out += [(f"{module_name}.{name}.{part}", t) for part, t in parts]
    return out


def assert_laid_out(model: torch.nn.Module) -> None:
    """One storage; tensors back to back in registration order, each on a cache line."""
    tensors = held_tensors(model)
    assert len({t.untyped_storage().data_ptr() for _, t in tensors}) == 1
    end = None
    for name, tensor in tensors:
        assert tensor.data_ptr() % ALIGNMENT == 0, name
        assert tensor.is_contiguous(), name
        if end is not None:  # right after the one before, up to the cache-line padding
            assert 0 <= tensor.data_ptr() - end < ALIGNMENT, name
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()


@settings(max_examples=10, deadline=None)
@given(tied=st.booleans(), bias=st.booleans(), dtype=st.sampled_from([torch.float32,
                                                                      torch.bfloat16]))
def test_a_laid_out_model_holds_the_same_values_in_one_buffer(tied, bias, dtype):
    model, _ = tiny_llama_parts(tie_word_embeddings=tied, attention_bias=bias)
    model = model.to(dtype)
    before = {name: t.clone() for name, t in held_tensors(model)}
    old_objects = {name: id(p) for name, p in model.named_parameters()}
    size = lay_out_weights(model)
    assert_laid_out(model)
    after = dict(held_tensors(model))
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert size >= sum(t.numel() * t.element_size() for t in before.values())
    assert (model.lm_head.weight is model.input_embedding().weight) == tied
    for name, p in model.named_parameters():
        assert id(p) != old_objects[name], name  # new objects, views of the buffer


def test_loaded_models_come_laid_out_and_compute_what_they_did():
    model, _ = tiny_llama_parts(tie_word_embeddings=False)
    separate = copy.deepcopy(model)  # a deep copy allocates each tensor on its own
    assert len({p.untyped_storage().data_ptr() for p in separate.parameters()}) > 1
    tokens = [3, 17, 42, 9, 11]
    reference = dense_last_logits(separate, tokens)
    lay_out_weights(separate)
    assert torch.equal(dense_last_logits(separate, tokens), reference)
    CPUPlatform(torch.device("cpu"), gemv_rows=0).load(model)  # the C modules, no GEMV
    assert_laid_out(model)
    torch.testing.assert_close(dense_last_logits(model, tokens), reference, atol=1e-5,
                               rtol=1e-5)


def test_every_weight_starts_on_a_cache_line_whatever_the_checkpoint_gave():
    """Tensors made from NumPy arrays (the GGUF reader's) start on 16 bytes; loaded, every
    weight starts on a cache line, values alike."""
    import numpy as np

    hf = random_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    config = ModelConfig.from_hf_dict(hf.config.to_dict(), FAMILIES)
    state = {}
    for i, (name, tensor) in enumerate(hf.state_dict().items()):
        buffer = np.empty(tensor.numel() + 16, dtype=np.float32)  # start 4 + 4i bytes later
        array = buffer[1 + i % 15:1 + i % 15 + tensor.numel()].reshape(tuple(tensor.shape))
        array[...] = tensor.numpy()
        state[name] = torch.from_numpy(array)
    assert any(t.data_ptr() % ALIGNMENT for t in state.values())
    model = CPUPlatform(torch.device("cpu"), gemv_rows=8).load(build_model(config, state))
    for name, param in model.named_parameters():
        assert param.data_ptr() % ALIGNMENT == 0, name
    reference = build_model(config, hf.state_dict())
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values(),
                                    strict=True):
        assert torch.equal(ours, theirs), name


def test_a_quantised_model_is_laid_out_and_frees_its_float_buffer():
    model, _ = tiny_llama_parts(tie_word_embeddings=True)
    lay_out_weights(model)  # one float buffer, as a model loaded before quantising had
    float_buffer = weakref.ref(model.layers[0].self_attn.q_proj.weight.untyped_storage())
    CPUPlatform(torch.device("cpu"), gemv_rows=8).load(model, "int8")
    assert_laid_out(model)
    assert any(isinstance(t, torch.Tensor) and t.dtype == torch.int8
               for _, t in held_tensors(model))
    assert model.lm_head.int8 is model.input_embedding().int8  # still one object
    gc.collect()
    assert float_buffer() is None  # no view of the float weights' buffer is left


def test_a_laid_out_models_checkpoint_state_dict_pickles_only_its_own_bytes():
    """Tensor parallelism pickles `checkpoint_state_dict` to the ranks; a view pickles its whole
    storage, so the buffer would go once per tensor."""
    model, config = tiny_llama_parts(tie_word_embeddings=False)
    lay_out_weights(model)
    assert_laid_out(model)
    state = checkpoint_state_dict(config, model)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes < len(pickle.dumps(state)) < nbytes + 64 * 1024 + 2000 * len(state)
    for name, tensor in state.items():
        reference = model.state_dict()[name.removeprefix("model.")]
        assert torch.equal(tensor, reference), name


def test_a_model_off_the_cpu_is_refused_by_name():
    model, _ = tiny_llama_parts()
    meta = copy.deepcopy(model).to("meta")
    with pytest.raises(ValueError, match="CPU model.*meta"):
        lay_out_weights(meta)
