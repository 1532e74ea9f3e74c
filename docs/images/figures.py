"""Draw the layer pages' figures into docs/images/ with the notebooks' own pictures
(`teaching.pictures`), from the same toys and committed results the notebooks use.

Run `python docs/images/figures.py` after a picture or a toy changes; it takes a few seconds.
"""

from __future__ import annotations

import base64
import json
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
NOTEBOOKS = HERE.parents[1] / "notebooks"
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


def from_notebook(notebook: str, marker: str, name: str) -> None:
    """Copy the figure a notebook committed, the output of the one code cell whose source holds
    `marker`: the layer page shows the notebook's own picture, drawn once."""
    cells = json.loads((NOTEBOOKS / notebook).read_text(encoding="utf-8"))["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    if len(found) != 1:
        raise ValueError(f"{notebook}: {len(found)} code cells hold {marker!r}, not one")
    pngs = [o["data"]["image/png"] for o in found[0]["outputs"] if "image/png" in o.get(
        "data", {})]
    if len(pngs) != 1:
        raise ValueError(f"{notebook}: the cell with {marker!r} has {len(pngs)} figures")
    (HERE / name).write_bytes(base64.b64decode("".join(pngs[0])))


def notebook_figures() -> None:
    from_notebook("06_engine.ipynb", "draw_engine_trace(trace, free", "engine_trace.png")
    from_notebook("08_benchmarks.ipynb", 'latency_curves(axes[0], sim["sharegpt"]',
                  "latency_curves.png")
    from_notebook("09_serving.ipynb", "Four streams, one batch", "streams.png")


def flat_batch() -> None:
    """Layer 10's example: three sequences' new tokens in one flat batch, and the cache slots
    their keys and values go to (`block_table[pos // 4] * 4 + pos % 4`)."""
    block_size, num_blocks = 4, 8
    plan = {"A": (range(0, 5), [7, 2]), "B": (range(9, 10), [4, 0, 5]),
            "C": (range(3, 4), [1])}  # new positions, block table
    colours = {"A": "tab:blue", "B": "tab:orange", "C": "tab:green"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.8, 3.6), layout="constrained",
                                      height_ratios=[1, 1.3])
    column = 0
    for seq, (positions, table) in plan.items():
        for pos in positions:
            slot = table[pos // block_size] * block_size + pos % block_size
            top.add_patch(plt.Rectangle((column, 0), 0.95, 1, color=colours[seq], alpha=0.8))
            top.text(column + 0.47, 0.5, f"{seq.lower()}{pos}\npos {pos}\nslot {slot}",
                     ha="center", va="center", fontsize=8, color="white")
            bottom.add_patch(plt.Rectangle((slot, 0), 0.95, 1, color=colours[seq], alpha=0.8))
            bottom.text(slot + 0.47, 0.5, f"{seq.lower()}{pos}", ha="center", va="center",
                        fontsize=8, color="white")
            column += 1
        top.axvline(column - 0.025, color="k", lw=1.5)  # a query_start_loc boundary
    top.set(xlim=(0, column), ylim=(0, 1), yticks=[], xticks=[],
            title="The flat batch: 7 new tokens of 3 sequences, no padding "
                  "(black lines: query_start_loc)")
    for block in range(num_blocks + 1):
        bottom.axvline(block * block_size - 0.025, color="0.3", lw=0.8)
    bottom.set(xlim=(0, num_blocks * block_size), ylim=(0, 1), yticks=[],
               xticks=[b * block_size + 2 for b in range(num_blocks)],
               xticklabels=[f"block {b}" for b in range(num_blocks)],
               title="Where their keys and values go: slot_mapping into the paged cache")
    bottom.tick_params(axis="x", labelsize=8, length=0)
    save(fig, "flat_batch.png")


def commands() -> None:
    """Layer 15: each command, and the engine call it ends in."""
    rows = [("minipaged generate", "LLM.generate", "one completion per prompt, printed"),
            ("minipaged chat", "LLMEngine.stream", "chat template, tokens as they come"),
            ("minipaged serve", "the HTTP server -> LLMEngine", "OpenAI's endpoints, SSE")]
    fig, ax = plt.subplots(figsize=(8.8, 2.4), layout="constrained")
    for y, (command, call, what) in enumerate(reversed(rows)):
        for x, text, colour in ((0.0, command, "0.85"), (3.6, call, "tab:blue")):
            ax.add_patch(plt.Rectangle((x, y + 0.15), 3.0, 0.7, color=colour, alpha=0.8))
            ax.text(x + 1.5, y + 0.5, text, ha="center", va="center", fontsize=10,
                    family="monospace", color="k" if colour == "0.85" else "white")
        ax.annotate("", xy=(3.6, y + 0.5), xytext=(3.0, y + 0.5),
                    arrowprops=dict(arrowstyle="->", lw=1.5))
        ax.text(6.8, y + 0.5, what, va="center", fontsize=9)
    ax.set(xlim=(0, 10.5), ylim=(0, len(rows)), xticks=[], yticks=[],
           title="The command line: flags mirror SamplingParams and LLM; each command "
                 "ends in the engine")
    ax.axis("off")
    save(fig, "commands.png")


if __name__ == "__main__":
    for draw in (tokens, q4_1_block, decoder_block, reservations, kv_blocks, paged_layout,
                 online_softmax, sampling, scheduler_gantt, tp_splits, flat_batch, commands,
                 notebook_figures):
        draw()
        print("drew", draw.__name__)
