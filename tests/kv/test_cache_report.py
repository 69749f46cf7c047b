"""The per-request cache report (RequestOutput.cache_miss_reason), each reason from a scenario built for it.

On a tiny random Llama (block size 4), so every scenario runs the real scheduler and KV manager in
milliseconds. The expected reason and cached-token count come from how each scenario is built -- which
blocks were computed before, evicted, salted -- not from the code under test; the eviction scenarios also
check the pool's own state, so a reason cannot be right by accident.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.cache_report import MISS_REASONS, aggregate
from pagedkv.kv.hashing import extend_block_keys
from tests.tiny_model import save_tiny_llama

BS = 4
ONE = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def make_llm(tiny: str, **kwargs) -> LLM:
    options = {"num_kv_blocks": 64, "block_size": BS, "max_model_len": 256} | kwargs
    return LLM(model=tiny, **options)


def run(llm: LLM, *prompts: list[int], salt: str | None = None, params: SamplingParams = ONE) -> list:
    return llm.generate(prompt_token_ids=list(prompts), sampling_params=params, use_tqdm=False, cache_salt=salt)


def report(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[int, str]:
    out = run(llm, prompt, salt=salt)[0]
    return out.num_cached_tokens, out.cache_miss_reason


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_new_then_hit(tiny):
    llm = make_llm(tiny)
    prompt = tokens(10, 3 * BS + 2)  # three full blocks and a partial one
    assert report(llm, prompt) == (0, "new")
    assert report(llm, prompt) == (3 * BS, "hit")
    assert report(llm, prompt[: 2 * BS] + [99, 98, 97, 96, 95]) == (2 * BS, "new"), "the third block differs"


def test_a_prompt_of_exactly_k_blocks_stops_at_k_minus_one_for_the_last_token(tiny):
    llm = make_llm(tiny)
    prompt = tokens(20, 3 * BS)
    assert report(llm, prompt) == (0, "new")
    assert report(llm, prompt) == (2 * BS, "last_token")
    assert report(llm, prompt + [7]) == (3 * BS, "hit"), "one token more: every block is reusable"


def test_a_prompt_shorter_than_a_block_is_new(tiny):
    llm = make_llm(tiny)
    assert report(llm, [5, 6]) == (0, "new")
    assert report(llm, [5, 6]) == (0, "new"), "a partial block is never cached"


def test_evicted_with_a_tiny_pool(tiny):
    llm = make_llm(tiny, num_kv_blocks=8, max_model_len=32)
    prompt = tokens(30, 2 * BS + 1)
    assert report(llm, prompt) == (0, "new")
    pool = llm.engine.kv.pool
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, BS)
    assert all(pool.lookup(k) is not None for k in keys)
    for i in range(4):  # each takes 3 blocks; the 8-block pool must hand out the prompt's cached blocks
        run(llm, tokens(100 + 10 * i, 2 * BS + 1))
    assert pool.lookup(keys[0]) is None and llm.stats()["evictions"] > 0, "the scenario must evict the prompt"
    assert report(llm, prompt) == (0, "evicted")
    assert report(llm, prompt) == (2 * BS, "hit"), "computed again, it is cached again"


def test_salts_never_leak(tiny):
    """A prefix cached (or evicted) under one salt is `new` under another and without one."""
    llm = make_llm(tiny, num_kv_blocks=8, max_model_len=32)
    prompt = tokens(40, 2 * BS + 1)
    assert report(llm, prompt, salt="tenant-a") == (0, "new")
    assert report(llm, prompt, salt="tenant-b") == (0, "new")
    assert report(llm, prompt) == (0, "new")
    assert report(llm, prompt, salt="tenant-a") == (2 * BS, "hit")
    for i in range(4):
        run(llm, tokens(100 + 10 * i, 2 * BS + 1))
    assert llm.stats()["evictions"] >= 6, "all three copies of the prompt must be gone"
    assert report(llm, prompt, salt="tenant-a") == (0, "evicted")
    assert report(llm, prompt, salt="tenant-c") == (0, "new"), "another tenant's eviction is not visible"


def test_a_burst_waits_for_the_block_in_flight(tiny):
    llm = make_llm(tiny)
    shared = tokens(50, 3 * BS)
    first, second = run(llm, shared + [1, 2], shared + [3, 4, 5, 6, 7])
    assert (first.num_cached_tokens, first.cache_miss_reason) == (0, "new")
    assert (second.num_cached_tokens, second.cache_miss_reason) == (3 * BS, "waited")
    assert llm.stats()["prompt_tokens_computed"] == len(shared) + 2 + 5, "the shared blocks were computed once"


def test_the_n_samples_of_one_prompt_report_it_once(tiny):
    llm = make_llm(tiny)
    out = run(llm, tokens(60, 2 * BS + 1), params=SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=0))[0]
    assert out.cache_miss_reason in ("new", "waited")
    assert (out.num_cached_tokens == 0) == (out.cache_miss_reason == "new")


def test_disabled(tiny):
    llm = make_llm(tiny, enable_prefix_caching=False)
    prompt = tokens(70, 2 * BS + 1)
    assert report(llm, prompt) == (0, "disabled")
    assert report(llm, prompt) == (0, "disabled")


def test_the_eviction_record_is_bounded():
    pool = BlockPool(2, evicted_record_size=3)
    keys = [bytes([i]) * 32 for i in range(6)]
    for key in keys:
        (block,) = pool.take_new(1)
        pool.cache(block, key)
        pool.release([block])
    assert pool.num_evictions == 4  # the last four takes each evicted the oldest cached key: keys 0-3
    assert [pool.was_evicted(k) for k in keys] == [False, True, True, True, False, False]
    (block,) = pool.take_new(1)  # evicts keys[4]
    assert pool.was_evicted(keys[4]) and not pool.was_evicted(keys[1])
    pool.cache(block, keys[4])
    assert not pool.was_evicted(keys[4]), "cached again: no longer a recent eviction"


def test_aggregate_over_several_prompts():
    assert aggregate(["hit", "hit"]) == "hit"
    assert aggregate(["hit", "new", "evicted"]) == "new"
    assert aggregate([None, "waited"]) == "waited"
    assert aggregate([]) is None
    assert set(MISS_REASONS) == {"hit", "new", "evicted", "last_token", "waited", "disabled", "window"}
