"""Tiny random models for tests: built with `transformers`, run by minipaged.

Many tests need a real model but not a good one: a few layers of random weights are enough to
compare minipaged against a reference (transformers' logits, the dense generation oracle, a
brute-force search) or to give the engine real forward passes to schedule. Import from any test
module in `tests/` as

    from tiny_models import tiny_llama_parts, tiny_engine, assert_engine_drained

(pytest puts `tests/` on `sys.path` because the folder has no `__init__.py`).

* `random_hf` (and its shorthands `random_llama` / `random_gpt2`): a seeded, randomly
  initialised `transformers` model of any family and config; each test module keeps its own
  config, these builders only remove the ceremony.
* `minipaged_parts`: the same weights as a minipaged model, through `ModelConfig.from_hf_dict`
  and `build_model` -- what the engine tests run on.
* `tiny_llama_parts`: both steps at once, starting from `SMALL_LLAMA` (a two-layer GQA LLaMA).
* `tiny_engine`, `assert_engine_drained`: an `LLMEngine` around such a model without a
  tokenizer, and the check that a finished run gave every block back.
* `dense_last_logits`: the logits after a token list from one dense forward pass, the oracle
  the paged paths are compared with.
* `assert_llama_config_matches`: a `ModelConfig` equals transformers' `LlamaConfig` field by
  field.
* `cpu_platform`: the CPU platform with its few-row choice fixed (every projection on the
  GEMV kernel up to `rows` rows), whatever this machine's timings would choose.

`transformers` is a development dependency, imported only when a builder runs, so a module that
imports this one still collects (and its other tests still run) where it is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest
import torch

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.kernels.cpu.gemv import MAX_ROWS
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES, build_model
from minipaged.platforms import Platform
from minipaged.platforms.cpu import CPUPlatform
from minipaged.runner.backends import ProfileAttention
from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import ModelRunner
from minipaged.sched.output import ScheduledSequence, SchedulerOutput
from minipaged.testing.dense import DenseAttentionBackend, DenseKVCache

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

# A two-layer LLaMA with grouped-query attention (4 query heads share 2 KV heads): small enough
# that an engine step costs milliseconds on a CPU, and still every part of the architecture.
SMALL_LLAMA: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def random_hf(model_type: str, seed: int = 0, **config: Any) -> PreTrainedModel:
    """A `transformers` causal LM of `model_type` ("llama", "mistral", "qwen2", "qwen3",
    "gpt2", ...) and this config, with random weights drawn after `torch.manual_seed` (so the
    same every time), in eval mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    return transformers.AutoModelForCausalLM.from_config(hf_config).eval()


def random_llama(seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """`random_hf("llama", ...)`."""
    return random_hf("llama", seed, **config)


def random_gpt2(seed: int = 0, **config: Any) -> GPT2LMHeadModel:
    """`random_hf("gpt2", ...)`."""
    return random_hf("gpt2", seed, **config)


def minipaged_parts(hf_model: torch.nn.Module) -> tuple[torch.nn.Module, ModelConfig]:
    """(minipaged model, its config) holding the weights of a `transformers` model."""
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict(), FAMILIES)
    return build_model(config, hf_model.state_dict()), config


def tiny_llama_parts(**overrides: Any) -> tuple[torch.nn.Module, ModelConfig]:
    """(minipaged model, config) of a random `SMALL_LLAMA`, with `overrides` in its config."""
    return minipaged_parts(random_llama(**(SMALL_LLAMA | overrides)))


def tiny_engine(parts: tuple[torch.nn.Module, ModelConfig], **engine_config: Any) -> LLMEngine:
    """An engine without a tokenizer (requests are token ids) around `tiny_llama_parts`'s
    result, configured by `EngineConfig(**engine_config)`."""
    model, config = parts
    return LLMEngine(model, config, tokenizer=None, config=EngineConfig(**engine_config))


def assert_engine_drained(engine: LLMEngine) -> None:
    """Nothing left to run, the KV cache consistent and every block free again."""
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_gpu_blocks
    assert not engine.has_unfinished_requests()


