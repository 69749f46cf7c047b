"""``kv_cache_dtype="float16"``: the KV pool in 16 bits, attention still fp32.

The contract (``pagedkv.kv.ops.KV_DTYPES``): a K/V value is rounded to fp16 once, when it is written, with
torch's own rounding, and every read widens it back exactly. So each piece is held bit for bit to an fp32
reference fed the same rounded values -- the compiled kernel, the compiled write, the torch write and the
gather backend -- and the engine keeps its batch invariance. Only the rounding itself is new, and that is
torch's ``Tensor.half()``, the independent reference here. How far the rounding moves a real model's greedy
tokens is measured on the default model.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams, kernel_ops, kernels
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.config import EngineConfig
from pagedkv.kv import ops
from tests.attention.test_kernel import MIXED_STEP, Step, built, kernel, needs_kernel  # noqa: F401 (built: a fixture)
from tests.tiny_model import save_tiny_llama


def _rounded(step: Step) -> tuple[Step, Step]:
    """``step`` with its pools rounded to fp16, twice: held as fp16, and as the fp32 values of those fp16s."""
    half, wide = step.sub(range(len(step.seq_lens))), step.sub(range(len(step.seq_lens)))
    half.k_pool, half.v_pool = step.k_pool.half(), step.v_pool.half()
    wide.k_pool, wide.v_pool = half.k_pool.float(), half.v_pool.float()
    return half, wide


@needs_kernel
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize(
    "kv_heads,group,dim,block_size", [(3, 3, 64, 16), (2, 4, 128, 16), (2, 2, 80, 5), (1, 3, 36, 7)]
)
@pytest.mark.parametrize("shared", [False, True])
def test_kernel_on_an_fp16_pool_is_the_fp32_kernel_on_its_values(kv_heads, group, dim, block_size, shared):
    """Bit for bit, on a mixed step (decodes, chunks, contexts across partitions), for the compiled head sizes
    (64, 128) and the generic loops with a scalar tail (80, 36)."""
    step = Step(**MIXED_STEP, kv_heads=kv_heads, group=group, dim=dim, block_size=block_size, shared=shared)
    half, wide = _rounded(step)
    assert torch.equal(kernel(half), kernel(wide))


@needs_kernel
@pytest.mark.usefixtures("built")
def test_kernel_engine_path_on_an_fp16_pool_stays_batch_invariant():
    """Decodes computed beside prefill chunks are the same bits as the same decodes alone, in fp16 too."""
    half, wide = _rounded(Step(**MIXED_STEP, seed=6))
    decodes = [i for i, n in enumerate(half.query_lens) if n == 1]
    mixed = attend(KernelAttention(), half)
    alone = attend(KernelAttention(), half.sub(decodes))
    assert torch.equal(torch.cat([mixed[half.rows(i)] for i in decodes]), alone)
    assert torch.equal(mixed, attend(KernelAttention(), wide))


def test_gather_backend_on_an_fp16_pool_is_its_fp32_path_on_the_values():
    half, wide = _rounded(Step(**MIXED_STEP, seed=2))
    assert torch.equal(attend(TorchAttention(), half), attend(TorchAttention(), wide))


def attend(backend, step: Step) -> torch.Tensor:
    """One layer's attention of ``step`` as the model runs it: metadata, then ``forward``, which first writes
    the step's new K/V -- fp32 rows, as the layers make them: here the pool's own values at those slots, so the
    write puts back what is there."""
    meta = backend.build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    k, v = (ops.gather_slots(pool, meta.slot_mapping).float() for pool in (step.k_pool, step.v_pool))
    return backend.forward(step.q, k, v, step.k_pool, step.v_pool, meta, step.scale)


def _rows_and_pools(dtype: torch.dtype):
    g = torch.Generator().manual_seed(11)
    pools = [(torch.randn(6, 4, 3, 8, generator=g) * 300).to(dtype) for _ in range(2)]
    qkv = torch.randn(5, 9 + 3 + 3, 8, generator=g) * 300  # wide values: many round, some to fp16's coarse steps
    qkv[0, 9:, :4] = torch.tensor([7e4, -1e5, 3e-8, 65519.0])  # past fp16's range, below its subnormals, at its top
    return pools, qkv[:, 9:12], qkv[:, 12:], torch.tensor([0, 23, -1, 5, 17])


def _written_by_torch_rounding(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The reference write: rows rounded by torch's .half(), then put at their slots one by one."""
    out = pool.clone().view(-1, *pool.shape[2:])
    for row, slot in zip(rows.half(), slots.tolist(), strict=True):
        if slot >= 0:
            out[slot] = row
    return out.view(pool.shape)


