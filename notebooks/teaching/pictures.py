"""The notebooks' and the docs' pictures: each function draws one kind of figure with matplotlib
from the public state of the objects it shows (a KV manager's block tables, a step record, a
simulated run), so that a notebook cell reads as the idea and the call, not as drawing code.

Every figure is at most 9 inches wide, with a title, labelled axes where it has axes, legends
outside the data and text of at least 9 points (`FONT`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from teaching.steps import slot_lanes
from teaching.toy_blocks import ToyEngine

__all__ = [
    "FONT",
    "draw_block_tables",
    "draw_decoder_block",
    "draw_engine_trace",
    "draw_key_tiles",
    "draw_kv_state",
    "draw_paged_layout",
    "draw_slot_use",
    "draw_slots",
    "draw_weight_splits",
    "gantt",
    "latency_curves",
    "show_tokens",
]

FONT = 9  # points: the smallest text of any figure
SHARED = "#9e86c8"  # a block held by several sequences
SLOT_COLOURS = {  # the vLLM paper's Fig. 3 categories
    "token": "#55a868",
    "reserved": "#8172b3",
    "internal": "#dd8452",
    "external": "#c44e52",
    "free": "#e6e6e6",
}
SLOT_LABELS = {
    "token": "token states",
    "reserved": "reserved for later tokens",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "free": "free",
}


def owner_colours(names: Sequence[str]) -> dict[str, str]:
    """A colour per name, matplotlib's cycle in order (no purple: it marks shared blocks)."""
    cycle = ["C0", "C1", "C2", "C3", "C5", "C6", "C7", "C8", "C9"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


# -- tokens ---------------------------------------------------------------------------------------


def show_tokens(ax: Axes, labels: Sequence[str], special: Sequence[bool],
                line_height: float = 0.13) -> None:
    """Each token a box, left to right, wrapped at the axes' width; special tokens grey."""
    colours = ["#cfe2f3", "#fce5cd", "#d9ead3", "#ead1dc"]
    inches = ax.figure.get_figwidth() * ax.get_position().width
    cell = 0.6 * FONT / 72 / inches  # a monospace glyph is 0.6 em wide
    per_line = int(1 / cell)
    column, y = 0, 1.0
    for k, (label, grey) in enumerate(zip(labels, special, strict=True)):
        label = label.replace(" ", "·").replace("\n", "⏎")
        if column + len(label) > per_line:
            column, y = 0, y - line_height
        box = dict(boxstyle="square,pad=0.2", lw=0.5,
                   fc="#bbbbbb" if grey else colours[k % len(colours)])
        ax.text(column * cell, y, label, family="monospace", fontsize=FONT, va="top",
                bbox=box, transform=ax.transAxes)
        column += len(label) + 1
        if label.endswith("⏎"):
            column, y = 0, y - line_height
    ax.axis("off")


# -- the model ------------------------------------------------------------------------------------


def draw_decoder_block(ax: Axes, hidden: int, heads: int, kv_heads: int, mlp: int,
                       layers: int) -> None:
    """One pre-norm LLaMA decoder block, bottom to top, with its residual stream."""
    boxes = [
        (f"x  [T, {hidden}]", "#eeeeee"),
        ("RMSNorm", "#ffe6a7"),
        (f"q_proj  k_proj  v_proj\n{heads} query, {kv_heads} KV heads (GQA)", "#cde4ff"),
        ("rotary embedding on q, k", "#cde4ff"),
        ("attention backend(layer, q, k, v)\nstores k, v in the KV cache", "#b7e4c7"),
        ("o_proj", "#cde4ff"),
        ("+", "#ffffff"),
        ("RMSNorm", "#ffe6a7"),
        (f"down(silu(gate(x)) * up(x))\nSwiGLU, {hidden} -> {mlp}", "#f8c8dc"),
        ("+", "#ffffff"),
        (f"to the next block (x {layers}), then RMSNorm, lm_head", "#eeeeee"),
    ]
    for y, (label, colour) in enumerate(boxes):
        width = 0.5 if label == "+" else 4.2
        ax.add_patch(FancyBboxPatch((-width / 2, y - 0.3), width, 0.6, fc=colour, ec="black",
                                    lw=0.8, boxstyle="round,pad=0.05"))
        ax.text(0, y, label, ha="center", va="center", fontsize=FONT)
        if y:
            ax.annotate("", (0, y - 0.35), (0, y - 0.65),
                        arrowprops=dict(arrowstyle="->", lw=0.8))
    for start, end, x0 in ((0, 6, 2.1), (6, 9, 0.4)):  # the residual stream
        ax.plot([x0, 3.0, 3.0, 0.3], [start, start, end, end], color="tab:red", lw=1.2)
        ax.text(3.1, (start + end) / 2, "residual", color="tab:red", rotation=90,
                va="center", fontsize=FONT)
    ax.set_xlim(-2.6, 3.6)
    ax.set_ylim(10.6, -0.6)
    ax.axis("off")


# -- blocks ---------------------------------------------------------------------------------------


def draw_kv_state(toy: ToyEngine, title: str, show_host: bool = False) -> Figure:
    """A KV manager's state: each sequence's block table (left) and the physical pool(s), one
    column of slots per block, each slot showing the character it holds. A block is coloured by
    the one sequence that holds it, or purple and hatched when several share it."""
    manager = toy.manager
    seqs, size = manager.seq_ids(), manager.block_size
    colour = owner_colours(seqs)
    pools = [("GPU", manager.num_gpu_blocks, toy.device, manager.ref_count)]
    if show_host:
        pools.append(("CPU", manager.num_cpu_blocks, toy.host, manager.cpu_ref_count))
    fig, ax = plt.subplot_mosaic([["tables", name] for name, *_ in pools],
                                 figsize=(8.8, 0.9 + 1.6 * len(pools)),
                                 width_ratios=[1, 2.2], layout="constrained")
    tables = ax["tables"]
    for row, seq in enumerate(seqs):
        where = ", CPU" if manager.is_swapped(seq) else ""
        tables.text(-0.3, -row - 0.5, f"{seq} ({len(toy.text[seq])} tok{where})",
                    ha="right", va="center", fontsize=FONT)
        for i, block in enumerate(manager.block_table(seq)):
            tables.add_patch(Rectangle((i, -row - 0.9), 0.9, 0.8, color=colour[seq],
                                       alpha=0.45 if where else 0.9))
            tables.text(i + 0.45, -row - 0.5, block, ha="center", va="center",
                        color="white", fontsize=FONT, weight="bold")
    tables.set(xlim=(-4.5, 6), ylim=(-max(len(seqs), 1) - 0.2, 0.3))
    tables.set_title("block tables (logical -> physical)", fontsize=FONT + 1)
    for name, count, slots, refs in pools:
        owners: dict[int, set[str]] = {}
        fill: dict[int, int] = {}
        for seq in seqs:
            if manager.is_swapped(seq) != (name == "CPU"):
                continue
            for i, block in enumerate(manager.block_table(seq)):
                owners.setdefault(block, set()).add(seq)
                fill[block] = max(fill.get(block, 0), min(size, len(toy.text[seq]) - i * size))
        for block in range(count):
            held = owners.get(block, set())
            shared = refs(block) > 1
            face = SHARED if shared else colour[next(iter(held))] if held else "#eeeeee"
            for offset in range(size):
                ax[name].add_patch(Rectangle((block, -offset - 1), 0.92, 0.92, facecolor=face,
                                             alpha=0.85 if held else 1.0, edgecolor="white",
                                             hatch="//" if shared else None))
                slot = block * size + offset
                if held and offset < fill[block] and slot in slots:
                    ax[name].text(block + 0.46, -offset - 0.54, chr(slots[slot]), ha="center",
                                  va="center", fontsize=FONT)
            label = f"{block}\nx{refs(block)}" if shared else str(block)
            ax[name].text(block + 0.46, 0.15, label, ha="center", va="bottom", fontsize=FONT)
        ax[name].set(xlim=(-0.2, count + 0.2), ylim=(-size - 0.3, 1.6))
        ax[name].set_title(f"{name} pool: {count} blocks of {size} slots", fontsize=FONT + 1)
    for axes in ax.values():
        axes.axis("off")
    handles = [Patch(facecolor=colour[s], label=s) for s in seqs]
    handles.append(Patch(facecolor=SHARED, hatch="//", label="shared (x holders)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=FONT,
               frameon=False)
    fig.suptitle(title, fontsize=FONT + 2)
    return fig


def draw_slots(ax: Axes, slots: Sequence[tuple[str | None, str]], title: str,
               per_row: int = 32) -> None:
    """A pool of token slots, one square each, coloured by the vLLM paper's Fig. 3 categories
    (`toy_blocks.slot_categories`) and labelled by owner where a run of them starts."""
    for i, (owner, kind) in enumerate(slots):
        x, y = i % per_row, -(i // per_row)
        ax.add_patch(Rectangle((x, y), 0.94, 0.9, color=SLOT_COLOURS[kind]))
        if owner is not None and (i == 0 or slots[i - 1][0] != owner):
            ax.text(x + 0.1, y + 0.45, owner, fontsize=FONT, va="center", color="white",
                    weight="bold")
    rows = (len(slots) + per_row - 1) // per_row
    ax.set(xlim=(0, per_row), ylim=(-rows + 0.9 - 0.1, 1.0))
    ax.set_title(title, fontsize=FONT + 1, loc="left")
    ax.axis("off")


def slot_legend(fig: Figure, kinds: Sequence[str] = tuple(SLOT_COLOURS)) -> None:
    """The Fig. 3 categories as a legend under the figure."""
    handles = [Patch(color=SLOT_COLOURS[k], label=SLOT_LABELS[k]) for k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=FONT,
               frameon=False)


def block_holders(tables: Mapping[int, Sequence[int]]) -> Counter[int]:
    """How many of the given block tables hold each block."""
    return Counter(block for table in tables.values() for block in table)


def draw_paged_layout(seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                      block_size: int, num_blocks: int) -> Figure:
    """Sequences' logical blocks (left) and where their tokens lie in the physical pool (right),
    one colour per sequence; grey slots belong to no sequence."""
    colours = owner_colours([str(s) for s in range(len(seq_lens))])
    fig, (left, pool) = plt.subplots(1, 2, figsize=(8.8, 3.9), width_ratios=[1, 1.2],
                                     layout="constrained")
    width = max(map(len, block_tables))
    for s, (n, blocks) in enumerate(zip(seq_lens, block_tables, strict=True)):
        for j, block in enumerate(blocks):
            filled = min(block_size, n - j * block_size)
            left.add_patch(Rectangle((j, -s - 0.4), filled / block_size, 0.8,
                                     color=colours[str(s)]))
            left.add_patch(Rectangle((j, -s - 0.4), 1, 0.8, fill=False, ec="k"))
            left.text(j + 0.5, -s, f"logical {j}\n-> block {block}", ha="center",
                      va="center", fontsize=FONT)
    left.set(xlim=(-0.1, width + 0.1), ylim=(-len(seq_lens) + 0.4, 0.6), xticks=[],
             xlabel="logical blocks, filled up to the sequence's length")
    left.set_yticks([-s for s in range(len(seq_lens))],
                    [f"seq {s} ({n} tok)" for s, n in enumerate(seq_lens)])
    left.set_title("block tables", fontsize=FONT + 1)
    owner = {}
    for s, (n, blocks) in enumerate(zip(seq_lens, block_tables, strict=True)):
        for position in range(n):
            owner[blocks[position // block_size], position % block_size] = str(s)
    for block in range(num_blocks):
        for offset in range(block_size):
            face = colours.get(owner.get((block, offset), ""), "0.85")
            pool.add_patch(Rectangle((offset, -block - 0.45), 0.95, 0.9, color=face))
    pool.set(xlim=(0, block_size), ylim=(-num_blocks + 0.4, 0.6), xlabel="slot in the block")
    pool.set_yticks([-b for b in range(num_blocks)], [f"block {b}" for b in range(num_blocks)])
    pool.set_xticks(range(block_size))
    pool.set_title("physical pool (grey: free or past a sequence's end)", fontsize=FONT + 1)
    return fig


def draw_key_tiles(block_table: Sequence[int], block_size: int, key_tile: int, seq_len: int,
                   num_blocks: int) -> Figure:
    """One sequence's keys coloured by the key tile that reads them (left, in logical order)
    and where they lie in the physical pool (right)."""
    colours = plt.get_cmap("tab10").colors
    fig, (logical, pool) = plt.subplots(1, 2, figsize=(8.8, 3.4), width_ratios=[1.2, 1],
                                        layout="constrained")
    for p in range(len(block_table) * block_size):
        face = colours[p // key_tile] if p < seq_len else "0.9"
        logical.add_patch(Rectangle((p, 0), 1, 1, color=face, ec="w"))
        block, slot = block_table[p // block_size], p % block_size
        pool.add_patch(Rectangle((slot, block), 1, 1, color=face, ec="w"))
    for block in range(num_blocks):
        if block in block_table:
            pool.text(-0.2, block + 0.5, f"logical {block_table.index(block)}", ha="right",
                      va="center", fontsize=FONT)
        else:
            pool.add_patch(Rectangle((0, block), block_size, 1, color="0.45", ec="w"))
    logical.set(xlim=(0, len(block_table) * block_size), ylim=(0, 1), yticks=[],
                xlabel="logical key position", title=f"the context, {key_tile} keys per tile "
                "(light grey: past the end, masked)")
    pool.set(xlim=(-3.2, block_size), ylim=(0, num_blocks), xlabel="slot in block",
             ylabel="physical block", title="where they lie (dark: other sequences' blocks)")
    pool.set_xticks(range(0, block_size + 1, 2))
    for axes in (logical, pool):
        axes.title.set_fontsize(FONT + 1)
    return fig


def draw_engine_trace(records: Sequence[object], free_blocks: Sequence[int],
                      num_blocks: int) -> Figure:
    """An engine's steps (`StepRecord`s, with the free blocks after each): the tokens each
    request computed in each step, stacked (a prefill or a recomputation is a tall bar, a
    decode one token), red crosses where a request was preempted; below, the blocks each
    request held."""
    requests = sorted({w.request_id for r in records for w in r.scheduled})
    colour = owner_colours(requests)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.8, 5.2), sharex=True,
                                      height_ratios=[1.2, 1], layout="constrained")
    for record in records:
        base = 0
        for work in record.scheduled:
            top.bar(record.index, work.num_new_tokens, bottom=base, width=0.9,
                    color=colour[work.request_id], hatch="//" if work.is_prefill else None,
                    edgecolor="white", linewidth=0.3)
            base += work.num_new_tokens
        if record.plan.preempted:
            top.plot(record.index, 3, "x", color="#c44e52", ms=10, mew=2.5)
    top.set_yscale("symlog", linthresh=4)
    top.set(ylabel="tokens computed\n(log scale)",
            title="Tokens each request computed per step (hatched: a prompt, the first time or "
                  "again after a preemption; x: preempted)")
    top.title.set_fontsize(FONT + 1)
    tables = [{w.request_id: w.block_table for w in r.scheduled} for r in records]
    steps = [r.index for r in records]
    for request in requests:
        bottom.step(steps, [len(t.get(request, ())) for t in tables], where="mid",
                    color=colour[request], label=request)
    (in_use,) = bottom.plot(steps, [num_blocks - f for f in free_blocks], "k:",
                            label="blocks in use after the step")
    bottom.axhline(num_blocks, color="grey", lw=0.8)
    bottom.set(ylabel="KV blocks held", xlabel="engine step", ylim=(0, num_blocks + 0.8))
    fig.legend(handles=[Patch(color=colour[r], label=r) for r in requests] + [in_use],
               loc="outside lower center", ncol=len(requests) + 1,
               fontsize=FONT, frameon=False)
    return fig


IDLE = "#f0f0f0"  # a batch slot that computed nothing


def draw_slot_use(runs: Mapping[str, Sequence[object]], num_slots: int) -> Figure:
    """Each run's steps (`StepRecord`s) as its batch's slots over time, one panel per run on
    one step axis: a cell per (step, slot), coloured by the request the slot computed for, grey
    and hatched where it computed nothing (`teaching.steps.slot_lanes`). Each panel's
    title gives its steps and idle slot-steps."""
    grids = {name: slot_lanes(records, num_slots) for name, records in runs.items()}
    requests = sorted({r for grid in grids.values() for row in grid for r in row if r})
    colour = owner_colours(requests)
    fig, axes = plt.subplots(len(runs), 1, figsize=(8.8, 1.1 + 1.1 * len(runs) * num_slots / 3),
                             sharex=True, layout="constrained", squeeze=False)
    for ax, (name, grid) in zip(axes[:, 0], grids.items(), strict=True):
        for step, row in enumerate(grid):
            for slot, request in enumerate(row):
                ax.add_patch(Rectangle((step - 0.45, slot + 0.05), 0.9, 0.9,
                                       facecolor=colour[request] if request else IDLE,
                                       hatch=None if request else "///", edgecolor="#bbbbbb",
                                       linewidth=0.3))
        idle = sum(row.count(None) for row in grid)
        ax.set_title(f"{name}: {len(grid)} steps, {idle} idle slot-steps", fontsize=FONT + 1)
        ax.set_yticks([s + 0.5 for s in range(num_slots)], [str(s + 1) for s in range(num_slots)])
        ax.set_ylim(0, num_slots)
        ax.set_ylabel("batch slot", fontsize=FONT)
        ax.tick_params(labelsize=FONT)
    longest = max(len(grid) for grid in grids.values())
    axes[-1, 0].set(xlim=(-0.7, longest - 0.3), xlabel="engine step")
    handles = [Patch(color=colour[r], label=r) for r in requests]
    handles.append(Patch(facecolor=IDLE, hatch="///", edgecolor="#bbbbbb", label="idle slot"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=FONT,
               frameon=False)
    return fig


def draw_block_tables(ax: Axes, tables: Mapping[object, Sequence[int]], title: str) -> None:
    """Sequences' block tables side by side, each block labelled with its id and how many of
    the sequences hold it; a block held by several is solid purple, one held alone pale."""
    holders = block_holders(tables)
    for row, (seq, table) in enumerate(tables.items()):
        ax.text(-0.3, -row - 0.5, f"seq {seq}", ha="right", va="center", fontsize=FONT)
        for i, block in enumerate(table):
            shared = holders[block] > 1
            ax.add_patch(Rectangle((i, -row - 0.9), 0.9, 0.8,
                                   color=SHARED if shared else "#d9d9d9"))
            ax.text(i + 0.45, -row - 0.5, f"{block}\nx{holders[block]}", ha="center",
                    va="center", fontsize=FONT)
    width = max(len(t) for t in tables.values())
    ax.set(xlim=(-2.2, width + 0.2), ylim=(-len(tables) - 0.2, 0.2))
    ax.set_title(title, fontsize=FONT + 1)
    ax.axis("off")


def gantt(ax: Axes, run: object, title: str, cost: object = None) -> None:
    """A simulated run (`minipaged.sim.simulate(..., record_steps=True)`) as a Gantt chart: one
    row per job, a bar per step it ran in, prefills hatched, a tick at its arrival. With the
    run's `cost` model: in grey the part of a step spent waiting on swaps (beyond its compute),
    and a dotted line at each step that swapped blocks ahead of time."""
    from minipaged.sched.cost_model import step_shape

    for step in run.steps:
        begin = step.start
        if cost is not None:
            begin = step.end - cost.step_time(step_shape(step.scheduled))
            if step.plan.num_swap_blocks_ahead:
                ax.axvline(step.start, color="k", linestyle=":", linewidth=1)
        for work in step.scheduled:
            row = int(work.request_id)
            if begin > step.start:
                ax.barh(row, begin - step.start, left=step.start, color="0.6")
            ax.barh(row, step.end - begin, left=begin, color=f"C{row}", edgecolor="white",
                    hatch="///" if work.is_prefill else None, linewidth=0.5)
    for request in run.requests:
        ax.plot(request.arrival_time, int(request.request_id), "k|", markersize=14)
    ax.set_yticks(range(len(run.requests)), [f"job {r.request_id}" for r in run.requests])
    ax.invert_yaxis()
    ax.set_title(f"{title}: mean JCT {run.mean_jct:.1f}", fontsize=FONT + 1)


# The vLLM paper's systems, in the order of its figures, and one colour each.
SYSTEM_COLOURS = {"static": "tab:gray", "orca-max": "tab:red", "orca-pow2": "tab:orange",
                  "orca-oracle": "tab:green", "paged": "tab:blue"}


def latency_curves(ax: Axes, curves: Mapping[str, Sequence[Mapping[str, float]]], bound: float,
                   title: str, xmax: float | None = None) -> None:
    """Normalized latency against request rate, one line per system (the vLLM paper's Fig. 12
    and 16), with the latency bound dotted; the y axis stops at 5x the bound."""
    for system, points in curves.items():
        ax.plot([p["rate"] for p in points], [p["normalized_latency"] for p in points], "o-",
                ms=3, color=SYSTEM_COLOURS.get(system), label=system)
    ax.axhline(bound, ls=":", color="k", lw=1)
    ax.set_ylim(0, 5 * bound)
    if xmax:
        ax.set_xlim(0, xmax)
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)")
    ax.set_title(title, fontsize=FONT + 1)


def draw_weight_splits(weights: Mapping[str, tuple[int, int]],
                       pieces: Mapping[str, Sequence[tuple[int, int, int]]],
                       num_ranks: int) -> Figure:
    """Weight matrices drawn to scale side by side (`nn.Linear`'s `(out, in)` layout: rows are
    outputs, columns inputs), each band coloured by the rank that holds it. `pieces` gives per
    weight its bands as `(rank, dim, start, stop)`: rows `start:stop` when `dim` is 0, columns
    when it is 1."""
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    fig, ax = plt.subplots(figsize=(8.8, 3.6), layout="constrained")
    x, gap = 0, 150
    for name, (rows, cols) in weights.items():
        for rank, dim, start, stop in pieces[name]:
            box = (Rectangle((x, start), cols, stop - start) if dim == 0
                   else Rectangle((x + start, 0), stop - start, rows))
            box.set(color=colours[rank % len(colours)], alpha=0.85, ec="white", lw=0.5)
            ax.add_patch(box)
        ax.add_patch(Rectangle((x, 0), cols, rows, fill=False, ec="k", lw=0.8))
        ax.text(x + cols / 2, -30, f"{name}\n{rows} x {cols}", ha="center", va="bottom",
                fontsize=FONT)
        x += cols + gap
    tallest = max(rows for rows, _ in weights.values())
    ax.set(xlim=(-gap / 2, x - gap / 2), ylim=(tallest + 60, -330), aspect="equal")
    ax.axis("off")
    fig.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(num_ranks)],
               loc="outside lower center", ncol=num_ranks, fontsize=FONT, frameon=False)
    return fig
