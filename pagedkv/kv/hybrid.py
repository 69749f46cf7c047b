"""HybridKVCacheManager: the KV manager of a model that mixes full-attention and sliding-window layers.

Two block groups (vLLM v1's hybrid allocator idea, KV cache groups): the full-attention layers' blocks, kept
by the base :class:`KVCacheManager` exactly as for any model, and the windowed layers' blocks, kept by a
:class:`WindowGroup` that releases what slid out of the window. Each group has its own pool tensors (sized by
its layer count), block ids and table per request; both use the same block keys. The scheduler and the
runner see one manager: every call here does both groups, all or nothing.

The rules -- what a prefix hit needs in the windowed group, what is evicted first, the memory bound -- are
written down in docs/sliding-window.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kv import cache_report
from pagedkv.kv.hashing import BlockKey
from pagedkv.kv.manager import KVCacheManager, PrefixHit
from pagedkv.kv.window_group import WindowGroup


class HybridKVCacheManager(KVCacheManager):
    """A :class:`KVCacheManager` whose requests also hold blocks of a :class:`WindowGroup` (``windowed``)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int, num_window_blocks: int
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.windowed = WindowGroup(num_window_blocks, block_size, window)

    def find_cached_prefix(
        self, block_keys: Sequence[BlockKey], num_prompt_tokens: int, from_start: bool = False
    ) -> PrefixHit:
        """The full-attention layers' hit, cut to the longest one whose window the windowed layers still hold."""
        full = super().find_cached_prefix(block_keys, num_prompt_tokens)
        window = self.windowed.longest_hit(block_keys, len(full.block_ids), from_start)
        k = window.num_blocks
        return PrefixHit(
            full.block_ids[:k],
            k * self.block_size,
            full.num_queried_tokens,
            full.block_keys[:k],
            window,
            window_cut=k < len(full.block_ids),
        )

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixHit | None = None,
        block_keys: Sequence[BlockKey] = (),
        num_computed_tokens: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bool:
        """As :meth:`KVCacheManager.allocate`, in both groups or neither. First (whether or not it succeeds)
        the blocks full of computed tokens are cached and the windowed blocks that slid out are released."""
        self.slide(request_id, block_keys, num_computed_tokens, token_ids)
        window_hit = None
        if prefix is not None:
            self._check_prefix(request_id, num_tokens, prefix)
            if prefix.window is None or prefix.window.num_blocks != len(prefix.block_ids):
                raise ValueError("a PrefixHit of this manager's find_cached_prefix() is needed (windowed layers)")
            window_hit = prefix.window
            self.windowed.check_hit(prefix.block_keys, window_hit)
        needed = self.windowed.num_blocks_needed(request_id, num_tokens, window_hit)
        if needed > self.windowed.pool.num_free_blocks:
            return False
        if not super().allocate(request_id, num_tokens, prefix, block_keys, num_computed_tokens, token_ids):
            return False
        self.windowed.allocate(request_id, num_tokens, window_hit)
        return True

    def slide(
        self, request_id: str, block_keys: Sequence[BlockKey], num_computed_tokens: int, token_ids: Sequence[int] = ()
    ) -> None:
        """After the request computed up to ``num_computed_tokens``: cache its full blocks in both groups, then
        release the windowed blocks no later query reads. The scheduler calls it after every step, so that
        between steps a request holds at most ``ceil(window / block_size) + 1`` windowed blocks."""
        self._cache_computed(request_id, block_keys, num_computed_tokens, token_ids)
        self.windowed.release_slid_out(request_id, num_computed_tokens)

    def cache_full_blocks(
        self, request_id: str, block_keys: Sequence[BlockKey], num_full_blocks: int, token_ids: Sequence[int] = ()
    ) -> None:
        super().cache_full_blocks(request_id, block_keys, num_full_blocks, token_ids)
        if self.enable_prefix_caching:
            self.windowed.cache_full_blocks(request_id, block_keys, num_full_blocks)

    def free(
        self,
        request_id: str,
        block_keys: Sequence[BlockKey] = (),
        num_computed_tokens: int = 0,
        token_ids: Sequence[int] = (),
    ) -> None:
        super().free(request_id, block_keys, num_computed_tokens, token_ids)  # caches both groups first
        self.windowed.free(request_id)

    def miss_reason(self, block_keys: Sequence[BlockKey], prefix: PrefixHit, waited_for_block: int | None) -> str:
        """As the base's, but ``window`` where the windowed layers' evicted blocks cut the hit short."""
        reason = super().miss_reason(block_keys, prefix, waited_for_block)
        if prefix.window_cut and reason not in (cache_report.DISABLED, cache_report.WAITED):
            return cache_report.WINDOW
        return reason

    def window_block_table(self, request_id: str) -> list[int]:
        """The request's windowed-layer block ids in position order, the null block where released."""
        return self.windowed.block_table(request_id)

    def reset_prefix_cache(self) -> bool:
        """Both groups' keys dropped, only while neither holds a block in use."""
        windowed = self.windowed.pool
        if windowed.num_free_blocks != windowed.num_blocks or self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        return self.pool.reset() and windowed.reset()

    def stats(self) -> dict[str, int | float]:
        windowed = self.windowed.pool
        return {
            **super().stats(),
            "kv_window_blocks_total": windowed.num_blocks,
            "kv_window_blocks_free": windowed.num_free_blocks,
            "kv_window_blocks_used": windowed.num_blocks - windowed.num_free_blocks,
            "kv_window_blocks_cached": windowed.num_cached_blocks(),
            "kv_window_evictions": windowed.num_evictions,
        }


def window_group_need(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Windowed blocks the running requests can hold at once: each at most ``ceil(window / block_size) + 1``
    between steps, one more while a step's chunk straddles a block, and the step's new tokens."""
    return max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def split_kv_budget(
    budget_layer_blocks: int, num_full_layers: int, num_windowed_layers: int, window_need: int
) -> tuple[int, int]:
    """(full-attention group blocks, windowed group blocks) for a budget of ``budget_layer_blocks`` blocks of
    one layer each.

    The windowed group gets ``window_need`` blocks and the full-attention group the rest; where the budget
    cannot spare that (or no layer attends fully), both get the same number: a windowed block of a request
    always has a full-attention twin, so the windowed group never needs more.
    """
    equal = max(1, budget_layer_blocks // (num_full_layers + num_windowed_layers))
    if window_need >= equal or num_full_layers == 0:
        return equal, equal
    full = max(1, (budget_layer_blocks - window_need * num_windowed_layers) // num_full_layers)
    return full, window_need