@needs_kernel
@pytest.mark.usefixtures("built")
def test_compiled_write_rounds_as_torch_does():
    (k_pool, v_pool), k, v, slots = _rows_and_pools(torch.float16)
    expected = _written_by_torch_rounding(k_pool, slots, k), _written_by_torch_rounding(v_pool, slots, v)
    kernel_ops.write_kv(k_pool, v_pool, slots, k, v)  # strided rows, as the layers pass them
    assert torch.equal(k_pool, expected[0]) and torch.equal(v_pool, expected[1])


def test_torch_write_rounds_as_torch_does():
    (k_pool, _), k, _, slots = _rows_and_pools(torch.float16)
    expected = _written_by_torch_rounding(k_pool, slots, k)
    ops.write_kv(k_pool, slots, k)
    assert torch.equal(k_pool, expected)
    with pytest.raises(ValueError, match="differs from pool dtype"):
        ops.write_kv(k_pool, slots, k.double())


@needs_kernel
@pytest.mark.usefixtures("built")
def test_pools_of_other_or_mixed_dtypes_are_refused():
    step = Step([20, 40], [3, 1], kv_heads=2, group=2)
    meta = KernelAttention().build_metadata(step.tables, step.query_lens, step.seq_lens, step.block_size)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.1)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        kernel_ops.paged_attention(step.q, step.k_pool.half(), step.v_pool, *args)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        kernel_ops.paged_attention(step.q, step.k_pool.bfloat16(), step.v_pool.bfloat16(), *args)
    k = step.q[:, :2].contiguous()
    with pytest.raises(ValueError, match="fp32 or fp16"):
        kernel_ops.write_kv(step.k_pool.bfloat16(), step.v_pool.bfloat16(), meta.slot_mapping[:4], k, k)


def test_the_option_is_validated():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('float32', 'float16'\), got 'bfloat16'"):
        EngineConfig(kv_cache_dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("backend", ["kernel", "gather"])
def test_an_fp16_engine_holds_twice_the_tokens_and_frees_them(tiny, backend):
    """Same memory, twice the blocks, all fp16; a batch of prompts through both backends leaves no block in use.
    On the kernel (the batch-invariant backend; gather is not, see README) a request's tokens and logprobs
    alone equal its tokens and logprobs in the batch."""
    if backend == "kernel" and not kernels.portable.available():
        pytest.skip("the kernel does not build here")
    options = dict(model=tiny, kv_cache_memory_gb=2**-7, attention_backend=backend)  # 8 MiB: 256 fp32 blocks
    wide, half = LLM(**options), LLM(**options, kv_cache_dtype="float16")
    assert half.engine.kv.num_total_blocks == 2 * wide.engine.kv.num_total_blocks
    assert {p.dtype for pair in half.engine.runner.kv_caches for p in pair} == {torch.float16}
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    prompts = [[5 + (i * 7 + j) % 500 for j in range(20 + 30 * i)] for i in range(4)]

    def bits(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    batch = bits(half.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert all(len(tokens) == 12 for tokens, _ in batch)
    assert half.engine.kv.num_used_blocks == 0
    if backend == "kernel":
        alone = [bits(half.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False))[0] for p in prompts]
        assert batch == alone


@pytest.mark.slow
def test_default_model_greedy_tokens_mostly_agree_with_fp32():
    """The rounding's cost on the real model: greedy chat answers from an fp16 pool against the fp32 pool's.

    Measured on the benchmark's kind of questions (Zen 5, kernel backend): see the README's KV-dtype paragraph.
    A token counts as agreeing while the two answers are still identical; after the first difference the rest of
    an answer counts against, so this is the strict measure.
    """
    questions = [
        "What is the capital of France?",
        "Explain what a hash table is in two sentences.",
        "Write a haiku about the sea.",
        "List three uses of a paper clip.",
        "How do plants make food?",
        "What is 17 times 3?",
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    messages = [[{"role": "user", "content": q}] for q in questions]
    answers = {}
    for dtype in ("float32", "float16"):
        llm = LLM(kv_cache_dtype=dtype, kv_cache_memory_gb=0.05)
        answers[dtype] = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
    agree = total = 0
    for a, b in zip(answers["float32"], answers["float16"], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree, total = agree + same, total + max(len(a), len(b))
    assert agree / total >= 0.9, f"{agree}/{total} greedy tokens agree"
