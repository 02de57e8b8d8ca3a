"""Token buckets keyed by client IP or by peer.

Each key earns ``rate`` tokens a second up to ``burst``; a request spends one.
The table of keys is bounded: the least recently used key is forgotten first,
which at worst hands a forgotten client a fresh (full) bucket. Pure: the caller
passes ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class RateLimiter:
    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def check(self, key: Hashable, now: float) -> float | None:
        """Spend one token for ``key``. None if allowed, else seconds until one is earned."""
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1:
            tokens -= 1
            wait = None
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait
