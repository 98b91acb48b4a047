"""Memory over a long churn of requests: after a warm-up, thousands more requests through the
block manager leave Python's allocations and the process's resident size where they were.

The thresholds depend on the CPython version, the allocator and the operating system, so this
lives with the benchmarks (not in the default test run) and runs only where they were
measured, Linux with CPython 3.11: in ``.ci/run`` on the project's machine and in CI's
ubuntu-latest / 3.11 cell and vLLM job. Elsewhere it is skipped, with that reason.

    pytest benches/bench_memory.py
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from pathlib import Path

import pytest

import kvblocks

#: Where the thresholds below were measured.
MEASURED_ON = sys.platform == "linux" and sys.implementation.name == "cpython"
MEASURED_ON = MEASURED_ON and sys.version_info[:2] == (3, 11)

pytestmark = pytest.mark.skipif(
    not MEASURED_ON,
    reason="memory thresholds measured on Linux with CPython 3.11 only (tracemalloc and RSS "
    "growth depend on the CPython version, the allocator and the OS)",
)


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
