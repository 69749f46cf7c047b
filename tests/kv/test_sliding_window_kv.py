"""Sliding-window layers hold only their window (HybridKVCacheManager; docs/sliding-window.md).

Two levels. The manager alone, on hand-driven requests: a long request never holds more than
``ceil(window / block_size) + 1`` windowed blocks between steps, a prefix hit needs exactly the windowed blocks
of its window (and says ``window`` when they were evicted), allocation is all or nothing in both groups, and
every block comes back when requests end, are aborted or preempted. The engine on a tiny random Gemma 3 against
HF transformers: prompts shorter than, equal to and 3x the window, chunked, batched, cold and warm, a hit after
the windowed blocks slid out (exact), and one after they were evicted (exact too, a miss with its reason).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.kv.hashing import extend_block_keys
from pagedkv.kv.hybrid import HybridKVCacheManager, split_kv_budget, window_group_need
from tests.hf_reference import check_against_hf as _check_against_hf
from tests.hf_reference import save_with_word_tokenizer
from tests.model.test_gemma3 import WINDOW, _prompt, checkpoint, pair  # noqa: F401 - fixtures

BLOCK = 4
BOUND = -(-WINDOW // BLOCK) + 1  # windowed blocks a request may hold between steps


def _keys(tokens: list[int], block_size: int = BLOCK) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, tokens, block_size)
    return keys


def _run_request(kv: HybridKVCacheManager, rid: str, tokens: list[int], chunk: int) -> list[int]:
    """Drive one request through ``kv`` as the scheduler does, ``chunk`` tokens a step; the windowed blocks it
    holds after each step."""
    keys = _keys(tokens)
    hit = kv.find_cached_prefix(keys, len(tokens))
    computed = hit.num_tokens
    assert kv.allocate(rid, min(len(tokens), computed + chunk), hit, keys, 0)
    held = []
    while True:
        computed = min(len(tokens), computed + chunk)
        kv.slide(rid, keys, computed)
        held.append(kv.windowed.num_held_blocks(rid))
        if computed == len(tokens):
            return held
        assert kv.allocate(rid, min(len(tokens), computed + chunk), None, keys, computed)


def test_a_long_request_holds_at_most_the_window_and_gives_everything_back():
    kv = HybridKVCacheManager(64, BLOCK, True, WINDOW, 64)
    tokens = _prompt(1, 120)
    held = _run_request(kv, "a", tokens, chunk=1)
    assert max(held) == BOUND  # one token a step, as a decode: reached, never passed
    assert kv.num_used_blocks == 30  # the full-attention layers keep every block
    kv.free("a", _keys(tokens), len(tokens))
    assert kv.num_free_blocks == 64 and kv.windowed.pool.num_free_blocks == 64
    chunked = _run_request(kv, "b", _prompt(2, 120), chunk=16)  # a chunk holds its own blocks for the step
    assert max(chunked) <= BOUND
    kv.free("b")
    assert kv.windowed.pool.num_free_blocks == 64 and kv.num_free_blocks == 64


def test_a_hit_needs_only_the_window_before_it_and_a_cut_hit_says_window():
    kv = HybridKVCacheManager(64, BLOCK, True, WINDOW, 64)
    tokens = _prompt(3, 64)
    keys = _keys(tokens)
    _run_request(kv, "a", tokens, chunk=1)
    kv.free("a", keys, len(tokens))
    longer = tokens + _prompt(4, 10)
    hit = kv.find_cached_prefix(_keys(longer), len(longer))
    assert len(hit.block_ids) == 16 and not hit.window_cut  # every block: slid out, but still cached
    first = (16 * BLOCK - WINDOW + 1) // BLOCK
    assert hit.window.first_block == first and len(hit.window.block_ids) == 16 - first
    # evict the windowed group's cached blocks (another tenant's requests would): the full layers still hit
    kv.windowed.pool.release(kv.windowed.pool.take_new(kv.windowed.pool.num_free_blocks))
    cut = kv.find_cached_prefix(_keys(longer), len(longer))
    assert cut.num_tokens == 0 and cut.window_cut
    assert kv.miss_reason(_keys(longer), cut, None) == "window"
    scored = kv.find_cached_prefix(_keys(longer), len(longer), from_start=True)
    assert scored.num_tokens == 0


def test_a_scored_prompt_hits_only_while_every_windowed_block_is_cached():
    kv = HybridKVCacheManager(64, BLOCK, True, WINDOW, 64)
    tokens = _prompt(5, 40)
    kv.allocate("a", len(tokens), kv.find_cached_prefix(_keys(tokens), len(tokens)), _keys(tokens), 0)
    kv.free("a", _keys(tokens), len(tokens))  # computed in one chunk: nothing slid out before it was cached
    assert kv.find_cached_prefix(_keys(tokens), len(tokens), from_start=True).num_tokens == 36
    _run_request(kv, "b", tokens + [1], chunk=40)  # hits 36, computes the rest: blocks before its window go
    kv.free("b")
    assert kv.find_cached_prefix(_keys(tokens), len(tokens), from_start=True).num_tokens == 36  # still cached


def test_allocation_is_all_or_nothing_across_both_groups():
    kv = HybridKVCacheManager(64, BLOCK, True, WINDOW, 3)
    tokens = _prompt(6, 40)
    assert not kv.allocate("a", 40, kv.find_cached_prefix(_keys(tokens), 40), _keys(tokens), 0)
    assert kv.num_free_blocks == 64 and kv.windowed.pool.num_free_blocks == 3
    assert kv.block_table("a") == [] and kv.window_block_table("a") == []
    assert kv.allocate("a", 12, kv.find_cached_prefix(_keys(tokens), 40), _keys(tokens), 0)
    kv.free("a")
    assert kv.num_free_blocks == 64 and kv.windowed.pool.num_free_blocks == 3


def test_the_budget_goes_to_the_full_layers_when_the_window_is_small():
    need = window_group_need(512, 16, 4, 2048)
    assert need == 4 * 34 + 128
    full, windowed = split_kv_budget(18 * 10_000, 3, 15, need)
    assert windowed == need and full * 3 + windowed * 15 <= 18 * 10_000 and full > 10_000
    assert split_kv_budget(18 * 100, 3, 15, need) == (100, 100)  # too small to spare: the same for both


def _llm(checkpoint: str, backend: str, **options) -> LLM:  # noqa: F811
    if backend == "kernel" and not kernels.portable.available():
        pytest.skip("the compiled kernels cannot be built here")
    settings = dict(block_size=BLOCK, num_kv_blocks=96, max_num_batched_tokens=16, weight_format="float32")
    return LLM(model=checkpoint, attention_backend=backend, **{**settings, **options})


@pytest.mark.parametrize("backend", ["gather", "kernel"])
def test_engine_matches_hf_while_windowed_blocks_slide_out(pair, checkpoint, backend):  # noqa: F811
    """A batch of prompts shorter than, equal to, 3x the window and longer, chunked at 16 tokens a step; each
    request's windowed blocks stay within the bound after every step, and all come back at the end."""
    hf, _ = pair
    llm = _llm(checkpoint, backend)
    engine, kv = llm.engine, llm.engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    prompts = [_prompt(30, 5), _prompt(31, WINDOW), _prompt(32, 3 * WINDOW), _prompt(33, 45)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        for request in engine.scheduler.running:
            assert kv.windowed.num_held_blocks(request.request_id) <= BOUND
    _check_against_hf(hf, prompts, [finals[i] for i in ids])
    assert kv.num_free_blocks == 96 and kv.windowed.pool.num_free_blocks == 96
    llm.close()


@pytest.mark.parametrize("backend", ["gather", "kernel"])
def test_hits_after_the_window_slid_and_after_it_was_evicted_are_exact(pair, checkpoint, backend):  # noqa: F811
    hf, _ = pair
    llm = _llm(checkpoint, backend)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    first = _prompt(40, 3 * WINDOW + 5)
    _check_against_hf(hf, [first], llm.generate(prompt_token_ids=[first], sampling_params=params))
    follow_up = first + _prompt(41, 7)  # the next turn of a conversation: its windowed head slid out long ago
    warm = llm.generate(prompt_token_ids=[follow_up], sampling_params=params)
    assert warm[0].num_cached_tokens == 28  # 7 blocks; the windowed layers' from block (28 - 8 + 1) // 4 on
    _check_against_hf(hf, [follow_up], warm)
    windowed = llm.engine.kv.windowed.pool
    windowed.release(windowed.take_new(windowed.num_free_blocks))  # another tenant's requests evict them
    other = first + _prompt(42, 6)
    cut = llm.generate(prompt_token_ids=[other], sampling_params=params)
    assert cut[0].num_cached_tokens == 0 and cut[0].cache_miss_reason == "window"
    _check_against_hf(hf, [other], cut)
    llm.close()


def test_a_batch_gives_each_row_the_bits_it_gets_alone(pair, checkpoint):  # noqa: F811
    """Batch invariance on the kernel: a prompt's logprobs alone and beside others are the same floats."""
    llm = _llm(checkpoint, "kernel", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    target = _prompt(50, 2 * WINDOW + 3)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0].outputs[0]
    batch = [_prompt(51, 30), target, _prompt(52, 3)]
    beside = llm.generate(prompt_token_ids=batch, sampling_params=params)[1].outputs[0]
    assert beside.token_ids == alone.token_ids and beside.logprobs == alone.logprobs
    llm.close()


def test_aborted_and_preempted_requests_give_every_block_back(checkpoint):  # noqa: F811
    llm = _llm(checkpoint, "gather", num_kv_blocks=24)  # too few blocks for all three: preemptions
    engine, kv = llm.engine, llm.engine.kv
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=_prompt(60 + i, 30), params=params) for i in range(3)]
    for _ in range(6):
        engine.step()
    engine.abort(ids[0])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.counters["num_preemptions"] > 0
    assert kv.num_free_blocks == 24 and kv.windowed.pool.num_free_blocks == 24
    llm.close()


