"""Prefix-cache scenarios on KVCacheManager, each pinned to one rule of docs/architecture.md "Prefix cache rules"."""

from __future__ import annotations

import pytest

from pagedkv.kv.hashing import extend_block_keys
from pagedkv.kv.manager import KVCacheManager, PrefixHit

BS = 4


def keys_of(tokens: list[int], salt: str | None = None, block_size: int = BS) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, tokens, block_size, salt)
    return keys


def run_prompt(m: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> PrefixHit:
    """What the scheduler + engine do for a whole prompt in one step: look up, allocate, key full blocks."""
    keys = keys_of(tokens, salt, m.block_size)
    hit = m.find_cached_prefix(keys, len(tokens))
    assert m.allocate(rid, len(tokens), hit)
    m.cache_full_blocks(rid, keys, len(tokens) // m.block_size)
    return hit


def snapshot(m: KVCacheManager, rids: list[str]) -> tuple:
    pool = m.pool
    keys = [pool.key_of(b) for b in range(pool.num_blocks)]
    return m.ref_counts(), pool.free_order(), keys, m.stats(), [list(m.block_table(r)) for r in rids]


def test_partial_blocks_are_never_cached() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    assert len(keys_of(tokens)) == 2
    run_prompt(m, "a", tokens)
    assert m.pool.num_cached_blocks() == 2
    with pytest.raises(ValueError, match="exceeds"):
        m.cache_full_blocks("a", keys_of(tokens), 3)
    hit = m.find_cached_prefix(keys_of(tokens + [10, 11, 12]), 13)
    assert hit.block_ids == m.block_table("a")[:2], "the partial third block must not be found"


def test_prompt_of_exactly_k_full_blocks_reuses_k_minus_one() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(3 * BS))
    run_prompt(m, "a", tokens)
    hit = m.find_cached_prefix(keys_of(tokens), len(tokens))
    assert hit.block_ids == m.block_table("a")[:2] and hit.num_tokens == 2 * BS
    one_more = m.find_cached_prefix(keys_of(tokens + [99]), len(tokens) + 1)
    assert one_more.block_ids == m.block_table("a") and one_more.num_tokens == 3 * BS
    assert m.find_cached_prefix(keys_of(tokens[:BS]), BS).block_ids == []
    assert m.find_cached_prefix([], 0).block_ids == []


def test_find_is_pure() -> None:
    m = KVCacheManager(6, BS)
    run_prompt(m, "a", list(range(9)))
    m.free("a")
    before = snapshot(m, [])
    m.find_cached_prefix(keys_of(list(range(9))), 9)
    assert snapshot(m, []) == before


def test_hit_after_free_reuses_blocks_with_ref_zero() -> None:
    m = KVCacheManager(6, BS)
    run_prompt(m, "a", list(range(9)))
    table_a = list(m.block_table("a"))
    m.free("a")
    assert m.ref_counts() == [0] * 6 and m.num_free_blocks == 6
    hit = run_prompt(m, "b", list(range(9)) + [50])
    assert hit.block_ids == table_a[:2]
    assert m.pool.free_order()[:1] == [4], "never-used blocks 3, 4, 5 were freed before a's blocks"
    assert m.block_table("b") == table_a[:2] + [3]
    assert [m.ref_counts()[b] for b in table_a[:2]] == [1, 1]
    assert m.stats()["evictions"] == 0


def test_eviction_is_lru_and_a_finished_request_goes_tail_first() -> None:
    m = KVCacheManager(4, 2)
    a, b = [1, 1, 2, 2, 9], [3, 3, 4, 4, 9]
    run_prompt(m, "a", a)  # blocks 0, 1 cached, 2 partial
    m.free("a")  # queue: 3, 2, 1, 0
    run_prompt(m, "b", b)  # takes 3, 2 (a's partial tail) and 1 (a's second block: evicted)
    assert m.block_table("b") == [3, 2, 1]
    assert m.stats()["evictions"] == 1
    m.free("b")  # queue: 0, 1, 2, 3
    assert m.pool.free_order() == [0, 1, 2, 3]
    hit_a = m.find_cached_prefix(keys_of(a, block_size=2), len(a))
    assert hit_a.block_ids == [0], "a's first block survives: it was freed last"
    assert m.allocate("c", 2)  # evicts the least recently freed cached block: a's head
    assert m.block_table("c") == [0]
    assert m.find_cached_prefix(keys_of(a, block_size=2), len(a)).block_ids == []
    assert m.find_cached_prefix(keys_of(b, block_size=2), len(b)).block_ids == [3, 2]


def test_hit_on_a_free_block_pulls_it_out_of_the_eviction_queue() -> None:
    m = KVCacheManager(4, 2)
    run_prompt(m, "a", [1, 1, 2])
    m.free("a")  # queue: 2, 3, 1, 0 with block 0 keyed
    hit = run_prompt(m, "b", [1, 1, 5, 5, 6])
    assert hit.block_ids == [0]
    assert m.block_table("b") == [0, 2, 3]
    assert m.pool.free_order() == [1]


def test_hit_stops_at_the_first_missing_block() -> None:
    m = KVCacheManager(6, BS)
    tokens = list(range(2 * BS + 1))
    keys = keys_of(tokens)
    assert m.allocate("a", len(tokens)) and m.allocate("b", len(tokens))
    m.cache_full_blocks("a", keys, 1)
    m.cache_full_blocks("b", keys, 2)  # b's block 0 stays unkeyed (a has it), b's block 1 is keyed
    m.free("a")
    assert m.allocate("x", 3 * BS)  # evicts a's block 0: the chain's head is gone, its second link is not
    assert m.pool.lookup(keys[1]) == m.block_table("b")[1]
    assert m.find_cached_prefix(keys, len(tokens)).block_ids == []


def test_eviction_removes_the_key() -> None:
    m = KVCacheManager(2, BS)
    tokens = list(range(BS + 1))
    run_prompt(m, "a", tokens)
    m.free("a")
    assert m.allocate("b", 2 * BS)
    assert m.stats()["evictions"] == 1
    assert m.find_cached_prefix(keys_of(tokens), len(tokens)).block_ids == []
    assert m.pool.num_cached_blocks() == 0


def test_failed_allocation_changes_nothing() -> None:
    m = KVCacheManager(4, 2)
    run_prompt(m, "a", [1, 1, 2, 2, 3])  # 3 blocks
    m.free("a")
    run_prompt(m, "x", [7, 7, 8])  # holds 2 blocks: 1 free block left... plus a's cached head
    tokens = [1, 1, 5, 5, 6, 6, 7]  # hits a's head (free, so reviving it uses the pool), needs 3 new
    hit = m.find_cached_prefix(keys_of(tokens, block_size=2), len(tokens))
    assert len(hit.block_ids) == 1 and m.num_free_blocks == 2
    assert m.num_blocks_needed("b", len(tokens), hit) == 4
    before = snapshot(m, ["x", "b"])
    assert not m.allocate("b", len(tokens), hit)
    assert snapshot(m, ["x", "b"]) == before
    assert not m.allocate("x", 4 * 2 + 1)
    assert snapshot(m, ["x", "b"]) == before
    assert m.allocate("b", 3, hit), "the same hit still fits a shorter chunk"


def test_reset_only_when_idle() -> None:
    m = KVCacheManager(6, BS)
    tokens = list(range(9))
    run_prompt(m, "a", tokens)
    stats = m.stats()
    assert not m.reset_prefix_cache()
    assert len(m.find_cached_prefix(keys_of(tokens), 9).block_ids) == 2
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.find_cached_prefix(keys_of(tokens), 9).block_ids == []
    assert m.stats()["evictions"] == stats["evictions"] == 0
    assert m.num_free_blocks == 6


def test_different_cache_salts_never_share() -> None:
    m = KVCacheManager(16, BS)
    tokens = list(range(3 * BS + 1))
    keys = {salt: keys_of(tokens, salt) for salt in (None, "a", "b", "")}
    for i in range(3):
        assert len({k[i] for k in keys.values()}) == 4, f"block {i} key must differ across salts"
    run_prompt(m, "a1", tokens, "a")
    assert m.find_cached_prefix(keys["b"], len(tokens)).block_ids == []
    assert m.find_cached_prefix(keys[None], len(tokens)).block_ids == []
    assert m.find_cached_prefix(keys[""], len(tokens)).block_ids == []
    assert m.find_cached_prefix(keys["a"], len(tokens)).block_ids == m.block_table("a1")[:3]


def test_identical_content_cached_concurrently_keeps_both_valid() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(2 * BS + 1))
    keys = keys_of(tokens)
    for rid in ("a", "b"):  # both admitted before either has keyed its blocks: no hits
        assert m.allocate(rid, len(tokens), m.find_cached_prefix(keys, len(tokens)))
    table_a, table_b = list(m.block_table("a")), list(m.block_table("b"))
    assert not set(table_a) & set(table_b)
    m.cache_full_blocks("b", keys, 2)
    m.cache_full_blocks("a", keys, 2)
    assert [m.pool.key_of(b) for b in table_a[:2]] == [None, None]
    assert [m.pool.lookup(k) for k in keys] == table_b[:2], "the first mapping is kept"
    assert m.block_table("a") == table_a and m.block_table("b") == table_b
    m.free("b")
    hit = run_prompt(m, "c", tokens)
    assert hit.block_ids == table_b[:2]
    m.free("a")
    m.free("c")
    assert m.ref_counts() == [0] * 8 and m.pool.num_cached_blocks() == 2


