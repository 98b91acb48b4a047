"""Prints (and with ``--ratios-md FILE`` saves) the speed-up of each kvblocks variant over
its baseline (the pure-Python reference, or stock vLLM), from the medians pytest-benchmark
measured in this same run.

Each benchmark names itself in ``benchmark.extra_info``: ``case`` (the workload), ``impl``
(the variant) and ``baselines``, a list of ``[case, impl]`` pairs to divide by. A benchmark
whose timed call includes set-up it does not want compared puts the median of the part it
measured itself in ``seconds``; ``per_call`` (method -> seconds per call) adds a row per
method that the baseline also reports; ``shares`` (name -> fraction) and
``bookkeeping_share`` add a table of where the time went; ``floors`` (``[case, impl]`` pairs,
summed) adds a row of kvblocks' distance to what it cannot go below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--ratios-md", default=None, help="write the ratio table as markdown here")
    parser.addoption(
        "--engine-json",
        default=None,
        help="bench_vllm_engine.py: write its rows as JSON here (for benches/plot_engine.py)",
    )


def _ratio_rows(benchmarks: list[Any]) -> list[tuple[str, str, str, float]]:
    by_key = {
        (b.extra_info["case"], b.extra_info["impl"]): b
        for b in benchmarks
        if "case" in b.extra_info
    }
    rows = []
    for (case, impl), bench in by_key.items():
        for base_case, base_impl in bench.extra_info.get("baselines", []):
            baseline = by_key.get((base_case, base_impl))
            if baseline is None:
                continue
            label = base_impl if base_case == case else f"{base_impl} ({base_case})"
            rows.append((case, impl, label, _seconds(baseline) / _seconds(bench)))
            base_calls = baseline.extra_info.get("per_call", {})
            for method, seconds in bench.extra_info.get("per_call", {}).items():
                if method in base_calls and seconds > 0:
                    row_case = f"{case}: `{method}` per call"
                    rows.append((row_case, impl, label, base_calls[method] / seconds))
    return rows


def _floor_rows(benchmarks: list[Any]) -> list[tuple[str, str, str, float]]:
    """kvblocks' time over the sum of its ``floors`` (``[case, impl]`` pairs)."""
    by_key = {(b.extra_info.get("case"), b.extra_info.get("impl")): b for b in benchmarks}
    rows = []
    for bench in benchmarks:
        floors = bench.extra_info.get("floors")
        if not floors or any(tuple(f) not in by_key for f in floors):
            continue
        floor = sum(_seconds(by_key[tuple(f)]) for f in floors)
        label = " + ".join(f"{c.split(', ')[-1]} {i}" for c, i in floors)
        rows.append(
            (bench.extra_info["case"], bench.extra_info["impl"], label, _seconds(bench) / floor)
        )
    return rows


def _seconds(bench: Any) -> float:
    return float(bench.extra_info.get("seconds", bench.stats.median))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows = _ratio_rows(session.benchmarks)
    if not rows:
        return
    lines = [
        "| workload | kvblocks variant | baseline | speed-up (median / median) |",
        "|---|---|---|---:|",
    ]
    lines += [f"| {c} | {i} | {b} | {r:,.1f}x |" for c, i, b, r in rows]
    shares = [
        (b.extra_info["case"], b.extra_info["impl"], b.extra_info["bookkeeping_share"])
        for b in session.benchmarks
        if "bookkeeping_share" in b.extra_info
    ]
    if shares:
        lines += [
            "",
            "| workload | implementation | bookkeeping share of engine time |",
            "|---|---|---:|",
        ]
        lines += [f"| {c} | {i} | {s:.1%} |" for c, i, s in shares]
    named = [
        (b.extra_info["case"], b.extra_info["impl"], name, share)
        for b in session.benchmarks
        for name, share in b.extra_info.get("shares", {}).items()
    ]
    if named:
        lines += ["", "| workload | implementation | part | share of the measured time |"]
        lines += ["|---|---|---|---:|"]
        lines += [f"| {c} | {i} | {n} | {s:.1%} |" for c, i, n, s in named]
    distances = _floor_rows(session.benchmarks)
    if distances:
        lines += ["", "| workload | kvblocks variant | floor | kvblocks time / floor |"]
        lines += ["|---|---|---|---:|"]
        lines += [f"| {c} | {i} | {f} | {r:.2f}x |" for c, i, f, r in distances]
    terminalreporter.write_sep("=", "kvblocks speed-up over its baseline (same run)")
    for line in lines:
        terminalreporter.write_line(line)
    path = config.getoption("--ratios-md")
    if path:
        Path(path).write_text("\n".join(lines) + "\n")
        terminalreporter.write_line(f"saved to {path}")
