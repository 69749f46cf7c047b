"""Why a request's prompt was not (wholly) served from the prefix cache: one word per request.

The reason is about the first full block the request had to compute -- where its cached prefix ended:

- ``hit``: every full block of the prompt came from the cache (the rest is its partial last block).
- ``last_token``: that block was cached, but a prompt of exactly k full blocks reuses at most k - 1 (one
  token must be computed for the first output's logits).
- ``waited``: the request waited a step for a block another request was computing right then, and then
  found it in the cache (what follows a shared prefix may still be new).
- ``evicted``: that block's key was cached and has been evicted lately (a bounded record of keys).
- ``new``: never cached -- including a prompt with no full block, and a prefix cached only under another
  ``cache_salt``: keys include the salt, so other tenants' blocks are invisible here, by construction.
- ``window``: the full-attention layers still had that block, but the sliding-window layers' blocks its
  window needs had been evicted (``pagedkv.kv.hybrid``; docs/sliding-window.md).
- ``disabled``: the engine runs without prefix caching.

Precedence is the order of the checks in ``miss_reason``: ``disabled``, ``waited``, ``hit``, ``last_token``,
``evicted``, ``new``; ``window`` comes right after ``waited`` (``HybridKVCacheManager.miss_reason``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.kv.hashing import BlockKey

if TYPE_CHECKING:
    from pagedkv.kv.block_pool import BlockPool

HIT, NEW, EVICTED, LAST_TOKEN, WAITED, DISABLED = "hit", "new", "evicted", "last_token", "waited", "disabled"
WINDOW = "window"
MISS_REASONS = (HIT, NEW, EVICTED, LAST_TOKEN, WAITED, DISABLED, WINDOW)


def miss_reason(
    pool: BlockPool | None,
    block_keys: Sequence[BlockKey],
    num_hit_blocks: int,
    waited_for_block: int | None = None,
) -> str:
    """The reason for a request admitted with ``num_hit_blocks`` leading blocks from the cache.

    ``pool``: None when prefix caching is off. ``waited_for_block``: the index of the first uncached block
    when the request was first held back because another request was computing it (None if never held).
    Call it right after the lookup, before the request's own blocks are cached.
    """
    if pool is None:
        return DISABLED
    if waited_for_block is not None and num_hit_blocks > waited_for_block:
        return WAITED
    if num_hit_blocks >= len(block_keys):
        return HIT if block_keys else NEW
    key = block_keys[num_hit_blocks]
    if pool.lookup(key) is not None:  # found, yet not reused: only the one-token rule stops a found block
        return LAST_TOKEN
    if pool.was_evicted(key):
        return EVICTED
    return NEW


def aggregate(reasons: Sequence[str | None]) -> str | None:
    """One reason for several prompts (an API request with a list of prompts): the first prompt's that is
    not ``hit``, else ``hit``; None if none is known."""
    known = [r for r in reasons if r is not None]
    return next((r for r in known if r != HIT), known[0] if known else None)
