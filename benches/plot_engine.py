"""Draws the README's first figure from ``benches/bench_vllm_engine.py``'s rows: kvblocks'
tokens/s gain over stock vLLM against the device's step time, one line per number of running
requests, async scheduling on (vLLM's default) and off side by side.

    pytest benches/bench_vllm_engine.py -s --engine-json engine.json
    python benches/plot_engine.py engine.json docs/engine-gain.png [--workload "shared prefix"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], out: Path, workload: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["workload"] == workload]
    if not rows:
        raise SystemExit(f"no rows for the workload {workload!r}")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, async_scheduling in zip(axes, (True, False), strict=True):
        for running in sorted({r["running"] for r in rows}):
            line = sorted(
                (r["device_ms"], r["gain"])
                for r in rows
                if r["running"] == running and r["async"] == async_scheduling
            )
            if line:
                xs, ys = zip(*line, strict=True)
                ax.plot(xs, ys, marker="o", label=f"{running} running requests")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.minorticks_off()
        ticks = sorted({r["device_ms"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("device time per step (ms, + 1 us per scheduled token)")
        mode = "async scheduling (vLLM's default)" if async_scheduling else "async scheduling off"
        ax.set_title(mode)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("tokens/s, kvblocks / stock vLLM")
    axes[1].legend(loc="upper right")
    fig.suptitle(
        f"vLLM's engine-core loop, {workload} workload: where kvblocks raises tokens/s "
        "(1.0 = no gain)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="bench_vllm_engine.py --engine-json FILE")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--workload", default="shared prefix")
    args = parser.parse_args()
    plot(json.loads(args.rows.read_text()), args.out, args.workload)


if __name__ == "__main__":
    main()