def test_counters_add_up() -> None:
    m = KVCacheManager(10, BS)
    prompts = {"a": list(range(9)), "b": list(range(8)) + [40, 41], "c": list(range(4)) + [7] * 5}
    expected_hits = {"a": 0, "b": 8, "c": 4}
    for rid, tokens in prompts.items():
        assert run_prompt(m, rid, tokens).num_tokens == expected_hits[rid]
    s = m.stats()
    queries = sum(len(t) for t in prompts.values())
    assert s["prefix_cache_queries"] == queries
    assert s["prefix_cache_hits"] == 12
    assert s["prefix_cache_hit_rate"] == pytest.approx(12 / queries)
    held = {b for rid in prompts for b in m.block_table(rid)}
    assert s["kv_blocks_used"] == len(held) == 3 + 1 + 2
    assert s["kv_blocks_free"] == 10 - len(held) and s["kv_blocks_total"] == 10
    assert sum(m.ref_counts()) == sum(len(m.block_table(rid)) for rid in prompts)


def test_allocate_grows_a_table_and_free_of_unknown_is_a_noop() -> None:
    m = KVCacheManager(4, BS)
    assert m.allocate("a", 1) and m.block_table("a") == [0]
    assert m.num_blocks_needed("a", BS) == 0 and m.num_blocks_needed("a", BS + 1) == 1
    assert m.allocate("a", BS) and m.block_table("a") == [0]
    assert m.allocate("a", 2 * BS + 1) and m.block_table("a") == [0, 1, 2]
    m.free("nobody")
    assert m.block_table("nobody") == [] and m.num_used_blocks == 3


def test_prefix_misuse_is_rejected() -> None:
    m = KVCacheManager(4, BS)
    tokens = list(range(BS + 1))
    run_prompt(m, "a", tokens)
    hit = m.find_cached_prefix(keys_of(tokens), len(tokens))
    with pytest.raises(ValueError, match="first allocate"):
        m.allocate("a", 8, hit)
    with pytest.raises(ValueError, match="cover"):
        m.allocate("b", 2, hit)
    m.free("a")
    assert m.allocate("z", 4 * BS)  # evicts a's block: the hit went stale
    m.free("z")
    with pytest.raises(ValueError, match="stale"):
        m.allocate("b", len(tokens), hit)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_prefix_caching_disabled_never_hits_or_counts() -> None:
    m = KVCacheManager(4, BS, enable_prefix_caching=False)
    tokens = list(range(BS + 1))
    run_prompt(m, "a", tokens)
    m.free("a")
    hit = m.find_cached_prefix(keys_of(tokens), len(tokens))
    assert hit.block_ids == [] and hit.num_tokens == 0
    assert m.pool.num_cached_blocks() == 0
    assert m.stats()["prefix_cache_queries"] == 0 and m.stats()["prefix_cache_hit_rate"] == 0.0
