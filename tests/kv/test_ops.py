"""Paged KV pool operations against independent references: a plain double loop over blocks and offsets.

The references never use the slot formula or tensor indexing on the block table; they walk the table
block by block and copy one ``pool[block, offset]`` row at a time, so a wrong formula, a wrong cut at
``seq_len`` or a lost duplicate block id shows up as a mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv import ops, reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ref_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``[start, end)`` by walking every block and offset."""
    slots = []
    for index, block in enumerate(table):
        for offset in range(block_size):
            if start <= index * block_size + offset < end:
                slots.append(block * block_size + offset)
    return slots


def ref_gather(pool: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """Rows of positions ``[0, seq_len)``, copied one ``pool[block, offset]`` at a time."""
    block_size = pool.shape[1]
    rows = [pool[block, offset] for index, block in enumerate(table) for offset in range(block_size)]
    return torch.stack(rows[:seq_len]) if seq_len else pool.new_empty(0, *pool.shape[2:])


def batched_gather(pool: torch.Tensor, tables, seq_lens, block_size: int, out=None) -> torch.Tensor:
    """The engine's per-step read as one call: every request's context slots, then one gather."""
    slots = ops.batched_slot_mapping(tables, [0] * len(seq_lens), list(seq_lens), block_size)
    return ops.gather_slots(pool, slots, out=out)


def make_pool(num_blocks: int = 12, block_size: int = 4, heads: int = 2, dim: int = 3, dtype=torch.float32):
    # Distinct values everywhere, exact in every dtype used: any misplaced row is caught.
    values = torch.arange(num_blocks * block_size * heads * dim) % 2048
    return values.reshape(num_blocks, block_size, heads, dim).to(dtype)


def all_readers(pool: torch.Tensor, table, seq_len: int) -> dict[str, torch.Tensor]:
    block_size = pool.shape[1]
    listed = [int(b) for b in table]
    return {
        "gather_kv": reference.gather_kv(pool, table, seq_len, block_size),
        "loop": reference.gather_kv_loop(pool, listed, seq_len, block_size),
        "indexed": reference.gather_kv_indexed(pool, listed, seq_len, block_size),
        "slots": ops.gather_slots(pool, ops.slot_mapping(table, 0, seq_len, block_size)),
        "batched": batched_gather(pool, [listed], [seq_len], block_size),
        "reference": ref_gather(pool, listed, seq_len),
    }


def assert_all_equal(results: dict[str, torch.Tensor]) -> None:
    expected = results["reference"]
    for name, got in results.items():
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), f"{name} differs from the reference"


TABLES = {
    "sequential": [0, 1, 2, 3, 4],
    "shuffled": [7, 2, 11, 0, 5],
    "shared": [3, 3, 9, 3, 1],  # the same block id several times in one table
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("seq_len", [0, 1, 3, 4, 5, 13, 20])
def test_readers_agree(dtype, kind, seq_len):
    assert_all_equal(all_readers(make_pool(dtype=dtype), TABLES[kind], seq_len))


@pytest.mark.parametrize(
    "table",
    [
        torch.tensor([5, 1, 8, 2], dtype=torch.int32),
        torch.tensor([9, 0, 4, 0, 6, 2, 11, 3])[::2],  # a strided, non-contiguous view
        (10, 4, 6, 1),
    ],
    ids=["int32", "strided", "tuple"],
)
def test_table_types(table):
    assert_all_equal(all_readers(make_pool(), table, 14))


def test_gather_kv_returns_a_contiguous_copy():
    pool = make_pool()
    got = reference.gather_kv(pool, [2, 6], 5, 4)
    assert got.shape == (5, 2, 3) and got.is_contiguous()
    before = got.clone()
    pool.zero_()
    assert torch.equal(got, before)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 8), num_blocks=st.integers(1, 10))
def test_random_tables(data, block_size, num_blocks):
    table = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=6))
    seq_len = data.draw(st.integers(0, len(table) * block_size))
    start = data.draw(st.integers(0, seq_len))
    pool = make_pool(num_blocks, block_size, heads=1, dim=2)
    assert_all_equal(all_readers(pool, table, seq_len))
    got = ops.slot_mapping(table, start, seq_len, block_size)
    assert got.dtype == torch.int64
    assert got.tolist() == ref_slots(table, start, seq_len, block_size)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 8))
