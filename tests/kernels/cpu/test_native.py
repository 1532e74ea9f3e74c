"""The native CPU paged-decode kernel against the dense oracle, its refusals and its build.

The kernel is specialised at compile time for head dims 64 and 128 with up to 8 query heads per
KV head, and generic otherwise, so the cases draw both: odd head dims, groups up to its limit of
64, blocks of one token to 32, decodes of a subset of the batch's sequences in any order (the
other rows of `out` must stay as they were), float32 and bfloat16, on one thread and on two
(OpenMP). Keys and values in slots no sequence owns are NaN: reading one shows in the output.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.attention.contract import dense_attention
from minipaged.kernels.cpu.native import (
    MAX_GROUP,
    SOURCE,
    build_native_decode,
    native_decode_available,
    native_decode_supports,
    paged_decode,
)
from minipaged.testing.paged_examples import tolerance

SENTINEL = 12345.0  # `out`'s rows the kernel must leave alone


@st.composite
def decode_batches(draw: st.DrawFn):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, MAX_GROUP]))
    head_dim = draw(st.sampled_from([8, 24, 64, 80, 128]))
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    seq_lens = draw(st.lists(st.integers(1, 70), min_size=1, max_size=5))
    decoded = draw(st.permutations(range(len(seq_lens))))
    decoded = decoded[: draw(st.integers(1, len(seq_lens)))]
    seed = draw(st.integers(0, 2**16))
    return dtype, num_kv_heads * group, num_kv_heads, head_dim, block_size, seq_lens, decoded, seed


def make_batch(num_heads, num_kv_heads, head_dim, block_size, seq_lens, seed, dtype):
    """A paged cache holding each sequence's K/V in shuffled blocks, NaN everywhere else, and
    one query row per sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        for j in range(blocks[s]):
            block = order.pop()
            tables[s, j] = block
            part = slice(j * block_size, min(n, (j + 1) * block_size))
            k_cache[block, : part.stop - part.start] = k[part]
            v_cache[block, : part.stop - part.start] = v[part]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, keys, values


def test_the_kernel_is_built_on_this_machine():
    assert native_decode_available()  # a compiler is on every machine the project runs on


@given(batch=decode_batches(), threads=st.sampled_from([1, 2]))
@settings(max_examples=60, deadline=None)
def test_equals_dense_attention(batch, threads):
    dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, decoded, seed = batch
    q, k_cache, v_cache, tables, keys, values = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, seq_lens, seed, dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, SENTINEL)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    rows = torch.tensor(decoded, dtype=torch.int32)  # sequence s decodes q's row s
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_decode(out, q, k_cache, v_cache, tables, lens, rows, rows, scale)
    finally:
        torch.set_num_threads(previous)
    for s in range(len(seq_lens)):
        if s in decoded:
            expected = dense_attention(q[s : s + 1], keys[s], values[s], scale)[0]
            torch.testing.assert_close(out[s], expected, **tolerance(dtype))
        else:
            assert bool((out[s] == SENTINEL).all())


def test_refuses_what_it_cannot_take():
    q, k_cache, v_cache, tables, _, _ = make_batch(4, 2, 16, 4, [5, 3], 0, torch.float32)
    lens, rows = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="block_tables must be a contiguous int32"):
        paged_decode(out, q, k_cache, v_cache, tables.long(), lens, rows, rows, 0.25)
    with pytest.raises(ValueError, match="q must be contiguous"):
        paged_decode(out, q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache,
                     tables, lens, rows, rows, 0.25)
    half = k_cache.half()
    assert not native_decode_supports(half)
    with pytest.raises(ValueError, match="native decode kernel takes"):
        paged_decode(out.half(), q.half(), half, half, tables, lens, rows, rows, 0.25)
    wide = torch.zeros(1, 4, 1, 16)
    assert native_decode_supports(wide, MAX_GROUP) and not native_decode_supports(
        wide, MAX_GROUP + 1
    )


def test_builds_once_per_key_into_its_cache(tmp_path: Path):
    first = build_native_decode(cache_dir=tmp_path)
    assert first is not None and first.parent == tmp_path and first.stat().st_size > 0
    built_at = first.stat().st_mtime_ns
    again = build_native_decode(cache_dir=tmp_path)
    assert again == first and again.stat().st_mtime_ns == built_at  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind
    assert SOURCE.exists()


def test_without_a_compiler_there_is_no_build(tmp_path: Path, caplog):
    assert build_native_decode(compiler="no-such-compiler-here", cache_dir=tmp_path) is None
    assert "no C compiler" in caplog.text
    assert not any(tmp_path.iterdir())


def test_a_compiler_without_openmp_still_builds_it(tmp_path: Path):
    """Apple's clang, say, refuses -fopenmp: the kernel is built without it (one thread)."""
    import ctypes
    import shutil

    no_openmp = tmp_path / "cc"
    no_openmp.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported: -fopenmp" >&2; exit 1; }; '
        "done\n"
        f'exec {shutil.which("cc")} "$@"\n'
    )
    no_openmp.chmod(0o755)
    built = build_native_decode(compiler=os.fspath(no_openmp), cache_dir=tmp_path / "cache")
    assert built is not None and built.exists()
    assert hasattr(ctypes.CDLL(os.fspath(built)), "paged_decode")


def test_a_failing_build_leaves_nothing(tmp_path: Path, caplog):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    failing.chmod(0o755)
    cache = tmp_path / "cache"
    assert build_native_decode(compiler=os.fspath(failing), cache_dir=cache) is None
    assert "broken" in caplog.text
    assert not any(cache.iterdir())


def test_profiles_under_its_own_name():
    from torch.profiler import ProfilerActivity, profile

    from minipaged.kernels.cpu.native import PROFILER_NAME

    q, k_cache, v_cache, tables, _, _ = make_batch(4, 2, 16, 4, [5, 3], 0, torch.float32)
    lens, rows = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged_decode(torch.empty_like(q), q, k_cache, v_cache, tables, lens, rows, rows, 0.25)
    assert PROFILER_NAME in {event.key for event in prof.key_averages()}


def test_loading_it_leaves_the_processs_floating_point_alone():
    """Linked with -ffast-math, a library's constructor would flush subnormals to zero in the
    whole process (every later float computation of the user's)."""
    assert native_decode_available()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 subnormal
    assert float(tiny * 1.0) > 0.0 and float(tiny + tiny) > 0.0
    import numpy as np

    assert np.float32(1e-39) * np.float32(1.0) > 0.0
