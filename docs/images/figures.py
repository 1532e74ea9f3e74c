"""Draw the layer pages' figures into docs/images/ with the notebooks' own pictures
(`teaching.pictures`), from the same toys and committed results the notebooks use.

Run `python docs/images/figures.py` after a picture or a toy changes; it takes a few seconds.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
warnings.filterwarnings("ignore", message="IProgress not found")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "notebooks"))  # teaching/

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from minipaged.kv import KVCacheManager, ReservationKVCacheManager  # noqa: E402
from minipaged.models.checkpoint.loader import checkpoint_config, default_model_path  # noqa: E402
from minipaged.models.registry import FAMILIES  # noqa: E402
from minipaged.models.tensor_parallel import TensorParallel, split_of  # noqa: E402
from minipaged.sched.base import SchedulerConfig  # noqa: E402
from minipaged.sched.cost_model import CostModel  # noqa: E402
from minipaged.sched.fcfs import FCFSScheduler  # noqa: E402
from minipaged.sched.mlfq import MLFQConfig, mlfq_factory  # noqa: E402
from minipaged.sim.simulator import simulate  # noqa: E402
from minipaged.sim.traces import TraceRequest  # noqa: E402
from minipaged.tokenizer.gguf_file import read_gguf_file  # noqa: E402
from minipaged.tokenizer.tokenizer import Tokenizer  # noqa: E402
from teaching.pictures import (  # noqa: E402
    draw_decoder_block,
    draw_kv_state,
    draw_paged_layout,
    draw_slots,
    draw_weight_splits,
    gantt,
    show_tokens,
    slot_legend,
)
from teaching.toy_blocks import ToyEngine, slot_categories, token_ids  # noqa: E402

HERE = Path(__file__).resolve().parent
DPI = 110


def save(fig: plt.Figure, name: str) -> None:
    fig.savefig(HERE / name, dpi=DPI)
    plt.close(fig)


def tokens() -> None:
    tok = Tokenizer.from_pretrained(default_model_path())
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                       "France?"}], add_generation_prompt=True)
    ids = tok.encode(prompt)
    fig, ax = plt.subplots(figsize=(8.8, 2.6))
    show_tokens(ax, [tok.decode([i]) for i in ids], [i in tok.special_token_ids for i in ids],
                line_height=0.17)
    ax.set_title(f"SmolLM2's chat prompt as {len(ids)} tokens (· a space, ⏎ a newline)")
    save(fig, "tokens.png")


def q4_1_block() -> None:
    gguf = read_gguf_file(default_model_path())
    tensor = next(t for t in gguf.tensors if t.name == "blk.0.ffn_down.weight")
    block = tensor.data[0, :20]
    d = block[0:2].view(np.float16)[0].astype(np.float32)
    m = block[2:4].view(np.float16)[0].astype(np.float32)
    q = np.concatenate([block[4:20] & 0x0F, block[4:20] >> 4]).astype(np.float32)
    fig, ax = plt.subplots(figsize=(8, 2.8), layout="constrained")
    ax.step(np.arange(32), d * q + m, where="mid", label="d * q + m")
    for level in range(16):
        ax.axhline(d * level + m, color="grey", lw=0.3)
    ax.set(xlabel="weight index in the block", ylabel="weight value",
           title="One Q4_1 block: 32 weights snapped to 16 evenly spaced levels")
    ax.legend(loc="upper right", fontsize=9)
    save(fig, "q4_1_block.png")


def decoder_block() -> None:
    config = checkpoint_config(default_model_path(), FAMILIES)
    fig, ax = plt.subplots(figsize=(6, 7.5), layout="constrained")
    draw_decoder_block(ax, config.hidden_size, config.num_heads, config.num_kv_heads,
                       config.intermediate_size, config.num_layers)
    ax.set_title("One LLaMA decoder block (SmolLM2-135M)")
    save(fig, "decoder_block.png")


def reservations() -> None:
    requests = {"A": (4, 6, 2), "B": (5, 3, 1)}  # prompt, output, generated so far
    managers = {f"Orca-{p.capitalize()}": ReservationKVCacheManager(64, 1, p, max_seq_len=24)
                for p in ("max", "pow2", "oracle")}
    managers["paged, blocks of 4"] = KVCacheManager(num_gpu_blocks=16, block_size=4)
    fig, axes = plt.subplots(len(managers), 1, figsize=(8.8, 3.6), layout="constrained")
    for ax, (name, manager) in zip(axes, managers.items(), strict=True):
        for seq, (prompt, output, done) in requests.items():
            if isinstance(manager, ReservationKVCacheManager):
                manager.expect(seq, prompt, output)
            manager.allocate(seq, token_ids("x" * prompt))
            manager.append_slots(seq, num_tokens=prompt + done)
        use = manager.memory_usage()
        slots = slot_categories(manager, {s: r[:2] for s, r in requests.items()})
        draw_slots(ax, slots, f"{name}: {use.token_fraction_of_allocated:.0%} of the "
                   f"{use.allocated_slots} allocated slots hold tokens", per_row=64)
    slot_legend(fig)
    fig.suptitle("Two requests, 64 token slots: reservations against blocks")
    save(fig, "reservations.png")


def kv_blocks() -> None:
    toy = ToyEngine(KVCacheManager(num_gpu_blocks=12, block_size=4))
    toy.admit("A", "Hello there wor")
    toy.compute("A")
    toy.fork("A", "B")
    toy.append("A", "l")
    toy.append("B", "k")
    toy.compute("A")
    toy.compute("B")
    save(draw_kv_state(toy, "A forked into B, then each appended a token: copy-on-write"),
         "kv_blocks.png")


def paged_layout() -> None:
    fig = draw_paged_layout([5, 19, 11], [[2], [6, 8, 0], [9, 3]], block_size=8,
                            num_blocks=10)
    fig.suptitle("Three sequences in a pool of 10 blocks of 8 slots")
    save(fig, "paged_layout.png")


def online_softmax() -> None:
    torch.manual_seed(0)
    n_keys, tile, d = 128, 16, 32
    q, keys = torch.randn(d), torch.randn(n_keys, d)
    keys[70] += 3 * q / q.norm()
    scores = keys @ q / d**0.5
    m, l, ends, ms, ls = -float("inf"), 0.0, [], [], []
    for start in range(0, n_keys, tile):
        s = scores[start : start + tile]
        m_new = max(m, s.max().item())
        l = l * float(np.exp(m - m_new)) + torch.exp(s - m_new).sum().item()
        m = m_new
        ends.append(start + tile), ms.append(m), ls.append(l)
    fig, ax = plt.subplots(figsize=(8.6, 3.2), layout="constrained")
    ax.scatter(range(n_keys), scores, s=6, c="0.6", label="scores")
    ax.step(ends, ms, where="post", c="C3", label="running max m")
    ax.set(xlabel="keys seen", ylabel="score, running max m",
           title="Online softmax over one row, 16-key tiles")
    twin = ax.twinx()
    twin.plot(ends, ls, "o-", c="C0", label="running sum l")
    twin.set_ylabel("l = sum of exp(s - m)", color="C0")
    fig.legend(loc="outside lower center", ncol=3, fontsize=9)
    save(fig, "online_softmax.png")


def sampling() -> None:
    logits = torch.tensor([3.0, 2.6, 2.2, 1.5, 1.2, 0.8, 0.5, 0.1])
    fig, ax = plt.subplots(figsize=(8, 2.8), layout="constrained")
    for k, (name, t, p) in enumerate([("T=0.5", 0.5, 1.0), ("T=1", 1.0, 1.0),
                                      ("T=1.5", 1.5, 1.0), ("T=1, top_p=0.6", 1.0, 0.6)]):
        probs = torch.softmax(logits / t, -1)
        keep = probs.cumsum(0) - probs < p
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        ax.bar(np.arange(8) + k * 0.2, (kept / kept.sum()).numpy(), 0.2, label=name)
    ax.set_xticks(np.arange(8) + 0.3, [f"token {i}" for i in range(8)], fontsize=9)
    ax.set(ylabel="probability", title="Next-token distribution under temperature and top-p")
    ax.legend(fontsize=9, loc="upper right")
    save(fig, "sampling.png")


def scheduler_gantt() -> None:
    toy = CostModel(base=1.0, per_prefill_token=0.25, per_decode_seq=0.0,
                    per_context_token=0.0)
    jobs = [TraceRequest(0.0, 40, 3), TraceRequest(0.0, 4, 6), TraceRequest(0.0, 4, 2),
            TraceRequest(0.0, 4, 2), TraceRequest(3.0, 4, 2)]
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=128,
                             enable_chunked_prefill=False)
    queues = dict(base_quantum=2.0, quantum_ratio=2.0, num_levels=4, starvation_bound=None)
    small = dict(num_gpu_blocks=64, block_size=4, config=config, record_steps=True)
    runs = {
        "FCFS": simulate(jobs, toy, FCFSScheduler, **small),
        "naive MLFQ": simulate(jobs, toy, mlfq_factory(MLFQConfig(skip_join=False, **queues)),
                               **small),
        "skip-join MLFQ": simulate(jobs, toy,
                                   mlfq_factory(MLFQConfig(skip_join=True, **queues), toy),
                                   **small),
    }
    fig, axes = plt.subplots(3, 1, figsize=(8.8, 5.6), sharex=True, layout="constrained")
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        gantt(ax, run, name)
    axes[-1].set_xlabel("time (units of the toy's cost model; hatched: prefill)")
    fig.suptitle("Five jobs on one server, job 0 with a long prompt: who runs when")
    save(fig, "gantt.png")


def tp_splits() -> None:
    config = checkpoint_config(default_model_path(), FAMILIES)
    weights = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576),
               "o_proj": (576, 576), "gate_proj": (1536, 576), "up_proj": (1536, 576),
               "down_proj": (576, 1536)}
    pieces = {}
    for name in weights:
        part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        pieces[name] = [(rank, split.dim, start, stop) for rank in range(3)
                        for split in [split_of(config, f"layers.0.{part}.{name}.weight",
                                               TensorParallel(rank, 3))]
                        for start, stop in split.pieces]
    fig = draw_weight_splits(weights, pieces, num_ranks=3)
    fig.suptitle("One SmolLM2 layer over 3 ranks, to scale: rows = outputs, columns = inputs")
    save(fig, "tp_splits.png")


if __name__ == "__main__":
    for draw in (tokens, q4_1_block, decoder_block, reservations, kv_blocks, paged_layout,
                 online_softmax, sampling, scheduler_gantt, tp_splits):
        draw()
        print("drew", draw.__name__)
