"""Every picture the notebooks and the docs draw renders, with its text at least 9 points."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minipaged.kv import KVCacheManager  # noqa: E402
from teaching import pictures  # noqa: E402
from teaching.toy_blocks import ToyEngine, slot_categories  # noqa: E402


def smallest_text(fig) -> float:
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]
    return min(t.get_fontsize() for t in texts)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_the_kv_state_marks_shared_blocks_apart_from_owners():
    toy = ToyEngine(KVCacheManager(num_gpu_blocks=6, block_size=2, num_cpu_blocks=4))
    toy.admit("A", "abc")
    toy.compute("A")
    toy.fork("A", "B")
    fig = pictures.draw_kv_state(toy, "fork", show_host=True)
    assert fig.get_figwidth() <= 9
    assert smallest_text(fig) >= pictures.FONT
    shared = [p for p in fig.axes[1].patches if p.get_hatch() == "//"]
    assert len(shared) == 2 * 2  # two blocks of two slots, held by A and B


def test_slots_paged_layout_key_tiles_and_weight_splits_render():
    fig, ax = plt.subplots(figsize=(9, 1))
    manager = KVCacheManager(num_gpu_blocks=4, block_size=2)
    manager.allocate("A", [1, 2, 3])
    pictures.draw_slots(ax, slot_categories(manager), "A", per_row=8)
    pictures.slot_legend(fig)
    figures = [
        fig,
        pictures.draw_paged_layout([5, 3], [[1], [0]], block_size=8, num_blocks=2),
        pictures.draw_key_tiles([1, 0], block_size=4, key_tile=4, seq_len=7, num_blocks=3),
        pictures.draw_weight_splits({"w": (4, 2)}, {"w": [(0, 0, 0, 2), (1, 0, 2, 4)]}, 2),
    ]
    for figure in figures:
        assert figure.get_figwidth() <= 9
        assert smallest_text(figure) >= pictures.FONT


def test_token_boxes_wrap_at_the_axes_width():
    fig, ax = plt.subplots(figsize=(4, 2))
    pictures.show_tokens(ax, ["word"] * 30, [False] * 30)
    rows = {round(t.get_position()[1], 3) for t in ax.texts}
    assert len(rows) > 1
