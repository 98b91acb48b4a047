"""Memory over a long churn of requests: after a warm-up, thousands more requests through the
block manager leave Python's allocations and the process's resident size where they were.

The thresholds depend on the CPython version, the allocator and the machine, so this lives
with the benchmarks (run once by CI, not in the default test run):

    pytest benches/bench_memory.py
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path

import kvblocks


def _rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def test_memory_returns_to_its_starting_size() -> None:
    m = kvblocks.BlockManager(2048, 16, enable_events=True)

    def churn(rounds: int) -> None:
        for i in range(rounds):
            h = m.add_request(f"r{i}", list(range(i % 300, i % 300 + 500)), cache_salt=str(i % 7))
            hits, n = m.get_computed_blocks(h)
            m.allocate_slots(h, 500 - n, num_new_computed_tokens=n, new_computed_blocks=hits)
            m.schedule_step([h], [1], new_token_ids=[1], new_token_offsets=[0, 1])
            m.remove_request(h)
            m.take_events()

    churn(300)  # warm up: the cache fills, allocators reach their working size
    gc.collect()
    tracemalloc.start()
    python_before = tracemalloc.get_traced_memory()[0]
    rss_before = _rss_bytes() if Path("/proc/self/statm").exists() else 0
    churn(3000)
    gc.collect()
    python_after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss_after = _rss_bytes() if rss_before else 0
    assert len(m) == 0
    assert m.num_free_blocks == 2047
    assert len(m.debug_state()["cached"]) <= 2047
    assert python_after - python_before < 64 * 1024
    assert rss_after - rss_before < 16 * 1024 * 1024