def test_a_4096_token_request_holds_the_acceptance_bound(tmp_path):
    """KV held for a 4,096-token Gemma 3 request, between decode steps: at most global layers x 4,096 +
    windowed layers x (window + one block) tokens' worth."""
    from tests.model.test_gemma3 import _config, _hf_model

    window, block = 64, 16
    hf = _hf_model(_config(sliding_window=window, max_position_embeddings=4200))
    llm = LLM(
        model=save_with_word_tokenizer(hf, tmp_path),
        block_size=block,
        num_kv_blocks=300,
        weight_format="float32",
        attention_backend="gather",
        max_num_batched_tokens=1024,
    )
    engine, kv = llm.engine, llm.engine.kv
    spec = engine.runner.model.spec
    windowed = sum(1 for w in spec.layer_windows if w)
    full = spec.num_layers - windowed
    assert (full, windowed) == (1, 3)
    engine.add_request(prompt_token_ids=_prompt(70, 4090), params=SamplingParams(max_tokens=6, ignore_eos=True))
    worst = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:  # between steps, prefilling or decoding
            rid = request.request_id
            held = full * len(kv.block_table(rid)) + windowed * kv.windowed.num_held_blocks(rid)
            worst = max(worst, held * block)
    assert worst <= full * 4096 + windowed * (window + block)
    assert worst >= full * 4080  # it did run to the end of its context
    llm.close()


