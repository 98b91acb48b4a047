"""What ``kvblocks bench`` shows of a :class:`~kvblocks.engine_bench.Comparison`: two tables
and the speed-ups as text, and a chart with bookkeeping on an axis of its own."""

from __future__ import annotations

from typing import Any

from kvblocks.engine_bench import Comparison, Spread


def _spread(s: Spread, fmt: str, unit: str = "") -> str:
    return f"{s.median:{fmt}}{unit} [{s.low:{fmt}}{unit}-{s.high:{fmt}}{unit}]"


def print_report(result: Comparison) -> None:
    """The end-to-end table, the time table and, with both backends, the speed-ups."""
    header = (
        f"{'backend':<8} {'requests/s':>20} {'out tok/s':>18} {'prefix hits':>11} "
        f"{'bookkeeping':>11} {'model':>7}"
    )
    print(header)
    print("-" * len(header))
    for backend in result.backends:
        requests = result.spread(backend, lambda r: r.requests / r.wall_s)
        tokens = result.spread(backend, lambda r: r.tokens / r.wall_s)
        hits = result.spread(backend, lambda r: r.stats.prefix_hit_rate).median
        share = result.spread(backend, lambda r: r.stats.bookkeeping_share).median
        print(
            f"{backend:<8} {_spread(requests, '.1f'):>20} {_spread(tokens, '.0f'):>18} "
            f"{hits:>11.1%} {share:>11.1%} {1 - share:>7.1%}"
        )
    header = f"{'ms per run':<10} {'end to end':>18} {'bookkeeping':>22} {'model':>18}"
    print("\n" + header)
    print("-" * len(header))
    for backend in result.backends:
        wall = result.spread(backend, lambda r: r.wall_s * 1e3)
        book = result.spread(backend, lambda r: r.stats.bookkeeping_s * 1e3)
        model = result.spread(backend, lambda r: r.stats.model_s * 1e3)
        print(
            f"{backend:<10} {_spread(wall, '.0f'):>18} {_spread(book, '.1f'):>22} "
            f"{_spread(model, '.0f'):>18}"
        )
    if set(result.backends) != {"rust", "python"}:
        return
    book = result.ratio("python", "rust", lambda r: r.stats.bookkeeping_s)
    wall = result.ratio("python", "rust", lambda r: r.wall_s)
    print(
        f"\nRust speed-up on bookkeeping (hashing, block management, scheduling): "
        f"{_spread(book, '.1f', 'x')}\n"
        f"Rust speed-up end to end (bookkeeping + model):                        "
        f"{_spread(wall, '.2f', 'x')}\n"
        f"(each: the reference's time over Rust's within a round, where the two ran back to back;\n"
        f"end to end, the model's time, the same torch code for both backends, dominates)"
    )


def plot(result: Comparison, path: str) -> Any:
    """Two panels: bookkeeping per run on its own axis (the model's time, and its noise, is
    not in it), and the whole run; bars at the median, whiskers at the min and max. Returns
    the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [{"rust": "Rust", "python": "Python reference"}[b] for b in result.backends]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    panels = (
        (left, lambda r: r.stats.bookkeeping_s * 1e3, "#d95f5f", "bookkeeping (kvblocks)"),
        (right, lambda r: r.wall_s * 1e3, "#8fb3d9", "end to end (model + bookkeeping)"),
    )
    for ax, metric, color, title in panels:
        spreads = [result.spread(b, metric) for b in result.backends]
        medians = [s.median for s in spreads]
        whiskers = [
            [s.median - s.low for s in spreads],
            [s.high - s.median for s in spreads],
        ]
        ax.bar(names, medians, yerr=whiskers, capsize=6, color=color)
        ax.set_ylabel("ms per run")
        ax.set_title(title)
    if set(result.backends) == {"rust", "python"}:
        book = result.ratio("python", "rust", lambda r: r.stats.bookkeeping_s).median
        wall = result.ratio("python", "rust", lambda r: r.wall_s).median
        left.set_title(f"bookkeeping: Rust {book:.1f}x faster")
        right.set_title(f"end to end: Rust {wall:.2f}x the reference's speed")
    fig.suptitle(f"kvblocks bench: median [min-max] of {result.rounds} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
    return fig
