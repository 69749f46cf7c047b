"""The attention backends: the compiled paged attention kernel and the torch backend against a naive float64
reference, through the same ``build_metadata`` + ``forward`` calls a layer makes; the kernel's batch invariance,
bit for bit; its input checks; and the backend choice (argument / environment / fallback when the kernel cannot
be built)."""

from __future__ import annotations

import logging
import os
import random
import shutil
import time

import pytest
import torch

from pagedkv import kernel_ops, kernels
from pagedkv.attention.paged import ENV_VAR, KernelAttention, TorchAttention, select_backend
from pagedkv.config import EngineConfig
from pagedkv.extension import cache_root, prebuilt_directory
from pagedkv.kv import ops, reference

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler here: the kernel cannot be built")
MIXED_LENS = [1, 15, 17, 100, 1000, 4095]  # 1 ... 4096, none a multiple of the block size
PARTITION = 512  # the kernel's fixed partition length: contexts past it are cut and merged


@pytest.fixture(scope="module")
def built() -> None:
    """With a compiler present the kernel must build: a failure here is a bug, not a reason to skip."""
    if HAS_COMPILER:
        assert kernels.portable.available(), f"the kernel did not build: {kernels.portable.error}"


class Step:
    """One layer's attention inputs for a step: a pool bigger than needed holding every request's whole
    context (each request's blocks a shuffled pick of it), and the step's new rows: request ``i`` has
    ``query_lens[i]`` rows, the last positions of its ``seq_lens[i]``. The new K/V a layer would write are
    the pool's own rows at those positions, so writing them changes nothing.

    ``shared``: each request's first half of blocks is the longest request's (as prefix caching shares them).
    """

    def __init__(self, seq_lens, query_lens=None, kv_heads=3, group=3, dim=64, block_size=16, shared=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = list(seq_lens)
        self.query_lens = [1] * len(self.seq_lens) if query_lens is None else list(query_lens)
        self.block_size = block_size
        needs = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(needs) + 5
        self.k_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
        self.v_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, start = [], 0
        for need in needs:
            self.tables.append(order[start : start + need])
            start += need
        if shared:
            donor = max(self.tables, key=len)
            self.tables = [donor[: len(t) // 2] + t[len(t) // 2 :] for t in self.tables]
        self.q = torch.randn(sum(self.query_lens), kv_heads * group, dim, generator=gen)
        self.scale = dim**-0.5

    def rows(self, i: int) -> slice:
        start = sum(self.query_lens[:i])
        return slice(start, start + self.query_lens[i])

    def sub(self, requests, query_lens=None, seq_lens=None, q=None) -> Step:
        """The same pool, with the step's requests ``requests`` (indices into this step, any order), each with
        ``query_lens`` rows ending at ``seq_lens`` (default: this step's), queries ``q`` (default: this step's)."""
        other = object.__new__(Step)
        other.__dict__.update(self.__dict__)
        other.tables = [self.tables[i] for i in requests]
        other.seq_lens = [self.seq_lens[i] for i in requests] if seq_lens is None else list(seq_lens)
        other.query_lens = [self.query_lens[i] for i in requests] if query_lens is None else list(query_lens)
        other.q = torch.cat([self.q[self.rows(i)] for i in requests]) if q is None else q
        return other


def attend(backend, step: Step) -> torch.Tensor:
    """One layer's attention of ``step`` through ``backend``, as the model runs it: the step's metadata, then
    ``forward`` (which writes the step's K/V first)."""
    meta = backend.build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    k, v = ops.gather_slots(step.k_pool, meta.slot_mapping), ops.gather_slots(step.v_pool, meta.slot_mapping)
    return backend.forward(step.q, k, v, step.k_pool, step.v_pool, meta, step.scale)


def naive(step: Step) -> torch.Tensor:
    """Row by row, in float64: the row's causal context read with the tutorial's loop gather, then
    ``softmax(q K^T * scale) V`` written out."""
    kv_heads = step.k_pool.shape[2]
    group = step.q.shape[1] // kv_heads
    out = torch.empty(step.q.shape, dtype=torch.float64)
    row = 0
    for table, query_len, seq_len in zip(step.tables, step.query_lens, step.seq_lens, strict=True):
        k = reference.gather_kv_loop(step.k_pool, table, seq_len, step.block_size).double().repeat_interleave(group, 1)
        v = reference.gather_kv_loop(step.v_pool, table, seq_len, step.block_size).double().repeat_interleave(group, 1)
        for position in range(seq_len - query_len, seq_len):
            scores = torch.einsum("hd,khd->hk", step.q[row].double(), k[: position + 1]) * step.scale
            weights = torch.exp(scores - scores.amax(1, keepdim=True))
            out[row] = torch.einsum("hk,khd->hd", weights / weights.sum(1, keepdim=True), v[: position + 1])
            row += 1
    return out


def kernel(step: Step) -> torch.Tensor:
    """The raw op on ``step``, no K/V write."""
    meta = KernelAttention().build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    return kernel_ops.paged_attention(
        step.q, step.k_pool, step.v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, step.scale
    )


def with_threads(threads: int, step: Step) -> torch.Tensor:
    """``kernel(step)`` on ``threads`` intra-op threads, the count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel(step)
    finally:
        torch.set_num_threads(before)


# A mixed step: decodes and prefill chunks, some with earlier context, contexts across partition boundaries.
MIXED_STEP = dict(seq_lens=[1, 40, 600, 1300, 2100, 77], query_lens=[1, 40, 1, 300, 70, 5])


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 1, 128), (4, 4, 64), (8, 4, 128)])
def test_torch_backend_matches_naive_math(kv_heads, group, dim):
    step = Step([1, 17, 300, 1000, 90], [1, 1, 1, 30, 90], kv_heads, group, dim, shared=True)
    torch.testing.assert_close(attend(TorchAttention(), step).double(), naive(step), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 1, 128), (2, 4, 64), (8, 4, 128), (1, 7, 64)])
@pytest.mark.parametrize("shared", [False, True])
def test_kernel_matches_naive_math(built, kv_heads, group, dim, shared):
    step = Step(**MIXED_STEP, kv_heads=kv_heads, group=group, dim=dim, shared=shared, seed=group * dim)
    got = attend(KernelAttention(), step)
    assert got.dtype == torch.float32 and got.shape == step.q.shape
    torch.testing.assert_close(got.double(), naive(step), atol=1e-5, rtol=0)


@needs_kernel
def test_kernel_matches_torch_backend_on_decodes(built):
    step = Step(MIXED_LENS, kv_heads=2, group=3, seed=1)
    torch.testing.assert_close(attend(KernelAttention(), step), attend(TorchAttention(), step), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dim,block_size", [(80, 16), (36, 16), (64, 1), (64, 32), (128, 5), (8, 7), (4, 16)])
def test_other_head_dims_and_block_sizes(built, dim, block_size):
    """Head dims other than the compiled 64 and 128 (some not whole vectors), block sizes that do not divide
    the partition, so tiles and partitions start mid-block."""
    step = Step([1, 7, 70, 1100], [1, 7, 3, 600], 2, 2, dim, block_size=block_size, seed=dim)
    torch.testing.assert_close(attend(KernelAttention(), step).double(), naive(step), atol=1e-5, rtol=0)


@needs_kernel
def test_strided_query(built):
    """The layer hands q as a view of the fused qkv rows (row stride > Hq * D): read in place, same bits."""
    step = Step([5, 600], [5, 20], kv_heads=2, group=3)
    dense = kernel(step)
    qkv = torch.cat([step.q, torch.randn(step.q.shape[0], 4, step.q.shape[2])], dim=1)
    assert torch.equal(kernel(step.sub([0, 1], q=qkv[:, : step.q.shape[1]])), dense)
    heads_apart = torch.stack([step.q, torch.randn(step.q.shape)], dim=2).flatten(1, 2)[:, ::2]  # copied first
    assert torch.equal(kernel(step.sub([0, 1], q=heads_apart)), dense)


# Batch invariance: a row's bits depend on its request's K/V and its position only.


@needs_kernel
@pytest.mark.parametrize("length,block_size", [(1300, 16), (1100, 5)])
def test_chunking_does_not_change_a_bit(built, length, block_size):
    """A whole prompt as one prefill chunk, as chunks of any sizes (one row ones included), and one row at a
    time as decodes: the same bits for every row. The context crosses partition boundaries (at 512, 1024)."""
    step = Step([length], [length], block_size=block_size, seed=3)
    whole = kernel(step)
    for sizes in ([1, 16, 300, 5, 200, 63, 64, 65], [511, 2, 511], [PARTITION + 1]):
        sizes = sizes + [length - sum(sizes)]
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        chunks = [kernel(step.sub([0], [n], [end], step.q[end - n : end])) for n, end in zip(sizes, ends, strict=True)]
        assert torch.equal(torch.cat(chunks), whole), sizes
    one_by_one = [kernel(step.sub([0], [1], [p + 1], step.q[p : p + 1])) for p in range(length)]
    assert torch.equal(torch.cat(one_by_one), whole)


@needs_kernel
def test_neighbours_and_order_do_not_change_a_bit(built):
    """Each request alone, and in batches with others of many lengths (> 2 partitions too) in any order."""
    step = Step(**MIXED_STEP, seed=4)
    alone = [kernel(step.sub([i])) for i in range(len(step.seq_lens))]
    assert torch.equal(kernel(step), torch.cat(alone))
    rng = random.Random(0)
    for _ in range(4):
        order = rng.sample(range(len(step.seq_lens)), k=rng.randint(2, len(step.seq_lens)))
        got = kernel(step.sub(order))
        assert torch.equal(got, torch.cat([alone[i] for i in order])), order


@needs_kernel
def test_thread_count_does_not_change_a_bit(built):
    """One thread or two: on a mixed step, on one long decode (its partitions shared out) and on one short
    decode (its KV heads shared out), all big enough that two threads run, and on a small step, which stays on
    the calling thread."""
    cases = [(MIXED_STEP["seq_lens"], MIXED_STEP["query_lens"]), ([4000], [1]), ([300], [1]), ([20], [5])]
    for seq_lens, query_lens in cases:
        step = Step(seq_lens, query_lens, seed=5)
        assert torch.equal(with_threads(1, step), with_threads(2, step))


@needs_kernel
def test_engine_backend_is_the_kernel_bit_for_bit(built):
    """KernelAttention.forward is the kernel, once for all rows: decodes in a step with prefills are the same
    bits as the same decodes alone."""
    step = Step(**MIXED_STEP, seed=6)
    decodes = [i for i, n in enumerate(step.query_lens) if n == 1]
    mixed = attend(KernelAttention(), step)
    alone = attend(KernelAttention(), step.sub(decodes))
    assert torch.equal(torch.cat([mixed[step.rows(i)] for i in decodes]), alone)


@needs_kernel
def test_compiled_kv_write_is_the_index_copy_one(built):
    """kernel_ops.write_kv (both pools, one call) writes what ops.write_kv's index_copy_ writes, row for row: with
    strided rows (views into a fused qkv output, as the layers pass them) and -1 slots skipped; a slot outside
    the pool is a ValueError naming it, and then nothing at all is written."""
    g = torch.Generator().manual_seed(7)
    pools = [torch.randn(6, 4, 3, 8, generator=g) for _ in range(2)]
    qkv = torch.randn(5, 9 + 3 + 3, 8, generator=g)  # 9 query heads, then k, then v
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([0, 23, -1, 5, 17])
    expected = [p.clone() for p in pools]
    ops.write_kv(expected[0], slots, k)
    ops.write_kv(expected[1], slots, v)
    got = [p.clone() for p in pools]
    kernel_ops.write_kv(*got, slots, k, v)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for bad in (24, -2):
        untouched = [p.clone() for p in pools]
        with pytest.raises(ValueError, match=rf"slot_mapping\[4\] = {bad} is outside the pool's 24 slots"):
            kernel_ops.write_kv(*untouched, torch.tensor([0, 1, 2, 3, bad]), k, v)
        assert torch.equal(untouched[0], pools[0]) and torch.equal(untouched[1], pools[1])
    with pytest.raises(ValueError, match="k and v must be fp32"):
        kernel_ops.write_kv(*got, slots, k.transpose(1, 2), v)


@needs_kernel
def test_bad_inputs_raise_value_errors(built):
    step = Step([20, 40], [3, 1], kv_heads=2, group=2)
    meta = KernelAttention().build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    q, k_pool, v_pool = step.q, step.k_pool, step.v_pool
    tables, lens, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc

    def call(q=q, k_pool=k_pool, v_pool=v_pool, tables=tables, lens=lens, qsl=qsl):
        return kernel_ops.paged_attention(q, k_pool, v_pool, tables, lens, qsl, 0.1)

    call()  # the unchanged inputs are fine
    with pytest.raises(ValueError, match="outside the pool"):
        call(tables=torch.full_like(tables, k_pool.shape[0]))
    with pytest.raises(ValueError, match="outside the pool"):
        call(tables=torch.full_like(tables, -1))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 0 must lie in \[1, "):
        call(lens=torch.tensor([0, 40]))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 10000 must lie in"):
        call(lens=torch.tensor([20, 10_000]))
    with pytest.raises(ValueError, match="contiguous"):
        call(k_pool=k_pool.transpose(1, 2), v_pool=v_pool.transpose(1, 2))
    with pytest.raises(ValueError, match="dtype"):
        call(q=q.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        call(k_pool=k_pool.double(), v_pool=v_pool.double())
    with pytest.raises(ValueError, match="need q"):
        call(q=q[0])
    with pytest.raises(ValueError, match="equal pools"):
        call(v_pool=v_pool[:-1])
    with pytest.raises(ValueError, match=r"query_start_loc must run from 0 to q's 4 rows, got 0 \.\.\. 5"):
        call(qsl=torch.tensor([0, 3, 5]))  # more rows than q has
    with pytest.raises(ValueError, match="query_start_loc must run from 0"):
        call(q=q[:3])
    with pytest.raises(ValueError, match="query_start_loc must run from 0"):
        call(qsl=torch.tensor([1, 3, 4]))
    with pytest.raises(ValueError, match=r"request 1 has 0 rows by query_start_loc, but needs 1 <= rows"):
        call(qsl=torch.tensor([0, 4, 4]))
    with pytest.raises(ValueError, match=r"request 0 has 3 rows .* seq_lens\[0\] = 2"):
        call(lens=torch.tensor([2, 40]))
    with pytest.raises(ValueError, match=r"query_start_loc \[B \+ 1\]"):
        call(qsl=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"block_tables \[B, max_blocks\]"):
        call(tables=tables[:1])


@needs_kernel
def test_build_is_cached_per_machine_or_prebuilt(built):
    """Compiled on first use into the per-machine cache, or loaded from a wheel's (or `make wheel`'s) libraries."""
    choice = kernels.kernel_choice()
    if choice.variant == "jit":
        directory = kernels.portable.build_directory()
        built_here = sorted(p.name for p in directory.parent.glob("*/*"))
        assert (directory / f"{kernels.portable.name}.so").exists(), built_here
        assert directory.is_relative_to(cache_root())
    else:
        library = choice.library(kernels.portable.name)
        assert library.is_file() and library.parent == prebuilt_directory(), library
        assert str(library) in {str(lib) for lib in torch.ops.loaded_libraries}


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert kernels.portable.build_directory().parent == tmp_path / "torch_extensions"


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process that has not tried to build yet, with an empty cache; the real state comes back after."""
    monkeypatch.setattr(kernels, "portable", kernels.portable.fresh())
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernels.VARIANT_ENV, "jit")  # compiled here, not loaded from a checkout's build/
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.mark.parametrize("age_s", [3600, 0])
def test_build_lock_left_by_a_killed_build_is_removed(fresh_build, monkeypatch, age_s):
    """torch waits forever on its lock file. Builds hold pagedkv's flock, which dies with its holder, so
    a torch lock found while holding the flock is stale at any age: it must not hang the next start."""
    from torch.utils import cpp_extension

    lock = kernels.portable.build_directory() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    seen = []

    def fake_load(**kwargs):
        seen.append(lock.exists())
        raise RuntimeError("stop before compiling")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels.portable.available() is False
    assert seen == [False]


def _broken_build():
    raise RuntimeError("Error building extension 'pagedkv_ops'")


@pytest.mark.parametrize("how", ["cxx", "build"])
def test_broken_compiler_falls_back_to_gather(fresh_build, monkeypatch, caplog, how):
    if how == "cxx":
        monkeypatch.setenv("CXX", "/bin/false")
    else:
        monkeypatch.setattr(kernels.portable, "build", _broken_build)
    with caplog.at_level(logging.INFO):
        assert kernels.portable.available() is False
        assert select_backend(None).name == "gather"
        assert select_backend("kernel").name == "gather"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not be built" in r.getMessage() for r in warnings)
    assert any("attention_backend='kernel' asked for" in r.getMessage() for r in warnings)
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 1  # tried once, logged once
    step = Step([3, 50], [3, 1], kv_heads=2, group=2)
    torch.testing.assert_close(attend(TorchAttention(), step), naive(step).float())
    with pytest.raises(RuntimeError, match="gather"):
        kernel(step)


def test_select_backend_order(monkeypatch, caplog):
    monkeypatch.setattr(kernels.portable, "available", lambda: True)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert select_backend(None).name == "kernel"
    assert select_backend("gather").name == "gather"
    monkeypatch.setenv(ENV_VAR, "gather")
    assert select_backend(None).name == "gather"
    assert select_backend("kernel").name == "kernel"  # the argument wins over the environment
    monkeypatch.setenv(ENV_VAR, "kernel")
    assert select_backend(None).name == "kernel"
    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.setattr(kernels.portable, "available", lambda: False)
    with caplog.at_level(logging.INFO):
        assert select_backend(None).name == "gather"
    assert "unavailable" in caplog.text


def test_invalid_backend_names(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="'kernel', 'gather'"):
        EngineConfig(attention_backend="flash")
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        select_backend(None)
