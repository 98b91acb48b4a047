"""Prefix-cache statistics, as vLLM's ``PrefixCacheStats``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the previous ``make_prefix_cache_stats()``, recorded when a request is
    admitted (its first successful ``allocate_slots``): ``queries`` are its tokens and
    ``hits`` the tokens served from the cache. Requests admitted again after a preemption
    count only in the ``preempted_*`` fields."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 without queries)."""
        return self.hits / self.queries if self.queries else 0.0
