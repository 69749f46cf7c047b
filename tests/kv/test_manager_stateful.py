"""Stateful property test: KVCacheManager against an independent reference model.

The model names cached content by the whole (salt, token prefix) tuple instead of a hash chain, keeps the
free queue as a plain list, and records which tokens were written into each block, so a prefix hit can be
checked against what the blocks really hold. It also keeps what the cache report and the KV map read: every
content evicted since (for ``miss_reason``), per-block hit counts, and each block's parent. Tokens come from
a 3-letter alphabet so prefixes collide often, and the pool is tiny so allocations fail and blocks get
evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.kv.hashing import extend_block_keys
from pagedkv.kv.manager import KVCacheManager, PrefixHit

ALPHABET = st.sampled_from([0, 1, 2])
Content = tuple  # (salt, tokens of the whole prefix up to the end of the block)


@dataclass
class Req:
    tokens: list[int]
    salt: str | None
    keys: list[bytes] = field(default_factory=list)
    alloc: int = 0  # positions [0, alloc) are covered by the table and written
    table: list[int] = field(default_factory=list)
    num_keyed: int = 0


class Model:
    """Reference semantics of the prefix cache, written for clarity, not speed."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.n, self.bs, self.caching = num_blocks, block_size, caching
        self.ref = [0] * num_blocks
        self.free = list(range(num_blocks))
        self.content: list[Content | None] = [None] * num_blocks
        self.cached: dict[Content, int] = {}
        self.written: list[Content | None] = [None] * num_blocks
        self.queries = self.hits = self.evictions = 0
        self.evicted: set[Content] = set()  # every content evicted and not cached again since
        self.block_hits = [0] * num_blocks  # prefix hits on each block since it was cached

    def prefix_content(self, req: Req, i: int) -> Content:
        return (req.salt, tuple(req.tokens[: (i + 1) * self.bs]))

    def find(self, req: Req) -> list[int]:
        if not self.caching:
            return []
        hit: list[int] = []
        for i in range(max(len(req.tokens) - 1, 0) // self.bs):
            block = self.cached.get(self.prefix_content(req, i))
            if block is None:
                break
            hit.append(block)
        return hit

    def miss_reason(self, req: Req, num_hit_blocks: int) -> str:
        """Why the cached prefix ends after ``num_hit_blocks`` blocks (pagedkv.kv.cache_report's words)."""
        if not self.caching:
            return "disabled"
        if num_hit_blocks >= len(req.tokens) // self.bs:
            return "hit" if len(req.tokens) >= self.bs else "new"
        content = self.prefix_content(req, num_hit_blocks)
        if content in self.cached:
            return "last_token"
        return "evicted" if content in self.evicted else "new"

    def allocate(self, req: Req, num_tokens: int, prefix: list[int] | None) -> bool:
        prefix = prefix or []
        new = max(0, -(-num_tokens // self.bs) - len(req.table) - len(prefix))
        if new + sum(self.ref[b] == 0 for b in prefix) > len(self.free):
            return False
        for b in prefix:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            self.block_hits[b] += 1
        req.table.extend(prefix)
        req.num_keyed = max(req.num_keyed, len(prefix))
        for _ in range(new):
            b = self.free.pop(0)
            if self.content[b] is not None:
                del self.cached[self.content[b]]
                self.evicted.add(self.content[b])
                self.content[b] = None
                self.block_hits[b] = 0
                self.evictions += 1
            self.ref[b] = 1
            req.table.append(b)
        start = max(req.alloc, len(prefix) * self.bs)
        for i in range(start // self.bs, -(-num_tokens // self.bs)):
            self.written[req.table[i]] = (req.salt, tuple(req.tokens[: min(num_tokens, (i + 1) * self.bs)]))
        req.alloc = max(req.alloc, num_tokens)
        return True

    def cache(self, req: Req, num_full: int) -> None:
        if not self.caching:
            return
        for i in range(req.num_keyed, num_full):
            key = self.prefix_content(req, i)
            if key not in self.cached:
                self.cached[key] = req.table[i]
                self.content[req.table[i]] = key
                self.evicted.discard(key)
        req.num_keyed = max(req.num_keyed, num_full)

    def release(self, req: Req) -> None:
        for b in reversed(req.table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def reset(self) -> bool:
        if len(self.free) != self.n:
            return False
        self.cached.clear()
        self.content = [None] * self.n
        self.evicted.clear()
        self.block_hits = [0] * self.n
        return True


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 20),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.model = Model(num_blocks, block_size, caching)
        self.reqs: dict[str, Req] = {}
        self.past: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1]]
        self.next_id = 0

    def snapshot(self) -> tuple:
        pool = self.m.pool
        return (
            self.m.ref_counts(),
            pool.free_order(),
            [pool.key_of(b) for b in range(pool.num_blocks)],
            self.m.stats(),
            {rid: list(self.m.block_table(rid)) for rid in self.reqs},
        )

    def check_hit_holds_tokens(self, req: Req, block_ids: list[int]) -> None:
        for i, b in enumerate(block_ids):
            assert self.model.written[b] == self.model.prefix_content(req, i), "hit block holds other tokens"

    def do_allocate(self, rid: str, req: Req, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        before = self.snapshot()
        ok = self.m.allocate(rid, num_tokens, prefix)
        assert ok == self.model.allocate(req, num_tokens, prefix.block_ids if prefix else None)
        if not ok:
            assert self.snapshot() == before, "failed allocation changed state"
        return ok

    @rule(data=st.data(), salt=st.sampled_from([None, None, "s"]))
    def add_request(self, data: st.DataObject, salt: str | None) -> None:
        base = data.draw(st.sampled_from(self.past))
        if data.draw(st.integers(0, 3)) == 0:  # a repeat: hits, and for whole blocks the one-token rule
            tokens = list(base)
        else:
            base = base[: data.draw(st.integers(0, len(base)))]
            tokens = base + data.draw(st.lists(ALPHABET, min_size=0 if base else 1, max_size=10))
        self.past.append(tokens)
        rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        req = Req(tokens, salt)
        extend_block_keys(req.keys, tokens, self.m.block_size, salt)
        hit = self.m.find_cached_prefix(req.keys, len(tokens))
        expected = self.model.find(req)
        assert hit.block_ids == expected
        assert hit.num_tokens == len(hit.block_ids) * self.m.block_size < len(tokens)
        assert self.m.miss_reason(req.keys, hit, None) == self.model.miss_reason(req, len(expected))
        self.check_hit_holds_tokens(req, hit.block_ids)
        chunk = data.draw(st.integers(hit.num_tokens + 1, len(tokens)))
        if self.do_allocate(rid, req, chunk, hit):
            self.reqs[rid] = req
            if self.model.caching:
                self.model.queries += len(tokens)
                self.model.hits += len(expected) * self.m.block_size
            if data.draw(st.booleans()):
                self.cache_all(rid, req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        if req.alloc == len(req.tokens):
            req.tokens.extend(data.draw(st.lists(ALPHABET, min_size=1, max_size=5)))
            extend_block_keys(req.keys, req.tokens, self.m.block_size, req.salt)
        if self.do_allocate(rid, req, data.draw(st.integers(req.alloc, len(req.tokens)))) and data.draw(st.booleans()):
            self.cache_all(rid, req)

    def cache_all(self, rid: str, req: Req) -> None:
        """What the engine does after a step: key every block that is now full."""
        self.m.cache_full_blocks(rid, req.keys, req.alloc // self.m.block_size)
        self.model.cache(req, req.alloc // self.m.block_size)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        num_full = data.draw(st.integers(0, req.alloc // self.m.block_size))
        self.m.cache_full_blocks(rid, req.keys, num_full)
        self.model.cache(req, num_full)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.m.free(rid)
        self.model.release(self.reqs.pop(rid))

    @rule()
    def free_unknown(self) -> None:
        before = self.snapshot()
        self.m.free("no-such-request")
        assert self.snapshot() == before

    @rule()
    def reset(self) -> None:
        assert self.m.reset_prefix_cache() == self.model.reset()

    @invariant()
    def matches_model(self) -> None:
        m, model = self.m, self.model
        refs = m.ref_counts()
        assert min(refs) >= 0
        assert refs == model.ref
        assert m.num_used_blocks + m.num_free_blocks == m.num_total_blocks
        assert m.num_free_blocks == refs.count(0) == len(model.free)
        assert m.pool.free_order() == model.free
        owners = [0] * model.n
        for rid, req in self.reqs.items():
            assert m.block_table(rid) == req.table
            assert len(set(req.table)) == len(req.table)
            for b in req.table:
                owners[b] += 1
        for b, count in enumerate(owners):
            assert refs[b] == count
            if count > 1:
                assert model.content[b] is not None, "block shared by two requests without being cached"
            key = m.pool.key_of(b)
            assert (key is None) == (model.content[b] is None)
            assert key is None or m.pool.lookup(key) == b
            assert m.pool.parent_key_of(b) == parent_key(model.content[b], model.bs)
        assert m.pool.hits() == model.block_hits
        stats = m.stats()
        assert stats["evictions"] == model.evictions
        assert stats["prefix_cache_queries"] == model.queries
        assert stats["prefix_cache_hits"] == model.hits
        assert stats["kv_blocks_free"] + stats["kv_blocks_used"] == stats["kv_blocks_total"] == model.n


def parent_key(content: Content | None, block_size: int) -> bytes | None:
    """The key of the block before a cached block, from its content: the chain's key of its prefix."""
    if content is None or len(content[1]) == block_size:
        return None
    salt, tokens = content
    keys: list[bytes] = []
    extend_block_keys(keys, list(tokens[:-block_size]), block_size, salt)
    return keys[-1]


ManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerStateful = ManagerMachine.TestCase
