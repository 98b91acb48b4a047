"""``kvblocks bench --engine vllm``: vLLM 0.33's scheduler with and without kvblocks, same
process, same workload, driven by a fake model on the CPU.

The package holds what that command needs and no more: vLLM's configuration on the CPU
platform for a tiny model (:mod:`~kvblocks.vllm.bench.config`), the fake model
(:mod:`~kvblocks.vllm.bench.fake_model`) and timed runs (:mod:`~kvblocks.vllm.bench.timing`).
The vLLM test tier and ``benches/bench_vllm.py`` extend it with KV connectors and speculative
decoding from the repository's ``tests/vllm_driver``, which does not ship.

Each side runs ``rounds`` times without timers (the median is compared) and once more with a
timer on every hasher and KV-cache-manager call (where the time goes). The scheduler outputs
of every run must be identical, or the comparison reports it. Every run of the kvblocks side
must have run on kvblocks' KV-cache manager and hasher, with no fallback to vLLM's code (and
every stock run on vLLM's), or :func:`compare` raises :class:`NotOnKvblocks`: a kvblocks side
that fell back would compare stock vLLM with itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvblocks.vllm
import kvblocks.vllm._state as _state
from kvblocks.vllm.bench.config import (
    SchedulerSpec,
    layout_groups,
    make_vllm_config,
    tiny_model_dir,
)
from kvblocks.vllm.bench.timing import Timings, Workload, timed_run

__all__ = [
    "IMPLS",
    "Comparison",
    "NotOnKvblocks",
    "SchedulerSpec",
    "Side",
    "Workload",
    "compare",
    "describe_layout",
    "mamba_checkpoint_alignment_for",
    "pool_blocks",
    "prepare",
]

IMPLS = ("vllm", "kvblocks")

_KINDS = {
    "full": "full attention",
    "mla": "MLA",
    "sliding_window": "sliding window {}",
    "chunked_local": "chunked local attention {}",
    "mamba": "Mamba/linear attention",
}


def describe_layout(layout: str | list[tuple[str, int]]) -> str:
    """A layout's KV-cache groups in words, runs of equal groups counted, e.g. Gemma 3's
    "5 x sliding window 1024 + full attention"."""
    parts = []
    for (kind, size), run in itertools.groupby(layout_groups(layout)):
        count = len(list(run))
        name = _KINDS[kind].format(size)
        parts.append(f"{count} x {name}" if count > 1 else name)
    return " + ".join(parts)


def pool_blocks(blocks_per_group: int, layout: str | list[tuple[str, int]]) -> int:
    """The pool for ``layout`` that gives each KV-cache group ``blocks_per_group`` blocks:
    vLLM's groups draw on one shared pool, so a layout of n groups needs n times the
    one-group pool for a workload to fit as it does with one group."""
    return blocks_per_group * len(layout_groups(layout))


def mamba_checkpoint_alignment_for(
    layout: str | list[tuple[str, int]], block_size: int
) -> int | None:
    """The Mamba layers' prefill checkpoint alignment in the family a layout stands for
    (``SchedulerSpec.mamba_checkpoint_alignment``): Qwen3.5's gated delta-net exports
    checkpoints on the block grid; Jamba's Mamba1 layers export none."""
    return block_size if layout == "qwen3.5" else None


def prepare(spec: SchedulerSpec) -> None:
    """Builds vLLM's configuration for ``spec`` once, untimed: its platform checks load
    vLLM's compiled parts and log their start-up warnings here, before the timed runs."""
    make_vllm_config(tiny_model_dir(), spec)


class NotOnKvblocks(ValueError):
    """A side of the comparison did not run on the implementation it names (kvblocks' part
    fell back for this configuration, or something replaced it). A ``ValueError``: the
    configuration asked for is one this comparison cannot measure, which the command line
    reports as an error (exit status 2)."""


@dataclass
class Side:
    """One implementation's results."""

    timings: Timings  # the median run, without timers
    parts: Timings  # the run with a timer on every hasher and manager call

    @property
    def hashing_share(self) -> float:
        return self.parts.hashing / self.parts.scheduler

    @property
    def manager_share(self) -> float:
        return self.parts.manager / self.parts.scheduler

    def per_call(self, method: str) -> float | None:
        calls, seconds = self.parts.manager_calls.get(method, (0.0, 0.0))
        return seconds / calls if calls else None


@dataclass
class Comparison:
    workload: Workload
    spec: SchedulerSpec
    sides: dict[str, Side]
    identical: bool

    @property
    def speedup(self) -> float:
        """Stock vLLM's scheduler-side CPU time over kvblocks'."""
        return self.sides["vllm"].timings.scheduler / self.sides["kvblocks"].timings.scheduler


def compare(
    workload: Workload,
    spec: SchedulerSpec,
    *,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Runs ``workload`` on vLLM's scheduler with stock vLLM and with kvblocks."""
    model_dir = tiny_model_dir()
    sides: dict[str, Side] = {}
    snapshots: list[Any] = []
    try:
        for impl in IMPLS:
            if impl == "kvblocks":
                kvblocks.vllm.install("all")
            else:
                kvblocks.vllm.uninstall()
            before = dict(_state.fallbacks)
            runs = []
            for _ in range(rounds):
                runs.append(timed_run(model_dir, spec, workload))
                if progress is not None:
                    progress(impl)
            runs.sort(key=lambda run: run[0].scheduler)
            timings, _ = runs[len(runs) // 2]
            snapshots += [s for _, s in runs]
            parts, instrumented = timed_run(model_dir, spec, workload, instrument=True)
            snapshots.append(instrumented)
            if progress is not None:
                progress(impl)
            _check_ran_on(impl, [t for t, _ in runs] + [parts], before)
            sides[impl] = Side(timings, parts)
    finally:
        kvblocks.vllm.uninstall()
    identical = all(s == snapshots[0] for s in snapshots)
    return Comparison(workload, spec, sides, identical)


def _check_ran_on(impl: str, runs: list[Timings], fallbacks_before: dict[Any, int]) -> None:
    """Raises :class:`NotOnKvblocks` unless every run of ``impl``'s side used ``impl``'s
    KV-cache manager and hasher, and (kvblocks' side) nothing fell back to vLLM's code."""
    ran = sorted({t.implementation for t in runs} - {impl})
    fell_back = [
        f"{part}: {_state.describe(part, reason)}"
        for (part, reason), count in _state.fallbacks.items()
        if count > fallbacks_before.get((part, reason), 0)
    ]
    if impl == "kvblocks" and (ran or fell_back):
        problems = [f"ran on {', '.join(ran)}"] if ran else []
        problems += [f"fell back to vLLM's code: {text}" for text in fell_back]
        raise NotOnKvblocks(
            "the 'with kvblocks' side of the comparison did not run on kvblocks "
            f"({'; '.join(problems)}); this configuration would compare stock vLLM with itself"
        )
    if ran:
        raise NotOnKvblocks(f"the stock vLLM side of the comparison ran on {', '.join(ran)}")
