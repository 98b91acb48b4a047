"""Where vLLM's engine thread spends its time in the engine-core loop of
``benches/bench_vllm_engine.py`` (one side, one setting), by part: kvblocks (its hasher and
KV-cache manager, Python and Rust), vLLM's scheduler, vLLM's request and engine code, output
encoding, and the instant executor (a device's work, left out of the replay). A built-in
function's time goes to the part that called it.

    python benches/profile_engine_loop.py [--running 1024] [--sync] [--impl kvblocks]
        [--sampler cprofile|py-spy]

Two ways to look: cProfile (the default; it slows Python code more than calls into Rust, and
charges a built-in's time to its caller) and py-spy (``pip install py-spy``), which samples
the running loop 1,000 times a second with native frames, Rust's included, and changes
nothing in it: the figure for kvblocks' share of the engine thread. docs/engine-loop.md has
the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable

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


def sampled_breakdown(raw_lines: Iterable[str], loop_lines: range) -> dict[str, float]:
    """Samples (py-spy's raw format: ``frame;frame;... count``) taken in the engine loop of
    :func:`record` (its lines ``loop_lines``), by part: the first kvblocks frame (Python or
    its Rust extension) below the loop makes a sample kvblocks'; else the innermost frame's
    part."""
    totals: dict[str, float] = defaultdict(float)
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith("record (")), None)
        if at is None or int(frames[at].rsplit(":", 1)[1].rstrip(")")) not in loop_lines:
            continue
        below = frames[at + 1 :]
        owner = "other (Python's library, vLLM's utilities)"
        if any("kvblocks/vllm/bench/" in f for f in below) or not below:
            owner = PARTS[0][1]
        elif any("(kvblocks/" in f or "kvblocks/_core" in f for f in below):
            owner = "kvblocks (hasher, KV-cache manager)"
        else:
            for frame in reversed(below):
                where = frame.rpartition(" (")[2]
                label = next((lab for marker, lab in PARTS[2:] if marker in where), None)
                if label is not None:
                    owner = label
                    break
        totals[owner] += int(count)
    return dict(totals)


def sample(args: argparse.Namespace) -> dict[str, float]:
    """Runs this script's plain loop under ``py-spy record`` and returns the sampled parts."""
    import inspect

    from kvblocks.vllm.bench import engine_loop

    source, first = inspect.getsourcelines(engine_loop.record)
    start = next(i for i, line in enumerate(source) if "while engine.scheduler" in line)
    end = next(i for i, line in enumerate(source) if "calls.append(clock.finish())" in line)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.txt")
        command = ["py-spy", "record", "--native", "-f", "raw", "-r", "1000", "-o", out]
        command += ["--", sys.executable, __file__, "--plain", *_forwarded(args)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as samples:
            return sampled_breakdown(samples, range(first + start, first + end + 1))


def _forwarded(args: argparse.Namespace) -> list[str]:
    sync = ["--sync"] if args.sync else []
    return ["--running", str(args.running), "--impl", args.impl, "--workload", args.workload, *sync]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--sync", action="store_true", help="async scheduling off")
    parser.add_argument("--impl", choices=["kvblocks", "vllm"], default="kvblocks")
    parser.add_argument("--workload", default="shared prefix")
    parser.add_argument("--sampler", choices=["cprofile", "py-spy"], default="cprofile")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sampler == "py-spy":
        totals = sample(args)
    else:
        select_cpu_platform()
        record(args.impl, workload(args.workload, 16, 8), not args.sync)  # imports, warm-up
        profiler = None if args.plain else cProfile.Profile()
        run = workload(args.workload, args.running)
        record(args.impl, run, not args.sync, profiler=profiler)
        if profiler is None:
            return  # the loop py-spy samples
        totals = breakdown(pstats.Stats(profiler))
    engine = sum(t for p, t in totals.items() if not p.startswith("instant"))
    mode = "async off" if args.sync else "async on"
    print(f"{args.impl}, {args.running} running, {mode}, {args.sampler}:")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        share = "" if name.startswith("instant") else f"{seconds / engine:6.1%}"
        amount = f"{seconds:7.0f} samples" if args.sampler == "py-spy" else f"{seconds:7.3f} s"
        print(f"  {name:45s} {amount} {share}")


if __name__ == "__main__":
    main()
