"""CounterHistory: the engine's cache counters sampled over time, for the KV map's charts.

The engine core offers a sample after every step; one is kept per ``interval_s`` at most, in a ring of
``capacity`` samples (10 minutes at the defaults), so recording costs one clock read per step and the
memory is fixed. Counters are cumulative (as in ``stats()``); rates over an interval are the reader's
differences, so a sample that is skipped loses no event.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# The stats() fields the charts draw, and the names they are kept under.
RECORDED = {
    "prefix_cache_queries": "queries",
    "prefix_cache_hits": "hits",
    "evictions": "evictions",
    "num_preemptions": "preemptions",
    "kv_blocks_used": "blocks_used",
    "kv_blocks_cached": "blocks_cached",
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
}


class CounterHistory:
    def __init__(self, interval_s: float = 0.5, capacity: int = 1200, clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._samples: deque[dict[str, float]] = deque(maxlen=capacity)
        self._last = float("-inf")

    def offer(self, stats: Callable[[], dict[str, float]]) -> None:
        """Record ``stats()`` if ``interval_s`` passed since the last sample; ``stats`` is called only then,
        so a step between samples costs a clock read."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._samples.append(_sample(now, stats()))

    def samples(self, current: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Oldest first; each ``{"t": unix time, "queries": ..., "hits": ..., ...}`` (cumulative counters).
        ``current``: the stats of this moment, appended as a last sample (not kept), so a chart ends now."""
        samples = list(self._samples)
        if current is not None:
            samples.append(_sample(self._clock(), current))
        return samples


def _sample(now: float, stats: dict[str, float]) -> dict[str, float]:
    return {"t": now, **{name: float(stats.get(field, 0)) for field, name in RECORDED.items()}}