def test_batched_equals_per_request_concatenated(data, block_size):
    num_blocks = 8
    tables = data.draw(st.lists(st.lists(st.integers(0, num_blocks - 1), max_size=5), max_size=5))
    ends = [data.draw(st.integers(0, len(t) * block_size)) for t in tables]
    starts = [data.draw(st.integers(0, e)) for e in ends]
    pool = make_pool(num_blocks, block_size, heads=2, dim=2)

    slots = ops.batched_slot_mapping(tables, starts, ends, block_size)
    expected = [s for t, a, b in zip(tables, starts, ends, strict=True) for s in ref_slots(t, a, b, block_size)]
    assert slots.tolist() == expected
    per_request = [ops.slot_mapping(t, a, b, block_size) for t, a, b in zip(tables, starts, ends, strict=True)]
    assert torch.equal(slots, torch.cat(per_request) if per_request else torch.empty(0, dtype=torch.int64))

    gathered = batched_gather(pool, tables, ends, block_size)
    singles = [reference.gather_kv(pool, t, e, block_size) for t, e in zip(tables, ends, strict=True)]
    assert gathered.shape == (sum(ends), 2, 2)
    if singles:
        assert torch.equal(gathered, torch.cat(singles))


def test_batched_shares_blocks_across_requests():
    pool = make_pool()
    tables, seq_lens = [[4, 7, 1], [4, 7], [1]], [10, 6, 2]
    got = batched_gather(pool, tables, seq_lens, 4)
    assert torch.equal(got, torch.cat([ref_gather(pool, t, n) for t, n in zip(tables, seq_lens, strict=True)]))