def dense_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens`, from one dense forward pass over the whole context."""
    attn = DenseAttentionBackend(DenseKVCache(model.config.num_layers), [0], [len(tokens)])
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), attn)
        return model.compute_logits(hidden[-1:])[0]


def assert_llama_config_matches(ours: ModelConfig, hf: LlamaConfig) -> None:
    """Every size, the norm epsilon, the rope base and the head tying read as transformers did
    (for any config of the LLaMA family: LLaMA, Mistral, Qwen2, Qwen3)."""
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.num_kv_heads == hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert ours.head_dim == head_dim
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings


def scheduled(
    token_ids: list[int] | tuple[int, ...],
    start: int,
    block_table: list[int] | tuple[int, ...],
    needs_logits: bool = True,
    seq_id: int = 0,
) -> ScheduledSequence:
    """A sequence's share of a hand-made step, for runner tests."""
    return ScheduledSequence(
        f"r{seq_id}", seq_id, start, tuple(token_ids), needs_logits=needs_logits,
        is_prefill=len(token_ids) > 1 or start == 0, block_table=tuple(block_table),
    )


def plan_of(
    entries: list[ScheduledSequence], moves: SchedulerOutput | None = None
) -> SchedulerOutput:
    """A step's plan: `entries`, after the block movements of `moves`."""
    return replace(moves or SchedulerOutput(), scheduled=list(entries))


def run_bounded(engine: LLMEngine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until nothing is left, checking the KV manager's invariants after every step;
    every output that finished, by request id. Fails when the engine stops making progress."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.kv_manager.check_invariants()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def cpu_platform(rows: int = MAX_ROWS, **options: Any) -> CPUPlatform:
    """The CPU platform with every float projection on the GEMV kernel up to `rows` rows
    (0: none), so that a test does not depend on this machine's timings."""
    return CPUPlatform(torch.device("cpu"), gemv_rows=rows, **options)


def cpu_runner(model: torch.nn.Module, model_config: ModelConfig, platform: Platform | None = None,
               dtype: torch.dtype = torch.float32, **settings: Any) -> ModelRunner:
    """A `ModelRunner` on the CPU over `model`: `settings` are `RunnerConfig`'s (no host pool
    unless `num_cpu_blocks` says so), `dtype` a torch dtype."""
    config = RunnerConfig(device="cpu", dtype=str(dtype).removeprefix("torch."),
                          **{"num_cpu_blocks": 0, **settings})
    return ModelRunner(model, model_config, config, platform=platform)


class BudgetPlatform(Platform):
    """The reference platform granting the KV cache `budget` bytes (a stand-in for a device's
    measured memory), only once its weights are loaded and the profiles have run; it records
    their forwards (the tokens of the batch, whether it attended through no cache, the rows of
    its logits) and the configs it was handed. With `graph_sizes` it would capture those decode
    sizes, and refuses every capture."""

    def __init__(self, budget: float, graph_sizes: tuple[int, ...] = ()) -> None:
        super().__init__(torch.device("cpu"))
        self.budget, self.loaded, self.graph_sizes = budget, False, graph_sizes
        self.forwards: list[tuple[int, bool]] = []  # (tokens, attended through no cache)
        self.logit_rows: list[int] = []
        self.configs: list[Any] = []

    def kv_cache_bytes(self, profiles: Any, config: Any) -> float:
        assert self.loaded, "the cache is sized before the weights are placed"
        for profile in profiles:
            profile()
        assert self.forwards, "the profile ran no forward"
        self.configs.append(config)
        return self.budget

    def load(self, model: torch.nn.Module, quantization: str | None = None) -> torch.nn.Module:
        model = super().load(model, quantization)
        model.register_forward_hook(lambda module, args, out: self.forwards.append(
            (args[0].shape[0], isinstance(args[2], ProfileAttention))))
        model.lm_head.register_forward_hook(
            lambda module, args, out: self.logit_rows.append(args[0].shape[0]))
        self.loaded = True
        return model


@dataclass(frozen=True)
class RankBudgets:
    """Each tensor-parallel rank's `BudgetPlatform` (a `RankSpec.platform`, pickled to the
    workers): rank 0, in this process, is granted `first` bytes, every worker `others`."""

    first: float
    others: float
    pid: int = field(default_factory=os.getpid)

    def __call__(self, config: Any) -> BudgetPlatform:
        return BudgetPlatform(self.first if os.getpid() == self.pid else self.others)
