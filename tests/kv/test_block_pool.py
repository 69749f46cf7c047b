"""Unit tests of the prefix cache's two building blocks: block keys (hashing) and the BlockPool."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import extend_block_keys, hash_block

K1, K2, K3 = b"k1", b"k2", b"k3"


def test_starts_all_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.free_order() == [0, 1, 2, 3, 4]
    assert pool.ref_counts() == [0] * 5
    assert pool.num_cached_blocks() == 0


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_take_new_hands_out_head_of_queue_with_ref_one() -> None:
    pool = BlockPool(4)
    assert pool.take_new(3) == [0, 1, 2]
    assert pool.ref_counts() == [1, 1, 1, 0]
    assert pool.free_order() == [3]
    with pytest.raises(RuntimeError):
        pool.take_new(2)
    assert pool.free_order() == [3], "a refused take must not pop anything"


def test_release_appends_in_given_order_and_lru_hands_oldest_first() -> None:
    pool = BlockPool(4)
    pool.take_new(4)
    pool.release([2, 0])
    pool.release([3, 1])
    assert pool.free_order() == [2, 0, 3, 1]
    assert pool.take_new(3) == [2, 0, 3]


def test_release_of_shared_block_frees_only_at_zero() -> None:
    pool = BlockPool(2)
    (b,) = pool.take_new(1)
    pool.touch([b])
    pool.release([b])
    assert pool.ref_count(b) == 1 and b not in pool.free_order()
    pool.release([b])
    assert pool.ref_count(b) == 0 and pool.free_order() == [1, b]
    with pytest.raises(RuntimeError, match="released more times"):
        pool.release([b])


def test_freed_block_keeps_key_and_touch_revives_it_out_of_the_queue() -> None:
    pool = BlockPool(3)
    a, b, c = pool.take_new(3)
    assert pool.cache(b, K1)
    pool.release([a, b, c])
    assert pool.lookup(K1) == b and pool.key_of(b) == K1
    pool.touch([b])
    assert pool.free_order() == [a, c]
    assert pool.ref_count(b) == 1 and pool.lookup(K1) == b
    assert pool.take_new(2) == [a, c]
    assert pool.num_evictions == 0, "a, c had no key: handing them out evicts nothing"


def test_take_new_evicts_the_key_of_a_cached_free_block() -> None:
    pool = BlockPool(2)
    a, b = pool.take_new(2)
    pool.cache(a, K1)
    pool.cache(b, K2)
    pool.release([b, a])
    assert pool.take_new(1) == [b]
    assert pool.lookup(K2) is None and pool.key_of(b) is None
    assert pool.lookup(K1) == a
    assert pool.num_evictions == 1
    assert pool.num_cached_blocks() == 1


def test_cache_keeps_the_first_block_for_a_key() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.take_new(3)
    assert pool.cache(a, K1)
    assert not pool.cache(b, K1)
    assert pool.lookup(K1) == a and pool.key_of(b) is None
    assert pool.cache(a, K1), "re-registering the same pair is a no-op success"
    assert pool.cache(b, K3)
    with pytest.raises(RuntimeError, match="different key"):
        pool.cache(b, K2)


def test_reset_only_when_no_block_is_held() -> None:
    pool = BlockPool(3)
    a, b, c = pool.take_new(3)
    pool.cache(a, K1)
    pool.cache(b, K2)
    pool.release([c, b])
    assert not pool.reset()
    assert pool.lookup(K1) == a and pool.lookup(K2) == b
    pool.release([a])
    order = pool.free_order()
    assert pool.reset()
    assert pool.lookup(K1) is None and pool.lookup(K2) is None
    assert pool.key_of(a) is None and pool.num_cached_blocks() == 0
    assert pool.free_order() == order
    assert pool.num_evictions == 0, "reset is not eviction"


_KEYS_SCRIPT = """
from pagedkv.kv.hashing import extend_block_keys, hash_block
keys = []
extend_block_keys(keys, list(range(10)), 4, "tenant-\u00e9")
keys.append(hash_block(None, [1, 2], ("x", 3, b"y", (None, True))))
print(",".join(k.hex() for k in keys))
"""


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    keys: list[bytes] = []
    extend_block_keys(keys, list(range(10)), 4, "tenant-\u00e9")
    keys.append(hash_block(None, [1, 2], ("x", 3, b"y", (None, True))))
    expected = ",".join(k.hex() for k in keys)
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


def test_hash_distinguishes_parent_tokens_and_extra_keys() -> None:
    parent = hash_block(None, [7])
    variants = [
        hash_block(None, [1, 2]),
        hash_block(b"", [1, 2]),
        hash_block(parent, [1, 2]),
        hash_block(None, [2, 1]),
        hash_block(None, [1, 2, 0]),
        hash_block(None, [12]),
        hash_block(None, [1], (2,)),
        hash_block(None, []),
        hash_block(None, [-1, 2]),
    ]
    extras = [("a",), (b"a",), (("a",),), ("a", "b"), ("ab",), (1,), ("1",), (True,), (None,), ((),)]
    extras += [((1, 2),), ((1,), 2), (2**70,)]
    variants += [hash_block(None, [1, 2], extra) for extra in extras]
    assert len(set(variants)) == len(variants)
    assert all(len(k) == 32 for k in variants)
    assert hash_block(parent, (1, 2), ("a",)) == hash_block(parent, [1, 2], ("a",))
    assert hash_block(None, range(3)) == hash_block(None, [0, 1, 2])


def test_extend_block_keys_is_a_chain_with_the_salt_in_the_first_block_only() -> None:
    tokens = list(range(11))
    keys: list[bytes] = []
    extend_block_keys(keys, tokens, 4, "s")
    assert keys == [
        hash_block(None, tokens[0:4], ("s",)),
        hash_block(keys[0], tokens[4:8]),
    ]
    grown: list[bytes] = []
    for n in range(len(tokens) + 6):
        extend_block_keys(grown, (tokens + [11, 12, 13, 14, 15, 16])[:n], 4, "s")
    assert grown[:2] == keys and len(grown) == 4
    unsalted: list[bytes] = []
    extend_block_keys(unsalted, tokens, 4)
    assert unsalted[0] == hash_block(None, tokens[0:4]) != keys[0]


def test_hashing_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block(None, [1], (1.5,))
    with pytest.raises(ValueError, match="parent"):
        hash_block("not-a-key", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int64"):
        hash_block(None, [2**64])
    with pytest.raises(ValueError, match="block_size"):
        extend_block_keys([], [1, 2], 0)
