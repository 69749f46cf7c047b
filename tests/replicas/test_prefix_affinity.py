"""The router's memory of which replica was sent which block keys (no Ray needed)."""

from __future__ import annotations

import pytest

from pagedkv.entrypoints.replicas.prefix_affinity import Match, PrefixAffinity
from pagedkv.kv.hashing import extend_block_keys

BLOCK = 4


def keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_keys(out, tokens, BLOCK, salt)
    return out


SHARED = list(range(100, 112))  # 3 blocks


def test_longest_match_wins_and_stops_at_the_first_block_nobody_holds():
    table = PrefixAffinity()
    table.record(keys(SHARED), "a")
    table.record(keys(SHARED + [1, 2, 3, 4]), "b")  # b holds one block more
    assert table.match(keys(SHARED + [1, 2, 3, 4, 9, 9, 9, 9]), ["a", "b"]) == Match(4, ("b",))
    assert table.match(keys(SHARED + [7, 7, 7, 7]), ["a", "b"]) == Match(3, ("a", "b"))
    assert table.match(keys(SHARED + [1, 2, 3, 4]), ["a"]) == Match(3, ("a",))  # only candidates count
    assert table.match(keys([5] * 12), ["a", "b"]) == Match(0, ())
    # a chain breaks at its first unknown block, even if a later key were known: keys commit to the prefix
    assert table.match(keys([0, 0, 0, 0] + SHARED), ["a", "b"]) == Match(0, ())


def test_a_salt_is_part_of_every_key():
    table = PrefixAffinity()
    table.record(keys(SHARED, salt="tenant-1"), "a")
    assert table.match(keys(SHARED, salt="tenant-1"), ["a"]).blocks == 3
    assert table.match(keys(SHARED, salt="tenant-2"), ["a"]).blocks == 0
    assert table.match(keys(SHARED), ["a"]).blocks == 0


def test_capacity_forgets_the_oldest_and_keeps_a_requests_head_longest():
    table = PrefixAffinity()
    table.set_capacity("a", 4)
    first, second = keys(SHARED + [1] * 4), keys([9] * 8)
    table.record(first, "a")  # 4 blocks: full
    table.record(second, "a")  # 2 more: the two oldest of `first` go -- its tail, recorded first
    assert table.num_blocks("a") == 4
    assert table.match(first, ["a"]).blocks == 2  # its head survives
    assert table.match(second, ["a"]).blocks == 2


def test_forgetting_a_replica_drops_what_it_held():
    table = PrefixAffinity()
    table.record(keys(SHARED), "a")
    table.record(keys(SHARED), "b")
    table.forget("a")
    assert table.match(keys(SHARED), ["a", "b"]) == Match(3, ("b",))
    assert table.num_blocks("a") == 0 and table.replicas() == ["b"]


def test_bad_capacities_are_refused():
    with pytest.raises(ValueError, match="default_capacity"):
        PrefixAffinity(0)
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixAffinity().set_capacity("a", 0)
