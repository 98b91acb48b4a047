"""Where vLLM's engine thread spends its time in the engine-core loop of
``benches/bench_vllm_engine.py`` (one side, one setting), by part: kvblocks (its hasher and
KV-cache manager, Python and Rust), vLLM's scheduler, vLLM's request and engine code, output
encoding, and the instant executor (a device's work, left out of the replay). A built-in
function's time goes to the part that called it.

    python benches/profile_engine_loop.py [--running 1024] [--sync] [--impl kvblocks]

cProfile slows Python code more than the calls into Rust, so kvblocks' share here is an upper
bound on the order of the real one; docs/engine-loop.md has the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

from kvblocks.vllm.bench.engine_loop import record, workload
from kvblocks.vllm.bench.platform import select_cpu_platform

PARTS = (
    ("kvblocks/vllm/bench/", "instant executor (not the engine's)"),
    ("kvblocks", "kvblocks (hasher, KV-cache manager)"),
    ("vllm/v1/core/sched/", "vLLM's scheduler"),
    ("vllm/v1/core/", "vLLM's KV-cache code (kv_cache_utils)"),
    ("serial_utils", "output encoding"),
    ("vllm/v1/request", "vLLM's Request"),
    ("vllm/v1/engine/", "vLLM's engine core"),
)


def part(key: tuple[str, int, str]) -> str | None:
    """The part of a profiled function; None for a built-in (charged to its callers)."""
    path, _, name = key
    if path == "~":
        return "kvblocks (hasher, KV-cache manager)" if "kvblocks._core" in name else None
    for marker, label in PARTS:
        if marker in path:
            return label
    return "other (Python's library, vLLM's utilities)"


def breakdown(stats: pstats.Stats) -> dict[str, float]:
    table = stats.stats  # type: ignore[attr-defined]
    totals: dict[str, float] = defaultdict(float)
    for key, (_, _, tottime, _, callers) in table.items():
        owner = part(key)
        if owner is not None:
            totals[owner] += tottime
            continue
        # A built-in: its time per caller, charged to the caller's part.
        for caller, (_, _, caller_tt, _) in callers.items():
            totals[part(caller) or "other (Python's library, vLLM's utilities)"] += caller_tt
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--sync", action="store_true", help="async scheduling off")
    parser.add_argument("--impl", choices=["kvblocks", "vllm"], default="kvblocks")
    parser.add_argument("--workload", default="shared prefix")
    args = parser.parse_args()
    select_cpu_platform()
    record(args.impl, workload(args.workload, 16, 8), not args.sync)  # imports, warm-up
    profiler = cProfile.Profile()
    record(args.impl, workload(args.workload, args.running), not args.sync, profiler=profiler)
    totals = breakdown(pstats.Stats(profiler))
    engine = sum(t for p, t in totals.items() if not p.startswith("instant"))
    print(f"{args.impl}, {args.running} running, async {'off' if args.sync else 'on'}:")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        share = "" if name.startswith("instant") else f"{seconds / engine:6.1%}"
        print(f"  {name:45s} {seconds:7.3f} s {share}")


if __name__ == "__main__":
    main()
