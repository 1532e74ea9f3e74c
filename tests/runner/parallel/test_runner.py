"""Tensor parallelism: the shard arithmetic, each rank's slices, and TP engines against TP=1.

The arithmetic and the slices are checked in this process (a rank's shard can be built without
a process group); the engines start real gloo workers, so each test that starts one runs its
whole story on it and closes it (one tensor-parallel engine per process at a time). The file's
tests share one xdist group so that their worker processes do not compete with each other.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import (
    SMALL_LLAMA,
    RankBudgets,
    minipaged_parts,
    plan_of,
    random_gpt2,
    random_llama,
    scheduled,
)

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.engine.llm import LLM
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.llama import LLAMA
from minipaged.models.tensor_parallel import (
    TensorParallel,
    TensorParallelError,
    check_shardable,
    checkpoint_state_dict,
    kv_heads,
    q_heads,
    token_embedding,
    vocab_range,
)
from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import kv_bytes_per_block
from minipaged.runner.parallel.runner import TensorParallelRunner, WorkerDiedError
from minipaged.runner.parallel.worker import (
    CheckpointShards,
    RankSpec,
    StateDictShards,
    free_port,
)
from minipaged.sampling.params import SamplingParams

pytestmark = pytest.mark.xdist_group("tensor_parallel")

TIMEOUT_S = 10.0  # collectives of the test engines: a dead worker is reported within this


def config_of(heads: int, kv: int, inner: int = 64, vocab: int = 64) -> ModelConfig:
    return ModelConfig(
        family=LLAMA, vocab_size=vocab, hidden_size=heads * 8, num_layers=1,
        num_heads=heads, num_kv_heads=kv, head_dim=8, intermediate_size=inner,
        max_position_embeddings=64,
    )


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def tiny_gpt2(n_layer: int):
    """A GPT-2 of 4 heads whose 67-token vocabulary does not split evenly over 2 ranks."""
    return random_gpt2(
        vocab_size=67, n_embd=32, n_layer=n_layer, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )


# -- shard arithmetic -------------------------------------------------------------------------


@given(
    kv=st.integers(1, 6), group=st.integers(1, 4), world=st.integers(1, 12),
    vocab=st.integers(1, 200),
)
def test_every_head_and_token_has_its_ranks(kv, group, world, vocab):
    heads = kv * group
    config = config_of(heads, kv, inner=world * 4, vocab=vocab)
    if heads % world or (kv % world and world % kv):
        with pytest.raises(TensorParallelError, match=f"{world}"):
            check_shardable(config, world)
        return
    check_shardable(config, world)
    ranks = [TensorParallel(r, world) for r in range(world)]
    owners = [r for tp in ranks for r in q_heads(config, tp)]
    assert sorted(owners) == list(range(heads))  # each query head on exactly one rank
    holders = {h: 0 for h in range(kv)}
    for tp in ranks:
        needed = {h // group for h in q_heads(config, tp)}  # the KV heads its queries read
        assert set(kv_heads(config, tp)) == needed
        for h in needed:
            holders[h] += 1
    assert set(holders.values()) == {max(1, world // kv)}  # replicated only below N KV heads
    ids = [i for tp in ranks for i in vocab_range(config, tp)]
    assert ids == list(range(vocab))  # the vocabulary split in order, nothing twice


def test_one_rank_embedding_is_initialised_as_nn_embedding():
    config = config_of(heads=4, kv=2)
    torch.manual_seed(0)
    reference = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    torch.manual_seed(0)
    ours = token_embedding(config, TensorParallel(0, 1))
    assert torch.equal(ours.weight, reference.weight) and ours.weight.requires_grad


def test_unshardable_models_and_settings_raise_clearly():
    smollm2_like = config_of(9, 3, inner=1536)
    with pytest.raises(TensorParallelError, match="9 attention heads .* 2 ranks"):
        check_shardable(smollm2_like, 2)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 12 exceeds .* 9"):
        check_shardable(smollm2_like, 12)
    with pytest.raises(TensorParallelError, match="4 KV heads .* 3"):
        check_shardable(config_of(12, 4), 3)
    with pytest.raises(TensorParallelError, match="intermediate size 66"):
        check_shardable(config_of(4, 2, inner=66), 4)
    for bad in (0, -1, 1.5, True):  # out of range: ValueError; not an int: TypeError
        with pytest.raises((ValueError, TypeError), match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tensor_parallel_timeout"):
        EngineConfig(tensor_parallel_timeout=0)
    # The engine refuses before it starts any process.
    six_heads = SMALL_LLAMA | dict(hidden_size=36, num_attention_heads=6)
    model, config = minipaged_parts(random_llama(**six_heads))
    with pytest.raises(TensorParallelError, match="6 attention heads .* 4 ranks"):
        LLMEngine(model, config, config=EngineConfig(tensor_parallel_size=4, device="cpu"))
    if not torch.cuda.is_available():  # no NCCL or no CUDA device here: said at once
        with pytest.raises(TensorParallelError, match="nccl backend|2 CUDA devices"):
            LLMEngine(model, config, config=EngineConfig(
                tensor_parallel_size=2, device="cuda", num_gpu_blocks=4, num_cpu_blocks=0
            ))
    assert not dist.is_initialized()


# -- each rank's slices -------------------------------------------------------------------------


def heads_rows(weight: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    """The rows of `weight` ([heads * head_dim, ...]) that belong to `heads`."""
    return torch.cat([weight[h * head_dim : (h + 1) * head_dim] for h in heads])


@pytest.mark.parametrize("world", [2, 4])
def test_llama_rank_reads_exactly_its_slices_from_safetensors(tmp_path, world):
    hf = random_llama(**(SMALL_LLAMA | dict(tie_word_embeddings=False)))
    hf.save_pretrained(tmp_path)
    full = hf.state_dict()
    heads, kv, d = 4, 2, 8  # SMALL_LLAMA: 4 query heads, 2 KV heads, hidden 32
    for rank in range(world):
        model, config = CheckpointShards(str(tmp_path)).load(
            TensorParallel(rank, world), torch.float32, torch.device("cpu")
        )
        mine = list(range(rank * heads // world, (rank + 1) * heads // world))
        kv_mine = sorted({h // (heads // kv) for h in mine})
        inner = 64 // world
        ours = dict(model.named_parameters())
        attn, mlp = "layers.1.self_attn.", "layers.1.mlp."
        hf_attn, hf_mlp = "model." + attn, "model." + mlp
        expected = {
            attn + "q_proj.weight": heads_rows(full[hf_attn + "q_proj.weight"], mine, d),
            attn + "k_proj.weight": heads_rows(full[hf_attn + "k_proj.weight"], kv_mine, d),
            attn + "v_proj.weight": heads_rows(full[hf_attn + "v_proj.weight"], kv_mine, d),
            attn + "o_proj.weight": heads_rows(full[hf_attn + "o_proj.weight"].T, mine, d).T,
            mlp + "up_proj.weight": full[hf_mlp + "up_proj.weight"][rank * inner :][:inner],
            mlp + "down_proj.weight": full[hf_mlp + "down_proj.weight"][:, rank * inner :][
                :, :inner
            ],
            "norm.weight": full["model.norm.weight"],
            "embed_tokens.weight": full["model.embed_tokens.weight"][rank * 64 // world :][
                : 64 // world
            ],
            "lm_head.weight": full["lm_head.weight"][rank * 64 // world :][: 64 // world],
        }
        for name, tensor in expected.items():
            assert torch.equal(ours[name], tensor), (rank, name)
        assert config.num_heads == heads  # the config stays the whole model's


def test_gpt2_rank_slices_fused_qkv_and_pads_the_vocabulary():
    hf = tiny_gpt2(n_layer=1)
    _, config = minipaged_parts(hf)
    full = {n.removeprefix("transformer."): w for n, w in hf.state_dict().items()}
    for rank in range(2):
        model, _ = StateDictShards(config, hf.state_dict()).load(
            TensorParallel(rank, 2), torch.float32, torch.device("cpu")
        )
        ours = dict(model.named_parameters())
        qkv = full["h.0.attn.c_attn.weight"].T.reshape(3, 4, 8, 32)  # (q|k|v, head, dim, in)
        mine = qkv[:, 2 * rank : 2 * rank + 2].reshape(-1, 32)
        assert torch.equal(ours["h.0.attn.c_attn.weight"], mine)
        bias = full["h.0.attn.c_attn.bias"].reshape(3, 4, 8)[:, 2 * rank : 2 * rank + 2]
        assert torch.equal(ours["h.0.attn.c_attn.bias"], bias.reshape(-1))
        c_proj = full["h.0.attn.c_proj.weight"].T  # (out, in): this rank's input columns
        assert torch.equal(ours["h.0.attn.c_proj.weight"], c_proj[:, 16 * rank :][:, :16])
        assert torch.equal(ours["h.0.attn.c_proj.bias"], full["h.0.attn.c_proj.bias"])
        wte = ours["wte.weight"]
        assert wte.shape == (34, 32)  # ceil(67 / 2) rows on every rank
        real = full["wte.weight"][34 * rank : 34 * rank + 34]
        assert torch.equal(wte[: len(real)], real) and not wte[len(real) :].any()
        assert model.lm_head.weight is model.wte.weight  # tied, on the rank's rows


# -- engines against TP=1 -----------------------------------------------------------------------


def random_prompts(count: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        for _ in range(count)
    ]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    return [finals[i].outputs[0].token_ids for i in ids]


def prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    """The logits of one step that prefills `prompts` into blocks 0, 1, 2, ... of the cache."""
    entries, block = [], 0
    bs = engine.runner.block_size
    for prompt in prompts:
        n = -(-len(prompt) // bs)
        entries.append(scheduled(prompt, 0, list(range(block, block + n)), seq_id=len(entries)))
        block += n
    return engine.runner.execute(plan_of(entries))


# On CPU (gloo) even where CUDA is available: these tests are about the split, not the device.
ENGINE = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=32, max_num_seqs=6, device="cpu")


def assert_engine_matches_tp1(
    parts, vocab: int, world: int, runs: bool = True, **engine_kwargs
) -> LLMEngine:
    """A TP engine's logits and (with `runs`) greedy outputs, with preemption and then with
    prefix caching, equal a TP=1 engine's; returns the TP engine, still open."""
    model, config = parts
    settings = ENGINE | engine_kwargs
    reference = LLMEngine(model, config, config=EngineConfig(**settings))
    engine = LLMEngine(model, config, config=EngineConfig(
        **settings, tensor_parallel_size=world, tensor_parallel_timeout=TIMEOUT_S
    ))
    try:
        prompts = random_prompts(3, vocab, seed=0)
        torch.testing.assert_close(
            prefill_logits(engine, prompts), prefill_logits(reference, prompts),
            rtol=1e-5, atol=1e-5,
        )
        if not runs:
            return engine
        crowded = random_prompts(8, vocab, seed=1)  # 20 blocks of 4 cannot hold them all
        assert greedy(engine, crowded, 10) == greedy(reference, crowded, 10)
        assert engine.scheduler.num_preemptions > 0
        shared = random_prompts(4, vocab, seed=2, shared_prefix=12)
        assert greedy(engine, shared, 4) == greedy(reference, shared, 4)
        assert engine.kv_manager.prefix_cache_hits > 0
    except BaseException:
        engine.close()
        raise
    return engine


