"""Sliding-window attention (a query at position p sees keys (p - window, p]) on both backends, against a naive
float64 reference: windows narrower than a block, than a tile, across the kernel's 512-key partitions and
wider than the context; the kernel's bits stay independent of chunking and neighbours, and window 0 is the
whole context, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernel_ops
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.kv import ops, reference
from tests.attention.test_kernel import MIXED_STEP, PARTITION, Step, built, kernel  # noqa: F401 (built: a fixture)

WINDOWS = [1, 5, 16, 100, PARTITION - 1, PARTITION, PARTITION + 1, 700, 5000]


def attend(backend, step: Step, window: int) -> torch.Tensor:
    """One windowed layer's attention of ``step``, as the model runs it (the step's K/V written first)."""
    meta = backend.build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    k, v = ops.gather_slots(step.k_pool, meta.slot_mapping), ops.gather_slots(step.v_pool, meta.slot_mapping)
    return backend.forward(step.q, k, v, step.k_pool, step.v_pool, meta, step.scale, window)


def naive(step: Step, window: int) -> torch.Tensor:
    """Row by row in float64: keys (position - window, position] read with the loop gather, softmax written out."""
    group = step.q.shape[1] // step.k_pool.shape[2]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    row = 0
    for table, query_len, seq_len in zip(step.tables, step.query_lens, step.seq_lens, strict=True):
        k = reference.gather_kv_loop(step.k_pool, table, seq_len, step.block_size).double().repeat_interleave(group, 1)
        v = reference.gather_kv_loop(step.v_pool, table, seq_len, step.block_size).double().repeat_interleave(group, 1)
        for position in range(seq_len - query_len, seq_len):
            keys = slice(max(0, position - window + 1), position + 1)
            scores = torch.einsum("hd,khd->hk", step.q[row].double(), k[keys]) * step.scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(1), v[keys])
            row += 1
    return out


def windowed_kernel(step: Step, window: int) -> torch.Tensor:
    meta = KernelAttention().build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    return kernel_ops.paged_attention(
        step.q, step.k_pool, step.v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, step.scale, window
    )


@pytest.mark.parametrize("window", WINDOWS)
def test_torch_backend_matches_naive_math(window):
    step = Step(**MIXED_STEP, seed=window)
    torch.testing.assert_close(attend(TorchAttention(), step, window).double(), naive(step, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("kv_heads", "group", "dim", "block_size"), [(3, 3, 64, 16), (2, 2, 32, 4), (1, 4, 128, 8)])
def test_kernel_matches_naive_math(built, window, kv_heads, group, dim, block_size):  # noqa: F811
    step = Step(**MIXED_STEP, kv_heads=kv_heads, group=group, dim=dim, block_size=block_size, seed=window)
    torch.testing.assert_close(attend(KernelAttention(), step, window).double(), naive(step, window), atol=1e-5, rtol=0)


def test_kernel_on_a_half_pool_matches_the_widened_values(built):  # noqa: F811
    step = Step(**MIXED_STEP, seed=3)
    wide = step.sub(range(len(step.seq_lens)))
    step.k_pool, step.v_pool = step.k_pool.half(), step.v_pool.half()
    wide.k_pool, wide.v_pool = step.k_pool.float(), step.v_pool.float()
    assert torch.equal(windowed_kernel(step, 100), windowed_kernel(wide, 100))


def test_window_zero_is_the_whole_context_bit_for_bit(built):  # noqa: F811
    step = Step(**MIXED_STEP, seed=4)
    assert torch.equal(windowed_kernel(step, 0), kernel(step))


@pytest.mark.parametrize("window", [8, 100, 600])
def test_chunks_and_neighbours_do_not_change_a_bit(built, window):  # noqa: F811
    """Each row alone (a decode at its position), in one chunk, and in a batch with other requests."""
    length = 1300
    step = Step([length, 300], [length, 300], seed=window)
    whole = windowed_kernel(step, window)
    alone = step.sub([0], query_lens=[length], seq_lens=[length], q=step.q[:length])
    torch.testing.assert_close(windowed_kernel(alone, window), whole[:length], atol=0, rtol=0)
    for position in (0, 7, window, PARTITION - 1, PARTITION, PARTITION + window, 1023, 1024, length - 1):
        one = step.sub([0], query_lens=[1], seq_lens=[position + 1], q=step.q[position : position + 1])
        assert torch.equal(windowed_kernel(one, window)[0], whole[position]), position
    start, end = 480, 560
    chunk = step.sub([0], query_lens=[end - start], seq_lens=[end], q=step.q[start:end])
    assert torch.equal(windowed_kernel(chunk, window), whole[start:end])


def test_a_negative_window_is_refused(built):  # noqa: F811
    with pytest.raises(ValueError, match="window"):
        windowed_kernel(Step([10], seed=0), -1)