@pytest.mark.parametrize("seq_len", [0, 1, 8, 11])
def test_out_buffer_is_filled_and_returned(seq_len):
    pool, table = make_pool(), [9, 2, 5]
    expected = ref_gather(pool, table, seq_len)
    out2 = torch.full((seq_len, 2, 3), -1.0)
    assert ops.gather_slots(pool, ops.slot_mapping(table, 0, seq_len, 4), out=out2) is out2
    assert torch.equal(out2, expected)
    out3 = torch.full((seq_len, 2, 3), -1.0)
    batched_gather(pool, [table], [seq_len], 4, out=out3)
    assert torch.equal(out3, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_round_trip(dtype):
    pool = torch.zeros(10, 4, 2, 3, dtype=dtype)
    table = [6, 0, 8]
    values = torch.randn(11, 2, 3).to(dtype)
    ops.write_kv(pool, ops.slot_mapping(table, 0, 7, 4), values[:7])  # a prefill chunk
    for pos in range(7, 11):  # then one decode token at a time
        ops.write_kv(pool, ops.slot_mapping(table, pos, pos + 1, 4).to(torch.int32), values[pos : pos + 1])
    assert torch.equal(reference.gather_kv(pool, table, 11, 4), values)
    assert torch.equal(ref_gather(pool, table, 11), values)


def test_batched_write_then_read_each_request():
    pool = torch.zeros(10, 4, 1, 2)
    tables, seq_lens = [[3, 1], [7], [0, 9, 5]], [6, 3, 10]
    values = torch.randn(sum(seq_lens), 1, 2)
    ops.write_kv(pool, ops.batched_slot_mapping(tables, [0, 0, 0], seq_lens, 4), values)
    got = [reference.gather_kv(pool, t, n, 4) for t, n in zip(tables, seq_lens, strict=True)]
    assert torch.equal(torch.cat(got), values)


def test_padding_slots_leave_the_pool_untouched():
    pool = make_pool()
    before = pool.clone()
    slots = torch.tensor([5, -1, 17, -1, 40])
    values = torch.randn(5, 2, 3)
    ops.write_kv(pool, slots, values)
    expected = before.view(-1, 2, 3).clone()
    for row, slot in enumerate(slots.tolist()):
        if slot != -1:
            expected[slot] = values[row]
    assert torch.equal(pool.view(-1, 2, 3), expected)
    ops.write_kv(pool, torch.full((3,), -1, dtype=torch.int32), torch.randn(3, 2, 3))
    assert torch.equal(pool.view(-1, 2, 3), expected)


def test_pad_block_tables():
    got = ops.pad_block_tables([[3, 1], [], [7, 8, 9]])
    assert got.dtype == torch.int64
    assert got.tolist() == [[3, 1, 0], [0, 0, 0], [7, 8, 9]]
    assert ops.pad_block_tables([[2]], width=4).tolist() == [[2, 0, 0, 0]]


POOL = make_pool()  # 12 blocks of 4 slots, [2, 3] per slot
ERRORS = {
    "block id too large": (lambda: reference.gather_kv(POOL, [0, 12], 5, 4), r"block ids must lie in \[0, 12\)"),
    "negative block id": (lambda: reference.gather_kv(POOL, [-1], 1, 4), r"block ids must lie in \[0, 12\)"),
    "batched block id": (lambda: batched_gather(POOL, [[1], [99]], [1, 1], 4), r"slot ids must lie in \[0, 48\)"),
    "seq_len beyond table": (lambda: reference.gather_kv(POOL, [1, 2], 9, 4), "needs 3 blocks but the block table"),
    "loop seq_len": (lambda: reference.gather_kv_loop(POOL, [1], 5, 4), "allocate more blocks"),
    "indexed seq_len": (lambda: reference.gather_kv_indexed(POOL, [1], 5, 4), "allocate more blocks"),
    "slot_mapping end": (lambda: ops.slot_mapping([1], 0, 5, 4), "needs 2 blocks"),
    "batched seq_len": (lambda: ops.batched_slot_mapping([[1]], [0], [5], 4), "needs 2 blocks"),
    "negative seq_len": (lambda: reference.gather_kv(POOL, [1], -1, 4), "seq_len must be >= 0"),
    "start after end": (lambda: ops.slot_mapping([1], 3, 2, 4), "0 <= start <= end"),
    "zero block_size": (lambda: ops.slot_mapping([1], 0, 1, 0), "block_size must be positive"),
    "float table tensor": (lambda: reference.gather_kv(POOL, torch.tensor([1.0]), 1, 4), "int32 or int64"),
    "float table list": (lambda: reference.gather_kv(POOL, [1.5], 1, 4), "must be a sequence of ints"),
    "2-D table": (lambda: reference.gather_kv(POOL, torch.zeros(1, 1, dtype=torch.int64), 1, 4), "must be 1-D"),
    "slot beyond pool": (
        lambda: ops.gather_slots(POOL, torch.tensor([3, 48])),
        r"slot ids must lie in \[0, 48\)",
    ),
    "negative slot": (
        lambda: ops.gather_slots(POOL, torch.tensor([-1])),
        "padding slots -1 are for writes only",
    ),
    "float slots": (lambda: ops.gather_slots(POOL, torch.tensor([1.0])), "slots must be a 1-D int32"),
    "wrong block_size": (lambda: reference.gather_kv(POOL, [1], 1, 8), r"block_size=8"),
    "3-D pool": (lambda: ops.gather_slots(POOL[0], torch.tensor([0])), "num_blocks, block_size"),
    "out shape": (
        lambda: ops.gather_slots(POOL, torch.tensor([1, 2, 3]), out=torch.empty(4, 2, 3)),
        r"shape \(3, 2, 3\)",
    ),
    "out dtype": (
        lambda: ops.gather_slots(POOL, torch.tensor([0]), out=torch.empty(1, 2, 3).half()),
        "out must",
    ),
    "batched lengths": (
        lambda: batched_gather(POOL, [[1]], [1, 1], 4),
        "block_tables, starts and ends must have the same length",
    ),
    "write float slots": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([0.0]), torch.zeros(1, 2, 3)),
        "slot_mapping must be a 1-D int32 or int64",
    ),
    "write shape": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([0]), torch.zeros(1, 3, 2)),
        r"\[num_tokens, 2, 3\]",
    ),
    "write dtype": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([0]), torch.zeros(1, 2, 3, dtype=torch.float64)),
        "cast first",
    ),
    "write rows vs slots": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([0, 1]), torch.zeros(3, 2, 3)),
        "3 value rows but 2 slots",
    ),
    "write slot beyond pool": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([48]), torch.zeros(1, 2, 3)),
        "beyond the pool's 48 slots",
    ),
    "write negative slot": (
        lambda: ops.write_kv(POOL.clone(), torch.tensor([-2]), torch.zeros(1, 2, 3)),
        "-1 for padding but no other negative",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_say_what_to_change(case):
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_failed_write_changes_nothing():
    pool = make_pool()
    before = pool.clone()
    with pytest.raises(ValueError):
        ops.write_kv(pool, torch.tensor([3, 48]), torch.ones(2, 2, 3))
    assert torch.equal(pool, before)


def test_only_the_blocks_within_seq_len_are_read():
    # A stale id past seq_len (e.g. a table slot not filled yet) is never read, so it is not an error.
    pool = make_pool()
    assert torch.equal(reference.gather_kv(pool, [3, 999], 4, 4), ref_gather(pool, [3], 4))
    assert torch.equal(batched_gather(pool, [[3, 999]], [4], 4), ref_gather(pool, [3], 4))


def test_large_shuffled_table_matches_reference():
    rng = random.Random(0)
    pool = torch.randn(64, 16, 3, 8)
    table = rng.sample(range(64), 40)
    assert_all_equal(all_readers(pool, table, 40 * 16 - 5))
