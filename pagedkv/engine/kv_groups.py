"""Which KV manager a model gets, and how the KV memory splits between its block groups.

A model with sliding-window layers (Gemma 3) gets a :class:`HybridKVCacheManager`: its windowed layers hold
only each request's last window, in a pool of their own, so the memory they would have spent on whole
contexts goes to the full-attention layers instead (docs/sliding-window.md). Every other model gets the
plain :class:`KVCacheManager`, unchanged.
"""

from __future__ import annotations

import logging

from pagedkv.config import EngineConfig
from pagedkv.kv.disk_tier import DiskTier
from pagedkv.kv.hybrid import HybridKVCacheManager
from pagedkv.kv.manager import KVCacheManager
from pagedkv.model.spec import ModelSpec

logger = logging.getLogger(__name__)


def make_kv_manager(
    config: EngineConfig, spec: ModelSpec, num_blocks: int, world_size: int, disk: DiskTier | None = None
) -> KVCacheManager:
    """The engine's KV manager. ``num_blocks``: the pool size as if every layer held whole contexts (the
    ``num_kv_blocks`` option, or what ``kv_cache_memory_gb`` holds); the hybrid manager splits that memory.
    ``disk``: the disk tier (with ``kv_cache_dir``; the hybrid manager does not take one)."""
    windows = [w for w in spec.layer_windows if w]
    if not windows:
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, disk)
    if world_size > 1 or config.kv_cache_dir is not None:
        logger.info(
            "sliding-window layers keep every block of a request here (tensor parallelism and kv_cache_dir do not "
            "take the windowed block group yet): KV memory is that of full attention"
        )
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, disk)
    window = max(windows)  # blocks kept for the widest window serve every narrower one
    num_full_layers = spec.num_layers - len(windows)
    if config.num_kv_blocks is not None:
        full_blocks = window_blocks = num_blocks
    else:
        need = window_group_need(window, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
        full_blocks, window_blocks = split_kv_budget(num_blocks * spec.num_layers, num_full_layers, len(windows), need)
    return HybridKVCacheManager(full_blocks, config.block_size, config.enable_prefix_caching, window, window_blocks)


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
