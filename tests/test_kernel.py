"""The attention backends: the compiled decode kernel against the torch backend, both against naive math,
through the same ``build_metadata`` + ``forward`` calls a layer makes; and the backend choice (argument /
environment / fallback when the kernel cannot be built)."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch

from pagedkv import kernels
from pagedkv.attention.backend import ENV_VAR, select_backend
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.config import EngineConfig
from pagedkv.extension import cache_root
from pagedkv.kv import ops

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler here: the kernel cannot be built")
MIXED_LENS = [1, 15, 17, 100, 1000, 4095]  # 1 ... 4096, none a multiple of the block size


@pytest.fixture(scope="module")
def built() -> None:
    """With a compiler present the kernel must build: a failure here is a bug, not a reason to skip."""
    if HAS_COMPILER:
        assert kernels.portable.available(), f"the kernel did not build: {kernels.portable.error}"


def make_step(lens, kv_heads, group, dim, block_size=16, shared=False, seed=0):
    """A pool bigger than needed, each request's blocks a shuffled pick of it, tables padded with 0.

    ``shared``: each request's first half of blocks is the longest request's (as prefix caching shares them).
    """
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // block_size) for n in lens]
    num_blocks = sum(needs) + 5
    k_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for need in needs:
        tables.append(order[start : start + need])
        start += need
    if shared:
        donor = max(tables, key=len)
        tables = [donor[: len(t) // 2] + t[len(t) // 2 :] for t in tables]
    block_tables = ops.pad_block_tables(tables, width=max(needs) + 2)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen)
    return q, k_pool, v_pool, block_tables, torch.tensor(lens, dtype=torch.int64)


def decode(backend, q, k_pool, v_pool, block_tables, seq_lens, scale):
    """One decode step of one layer through ``backend``, as the model runs it: the step's metadata, then
    ``forward``. The new K/V are the pool's rows at each request's last position, so writing them changes
    nothing."""
    lens, block_size = seq_lens.tolist(), k_pool.shape[1]
    tables = [block_tables[i, : -(-n // block_size)].tolist() for i, n in enumerate(lens)]
    meta = backend.build_metadata(tables, [1] * len(lens), lens, block_size)
    k, v = ops.gather_slots(k_pool, meta.slot_mapping), ops.gather_slots(v_pool, meta.slot_mapping)
    return backend.forward(q, k, v, k_pool, v_pool, meta, scale)


def naive(q, k_pool, v_pool, block_tables, seq_lens, scale):
    """Per request: the tutorial's loop gather, then softmax written out, in float64."""
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        table = block_tables[i].tolist()
        k = ops.gather_kv_loop(k_pool, table, length, block_size).double()
        v = ops.gather_kv_loop(v_pool, table, length, block_size).double()
        for head in range(q.shape[1]):
            scores = k[:, head // group] @ q[i, head].double() * scale
            weights = torch.exp(scores - scores.max())
            out[i, head] = (weights / weights.sum()) @ v[:, head // group]
    return out


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 1, 128), (4, 4, 64), (8, 4, 128)])
def test_torch_backend_matches_naive_math(kv_heads, group, dim):
    step = make_step([1, 17, 300, 1000], kv_heads, group, dim, shared=True)
    expected = naive(*step, scale=dim**-0.5)
    torch.testing.assert_close(decode(TorchAttention(), *step, scale=dim**-0.5).double(), expected, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_kernel_matches_torch_backend(built, group, dim, shared):
    step = make_step(MIXED_LENS, 2, group, dim, shared=shared, seed=group * dim)
    got = decode(KernelAttention(), *step, scale=dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == step[0].shape
    torch.testing.assert_close(got, decode(TorchAttention(), *step, scale=dim**-0.5), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_matches_naive_math(built):
    step = make_step([4095, 33, 1], 3, 3, 64, shared=True)
    got = decode(KernelAttention(), *step, scale=0.125).double()
    torch.testing.assert_close(got, naive(*step, scale=0.125), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("partition", [0, 16, 48, 256, 100_000])
@pytest.mark.parametrize("threads", [1, 2])
def test_partitions_and_threads_agree(built, partition, threads):
    """Contexts cut into partitions (merged by log-sum-exp) give the unsplit result, on any thread count."""
    step = make_step(MIXED_LENS, 3, 3, 64, seed=7)
    expected = decode(TorchAttention(), *step, scale=0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_decode(*step, scale=0.125, partition_tokens=partition)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dim,block_size", [(80, 16), (36, 16), (64, 1), (64, 32), (128, 5)])
def test_other_head_dims_and_block_sizes(built, dim, block_size):
    step = make_step([1, 7, 70, 333], 2, 2, dim, block_size=block_size, seed=dim)
    got = decode(KernelAttention(), *step, scale=dim**-0.5)
    torch.testing.assert_close(got, decode(TorchAttention(), *step, scale=dim**-0.5), atol=1e-5, rtol=0)


@needs_kernel
def test_strided_query(built):
    _, k_pool, v_pool, tables, lens = make_step([5, 600], 2, 3, 64)
    q = torch.randn(2, 12, 64)[:, ::2]  # non-contiguous, as the q heads of a fused qkv row are
    got = kernels.paged_decode(q, k_pool, v_pool, tables, lens, 0.125)
    torch.testing.assert_close(got, decode(TorchAttention(), q, k_pool, v_pool, tables, lens, 0.125), atol=1e-5, rtol=0)


@needs_kernel
def test_bad_inputs_raise_value_errors(built):
    q, k_pool, v_pool, tables, lens = make_step([20, 40], 2, 2, 64)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.paged_decode(q, k_pool, v_pool, torch.full_like(tables, k_pool.shape[0]), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([0, 40]), 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([20, 10_000]), 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.paged_decode(q, k_pool.transpose(1, 2), v_pool.transpose(1, 2), tables, lens, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode(q.to(torch.bfloat16), k_pool, v_pool, tables, lens, 0.1)


@needs_kernel
def test_build_is_cached_per_machine(built):
    directory = kernels.portable.build_directory()
    assert (directory / f"{kernels.portable.name}.so").exists(), sorted(p.name for p in directory.parent.glob("*/*"))
    assert directory.is_relative_to(cache_root())


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert kernels.portable.build_directory().parent == tmp_path / "torch_extensions"


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process that has not tried to build yet, with an empty cache; the real state comes back after."""
    monkeypatch.setattr(kernels, "portable", kernels.portable.fresh())
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
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
    step = make_step([3, 50], 2, 2, 64)
    torch.testing.assert_close(decode(TorchAttention(), *step, scale=0.1), naive(*step, scale=0.1).float())
    with pytest.raises(RuntimeError, match="gather"):
        kernels.paged_decode(*step, scale=0.1)


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