def test_the_pools_are_sized_per_group(checkpoint):  # noqa: F811
    llm = _llm(checkpoint, "gather", num_kv_blocks=None, kv_cache_memory_gb=0.01, max_num_seqs=2)
    engine = llm.engine
    llm.generate(prompt_token_ids=[_prompt(80, 40)], sampling_params=SamplingParams(max_tokens=4))
    spec = engine.runner.model.spec
    shapes = {w > 0: k.shape[0] for w, (k, _) in zip(spec.layer_windows, engine.runner.kv_caches, strict=True)}
    assert shapes[True] == engine.kv.windowed.pool.num_blocks + 1  # and the null block
    assert shapes[False] == engine.kv.num_total_blocks > shapes[True]
    assert torch.count_nonzero(engine.runner.kv_caches[0][0][-1]) == 0  # the null block: never written
    llm.close()


@pytest.mark.parametrize("backend", ["gather", "kernel"])
def test_released_blocks_are_never_read(pair, checkpoint, backend):  # noqa: F811
    """The null block that stands for released blocks is filled with NaN: one read of it, even with weight 0,
    would turn the logits into NaN. Chunked and decoded prompts of up to 5x the window match HF."""
    hf, _ = pair
    llm = _llm(checkpoint, backend)
    runner = llm.engine.runner
    for window, (k_pool, v_pool) in zip(runner.model.spec.layer_windows, runner.kv_caches, strict=True):
        if window:
            k_pool[-1].fill_(float("nan"))
            v_pool[-1].fill_(float("nan"))
    prompts = [_prompt(90, 5 * WINDOW), _prompt(91, 2 * WINDOW + 1)]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True)
    _check_against_hf(hf, prompts, llm.generate(prompt_token_ids=prompts, sampling_params=params))
    llm.close()
