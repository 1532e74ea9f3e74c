"""`huge_page_buffer`: memory on transparent huge pages for the kernels to stream.

A buffer is zeroed, writable, cache-line aligned and kept alive by any view of it; where the OS
has no `MADV_HUGEPAGE`, or refuses it, the buffer is ordinary memory.
"""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels.cpu.pages import HUGE_PAGE, huge_page_buffer

CACHE_LINE = 64


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3 * HUGE_PAGE))
def test_a_huge_page_buffer_is_zeroed_writable_and_outlives_its_mapping(nbytes):
    buffer = huge_page_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,)
    assert buffer.data_ptr() % CACHE_LINE == 0
    assert not buffer.any()
    view = buffer[nbytes // 2:]
    del buffer
    gc.collect()
    view.fill_(7)  # the mapping is alive while a view is
    assert int(view.sum()) == 7 * view.numel()


def test_a_huge_page_buffer_falls_back_to_ordinary_pages(monkeypatch):
    """Where the OS has no `MADV_HUGEPAGE`, or refuses it, the buffer is ordinary memory."""
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args: object) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    refused = huge_page_buffer(HUGE_PAGE + 5)
    assert refused.shape == (HUGE_PAGE + 5,) and not refused.any()
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE")
    plain = huge_page_buffer(100)
    assert plain.shape == (100,) and plain.dtype == torch.uint8 and not plain.any()
    plain.fill_(1)
    assert int(plain.sum()) == 100