def test_tp2_gqa_llama_equals_tp1():
    parts = minipaged_parts(random_llama(**SMALL_LLAMA))  # 4 query heads, 2 KV heads
    with assert_engine_matches_tp1(parts, 64, 2, preemption_mode="swap") as engine:
        assert engine.runner.kv_caches[0].shape[-2] == 1  # one KV head per rank
    assert not dist.is_initialized()


def test_every_rank_sizes_its_cache_after_its_weights_and_all_keep_the_smallest():
    """Each rank's platform grants its own budget only once that rank's weights are placed and
    its profile has run (`BudgetPlatform` asserts it, in the worker too); the ranks then agree
    on the smallest count, which rank 0 plans with and a step runs over."""
    model, config = minipaged_parts(random_llama(**SMALL_LLAMA))  # one KV head per rank
    per_block = kv_bytes_per_block(config, 4, torch.float32, num_kv_heads=1)
    for first, others in ((30, 12), (9, 25)):
        shards = StateDictShards(config, checkpoint_state_dict(config, model))
        spec = RankSpec(
            rank=0, world_size=2, source=shards, init_method=f"tcp://127.0.0.1:{free_port()}",
            config=RunnerConfig(device="cpu", block_size=4, num_cpu_blocks=0,
                                tensor_parallel_size=2, tensor_parallel_timeout=TIMEOUT_S),
            platform=RankBudgets(first * per_block, others * per_block))
        runner = TensorParallelRunner(spec)
        try:
            assert runner.platform.forwards and runner.platform.configs  # sized after a profile
            assert runner.kv_caches[0].shape[1] == first  # its own budget's blocks
            assert runner.num_gpu_blocks == min(first, others)  # the ranks' smallest
            logits = runner.execute(plan_of([scheduled([5, 9, 2], 0, [min(first, others) - 1])]))
            assert logits.shape == (1, config.vocab_size)
        finally:
            runner.close()
    assert not dist.is_initialized()


