"""The comparison ``kvblocks bench`` makes: the same engine and workload with the Rust block
manager and with its pure-Python reference, fair by construction.

- Every backend first runs the workload once, untimed (torch's first calls, the allocator,
  CPython's specialising interpreter and the CPU caches warm up on it, not on a timed run).
- The timed rounds alternate which backend goes first (R,P then P,R then R,P ...): neither
  always runs in the warmer or the quieter half of a round.
- Within a round the backends run back to back, so a ratio taken within a round compares
  runs made under the same machine load; the summary is the median over rounds with its
  min-max spread.
- Every run gets a fresh engine (an empty prefix cache) and starts after a garbage collection,
  so no run pays for the garbage of the one before.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the engine needs torch; this module does not
    from kvblocks.engine import EngineStats


class Engine(Protocol):
    """What the comparison needs of ``kvblocks.LLM``."""

    stats: EngineStats

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]: ...


#: ``progress(label, done, total)``: called before each run (``label`` names it) and once at
#: the end, with the number of runs done and the number of runs in all.
Progress = Callable[[str, int, int], None]


def round_orders(backends: Sequence[str], rounds: int) -> list[tuple[str, ...]]:
    """The order of each round: as given in even rounds, reversed in odd ones."""
    forwards = tuple(backends)
    return [forwards if i % 2 == 0 else forwards[::-1] for i in range(rounds)]


@dataclass(frozen=True)
class Run:
    """One timed run of the workload."""

    backend: str
    round: int
    requests: int
    wall_s: float
    tokens: int
    stats: EngineStats


@dataclass(frozen=True)
class Spread:
    """The median of some values and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class Comparison:
    backends: tuple[str, ...]
    runs: list[Run]
    warmup: int

    @property
    def rounds(self) -> int:
        return len(self.runs) // len(self.backends)

    def of(self, backend: str) -> list[Run]:
        return [r for r in self.runs if r.backend == backend]

    def spread(self, backend: str, metric: Callable[[Run], float]) -> Spread:
        return Spread.of([metric(r) for r in self.of(backend)])

    def ratio(self, numerator: str, denominator: str, metric: Callable[[Run], float]) -> Spread:
        """``metric`` of ``numerator`` over ``metric`` of ``denominator``, round by round."""
        by_round = {(r.backend, r.round): metric(r) for r in self.runs}
        return Spread.of(
            [by_round[numerator, i] / by_round[denominator, i] for i in range(self.rounds)]
        )


def compare(
    make_engine: Callable[[str], Engine],
    prompts: list[list[int]],
    params: Any,
    backends: Sequence[str],
    *,
    rounds: int,
    warmup: int = 1,
    progress: Progress | None = None,
) -> Comparison:
    """Runs ``warmup`` untimed runs per backend, then ``rounds`` timed rounds in
    :func:`round_orders`; ``make_engine(backend)`` builds a fresh engine for every run."""
    if rounds < 1 or warmup < 0:
        raise ValueError("rounds must be >= 1 and warmup >= 0")
    # (backend, round or None for a warm-up run, label)
    plan: list[tuple[str, int | None, str]] = [
        (b, None, f"{b} warm-up {i + 1}/{warmup}") for i in range(warmup) for b in backends
    ]
    for i, order in enumerate(round_orders(backends, rounds)):
        plan += [(b, i, f"{b} round {i + 1}/{rounds}") for b in order]
    runs: list[Run] = []
    for done, (backend, round_index, label) in enumerate(plan):
        if progress is not None:
            progress(label, done, len(plan))
        engine = make_engine(backend)
        gc.collect()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        if round_index is not None:  # warm-up runs are not recorded
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs.append(Run(backend, round_index, len(prompts), wall, tokens, engine.stats))
    if progress is not None:
        progress("done", len(plan), len(plan))
    return Comparison(tuple(backends), runs, warmup)
