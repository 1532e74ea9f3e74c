"""Draw docs/images/layers.svg, the home page's picture of the stack: one row per layer of
docs/architecture.md (the first at the bottom), its subpackage and its notebooks.

Run `python docs/images/layers.py` after the layers change; the SVG uses no external fonts.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

# (number, title, subpackage, notebooks, group): the table of docs/architecture.md.
LAYERS = [
    (1, "Tokenizer", "minipaged/tokenizer/", ["01"], "model"),
    (2, "Checkpoints", "minipaged/models/checkpoint/", ["02"], "model"),
    (3, "Models", "minipaged/models/", ["02"], "model"),
    (4, "KV cache manager", "minipaged/kv/", ["03"], "paged"),
    (5, "Paged attention", "minipaged/attention/", ["04"], "paged"),
    (6, "Kernels", "kernels/", ["05"], "paged"),
    (7, "Platforms", "minipaged/platforms/", ["05"], "paged"),
    (8, "Sampling", "minipaged/sampling/", ["06"], "serving"),
    (9, "Scheduling", "minipaged/sched/", ["07"], "mlfq"),
    (10, "Model runner", "minipaged/runner/", ["06"], "serving"),
    (11, "Tensor parallelism", "minipaged/runner/parallel/", ["10"], "serving"),
    (12, "Engine", "minipaged/engine/", ["06"], "serving"),
    (13, "Simulator", "minipaged/sim/", ["07", "08"], "mlfq"),
    (14, "Serving", "minipaged/server/", ["09"], "serving"),
    (15, "Command line", "minipaged/__main__.py", ["06"], "serving"),
    (16, "Test oracles", "minipaged/testing/", ["04"], "oracle"),
]
# group: (fill, stroke, legend)
GROUPS = {
    "model": ("#eceff1", "#78909c", "the model: text in, logits out"),
    "paged": ("#e0f2f1", "#26a69a", "PagedAttention (the vLLM paper)"),
    "serving": ("#e8eaf6", "#5c6bc0", "serving: batching, sampling, the API"),
    "mlfq": ("#fff3e0", "#fb8c00", "scheduling: FCFS and skip-join MLFQ (FastServe)"),
    "oracle": ("#ffffff", "#90a4ae", "the oracles tests compare against"),
}
SANS = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Helvetica, Arial, sans-serif"
MONO = "Menlo, Consolas, 'DejaVu Sans Mono', monospace"
ROW, GAP, TOP, LEFT, WIDTH = 28, 5, 22, 50, 470  # pixels
INK, AXIS = "#263238", "#546e7a"


def svg() -> str:
    bottom = TOP + len(LAYERS) * (ROW + GAP) - GAP
    legend_top = bottom + 16
    height = legend_top + 3 * 24 + 4
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 690 {height}" width="690" '
        f'height="{height}" font-family="{SANS}" role="img" aria-labelledby="title">',
        '<title id="title">The sixteen layers of minipaged, in reading order from the bottom, '
        "each a subpackage, with its notebooks</title>",
        '<defs><marker id="head" viewBox="0 0 10 10" refX="5" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="{AXIS}"/></marker></defs>',
        f'<line x1="22" y1="{bottom}" x2="22" y2="{TOP - 4}" stroke="{AXIS}" stroke-width="2" '
        'marker-end="url(#head)"/>',
        f'<text x="14" y="{(TOP + bottom) / 2}" transform="rotate(-90 14 {(TOP + bottom) / 2})" '
        f'text-anchor="middle" font-size="13" fill="{AXIS}">the order of the ideas, from the '
        "bottom</text>",
        f'<text x="572" y="14" text-anchor="middle" font-size="12" fill="{AXIS}">notebook</text>',
    ]
    for row, (number, title, package, notebooks, group) in enumerate(reversed(LAYERS)):
        fill, stroke, _ = GROUPS[group]
        y = TOP + row * (ROW + GAP)
        base = y + ROW / 2 + 5
        dash = ' stroke-dasharray="4 3"' if group == "oracle" else ""
        out += [
            f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW}" rx="4" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="1.5"{dash}/>',
            f'<text x="78" y="{base}" text-anchor="end" font-size="14" font-weight="bold" '
            f'fill="{stroke}">{number}</text>',
            f'<text x="90" y="{base}" font-size="14" fill="{INK}">{escape(title)}</text>',
            f'<text x="508" y="{base}" text-anchor="end" font-size="13" font-family="{MONO}" '
            f'fill="#455a64">{escape(package)}</text>',
        ]
        for i, notebook in enumerate(notebooks):
            x = 536 + 40 * i
            out += [
                f'<rect x="{x}" y="{y + 3}" width="34" height="{ROW - 6}" rx="11" fill="#ffffff" '
                f'stroke="{stroke}" stroke-width="1.5"/>',
                f'<text x="{x + 17}" y="{base - 0.5}" text-anchor="middle" font-size="13" '
                f'fill="{INK}">{notebook}</text>',
            ]
    for i, (fill, stroke, label) in enumerate(GROUPS.values()):
        x, y = (LEFT, 340)[i % 2], legend_top + 24 * (i // 2)
        dash = ' stroke-dasharray="4 3"' if label.startswith("the oracles") else ""
        out += [
            f'<rect x="{x}" y="{y}" width="16" height="16" rx="3" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="1.5"{dash}/>',
            f'<text x="{x + 22}" y="{y + 13}" font-size="13" fill="{INK}">{escape(label)}</text>',
        ]
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    Path(__file__).with_name("layers.svg").write_text(svg(), encoding="utf-8")