def test_tp2_gpt2_equals_tp1():
    parts = minipaged_parts(tiny_gpt2(n_layer=2))
    assert_engine_matches_tp1(parts, 67, 2, preemption_mode="recompute").close()


def test_replicated_kv_heads_then_a_killed_worker_ends_the_run():
    mqa = SMALL_LLAMA | dict(num_key_value_heads=1)  # one KV head, replicated on both ranks
    engine = assert_engine_matches_tp1(minipaged_parts(random_llama(**mqa)), 64, 2, runs=False)
    worker = engine.runner.worker_pids[0]
    os.kill(worker, signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        greedy(engine, random_prompts(2, 64, seed=3), 4)
    assert time.monotonic() - began < TIMEOUT_S + 5
    with pytest.raises(WorkerDiedError):  # and it stays ended
        greedy(engine, random_prompts(1, 64, seed=4), 2)
    assert not dist.is_initialized()
    engine.close()  # idempotent


def test_a_stopped_worker_ends_the_run_after_the_collective_timeout():
    """A worker that is alive but never answers (SIGSTOP): the step's collective times out,
    the run ends with `WorkerDiedError`, and the stopped process is killed, not left behind."""
    model, config = minipaged_parts(random_llama(**SMALL_LLAMA))
    engine = LLMEngine(model, config, config=EngineConfig(
        **ENGINE, tensor_parallel_size=2, tensor_parallel_timeout=1.0
    ))
    worker = engine.runner.worker_pids[0]
    os.kill(worker, signal.SIGSTOP)
    began = time.monotonic()
    with pytest.raises(WorkerDiedError, match="waited more than 1.0 s"):
        greedy(engine, random_prompts(1, 64, seed=6), 2)
    assert time.monotonic() - began < 15  # the timeout, then SIGTERM's and SIGKILL's waits
    assert not running(worker) and not dist.is_initialized()


def test_tp3_smollm2_equals_tp1(bundled_path, bundled_model, bundled_tokenizer):
    """Three ranks of 3 query heads and 1 KV head each, every one reading its third of the
    GGUF: the greedy answer is TP=1's, and rank 0 holds exactly its slices."""
    model, config = bundled_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    settings = dict(num_gpu_blocks=64, block_size=16, device="cpu")
    with LLM(bundled_path, tensor_parallel_size=3, tensor_parallel_timeout=60, **settings) as llm:
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        # TP=1 here, on the one thread the TP engine gives this process while it runs.
        reference = LLMEngine(model, config, bundled_tokenizer, EngineConfig(**settings))
        prompt = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reference.add_request("r", bundled_tokenizer.encode(prompt), params)
        expected = reference.run_until_done()["r"].outputs[0]
        shard = llm.engine.runner.model
        whole, ours = dict(model.named_parameters()), dict(shard.named_parameters())
        for name, rows in [("self_attn.q_proj", slice(0, 192)), ("self_attn.k_proj", slice(0, 64)),
                           ("mlp.up_proj", slice(0, 512))]:
            key = f"layers.4.{name}.weight"
            assert torch.equal(ours[key], whole[key][rows]), name
        down = "layers.4.mlp.down_proj.weight"
        assert torch.equal(ours[down], whole[down][:, :512])
        assert torch.equal(ours["embed_tokens.weight"], whole["embed_tokens.weight"][:16384])
        assert shard.lm_head.weight is shard.embed_tokens.weight  # tied, on the rank's rows
        # The logits of one prefill step (the requests above are done: every block is free).
        prompt_ids = [bundled_tokenizer.encode(prompt)]
        tp_logits, tp1_logits = prefill_logits(llm.engine, prompt_ids), prefill_logits(
            reference, prompt_ids
        )
        torch.testing.assert_close(tp_logits, tp1_logits, rtol=1e-4, atol=1e-4)
    assert answer.token_ids == expected.token_ids
    assert answer.text.startswith("The capital of France is Paris")
    assert not dist.is_initialized()


def test_command_line_flag_reaches_the_engine_and_its_checks(bundled_path, capsys):
    from minipaged.__main__ import build_parser, engine_kwargs_from_args, main

    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "3"])
    assert engine_kwargs_from_args(args)["tensor_parallel_size"] == 3
    status = main(["generate", "--tensor-parallel-size", "2", "--device", "cpu",
                   "--max-tokens", "2", "Hi"])
    assert status == 2  # SmolLM2's 9 heads cannot be split in two, said before any process
    assert "9 attention heads do not divide among tensor_parallel_size 2" in capsys.readouterr().err
    assert not dist.is_initialized()


TORCHRUN_SCRIPT = """
import json, sys
from minipaged.models.checkpoint.loader import checkpoint_config
from minipaged.models.registry import FAMILIES
from minipaged.engine.engine import LLMEngine
from minipaged.engine.config import EngineConfig
from minipaged.runner.parallel.worker import CheckpointShards
from minipaged.sampling.params import SamplingParams

path, size, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
config = EngineConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=0, device="cpu",
                      tensor_parallel_size=size, tensor_parallel_timeout=30)
engine = LLMEngine(CheckpointShards(path), checkpoint_config(path, FAMILIES), None, config)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ids = [engine.add_request(None, p, params) for p in prompts]  # rank 0 only gets here
finals = engine.run_until_done()
print("TOKENS", json.dumps([finals[i].outputs[0].token_ids for i in ids]))
engine.close()
"""


def test_torchrun_ranks_serve_rank_0s_plans(tmp_path):
    """Launched by `torchrun`, both ranks run the same program; rank 0's engine gives TP=1's
    greedy tokens and rank 1 exits once rank 0 closes."""
    import json
    import subprocess
    import sys

    random_llama(**SMALL_LLAMA).save_pretrained(tmp_path / "model")
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    prompts = random_prompts(3, 64, seed=5)
    model, config = minipaged_parts(random_llama(**SMALL_LLAMA))
    reference = LLMEngine(model, config, config=EngineConfig(**ENGINE))
    expected = greedy(reference, prompts, 6)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path / "model"), "2", json.dumps(prompts)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # printed by rank 0 alone
    assert json.loads(lines[0].removeprefix("TOKENS ")) == expected


ORPHAN_SCRIPT = """
import sys, time
from minipaged.models.checkpoint.loader import checkpoint_config
from minipaged.models.registry import FAMILIES
from minipaged.engine.engine import LLMEngine
from minipaged.engine.config import EngineConfig
from minipaged.runner.parallel.worker import CheckpointShards

if __name__ == "__main__":
    path = sys.argv[1]
    config = EngineConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, device="cpu",
                          tensor_parallel_size=2)
    engine = LLMEngine(CheckpointShards(path), checkpoint_config(path, FAMILIES), None, config)
    print("WORKERS", *engine.runner.worker_pids, flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_exit_when_the_parent_is_killed(tmp_path):
    import subprocess
    import sys

    random_llama(**SMALL_LLAMA).save_pretrained(tmp_path / "model")
    script = tmp_path / "idle.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "model")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = parent.stdout.readline()
        assert line.startswith("WORKERS "), line
        workers = [int(pid) for pid in line.split()[1:]]
        assert workers and all(running(pid) for pid in workers)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(pid) for pid in workers)  # no orphan outlives its parent
