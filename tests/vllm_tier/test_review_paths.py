"""Review of scheduler paths the step-by-step comparison in ``test_kv_cache_manager`` does not
drive: streaming (resumable) sessions, ``reset_prefix_cache(reset_running_requests=True)``,
prompt-logprobs requests, ``finish_requests`` of waiting / unknown / all ids, the priority
policy, outputs several steps late (a pipeline-parallel batch queue), ``max_num_seqs`` and
``long_prefill_token_threshold`` limits, ``max_tokens=1``, tiny pools, and a small
``max_model_len``.

Each test runs one scripted workload on vLLM's manager and on kvblocks' and compares, step by
step, what the scheduler decided, the outputs, the statistics, the KV events, every live
request's block table, and any exception raised (an exception ends a run and is recorded)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvblocks.vllm import _state
from kvblocks.vllm.block_hasher import ALGORITHMS
from tests.vllm_driver import SchedulerSpec, make_request, sampled_token
from tests.vllm_driver.config import scheduler_config_has
from tests.vllm_tier.harness import assert_same, events_spec, on_each_manager
from tests.vllm_tier.simulation import run

Hasher = Callable[[Request], list[bytes]]
#: An action run before a step's ``schedule()``: (scheduler, hasher) -> a comparable result.
Action = Callable[[Scheduler, Hasher], Any]


def both(
    model_dir: Path,
    spec: SchedulerSpec,
    actions: Callable[[], dict[int, list[Action]]],
    *,
    lag: int | None = None,
    may_raise: bool = False,
) -> tuple[list[Any], list[Any]]:
    """(stock vLLM's records, kvblocks' records) for one workload: :func:`simulation.run`'s
    records with every action's result, any exception recorded (it ends the run). Unless
    ``may_raise`` (a test where an exception is the outcome it compares), neither run may
    raise: two runs that crash alike would otherwise compare equal."""

    def play(scheduler: Scheduler, hasher: Hasher) -> list[Any]:
        bound = {
            step: [lambda s, act=act: act(s, hasher) for act in acts]
            for step, acts in actions().items()
        }
        return run(scheduler, actions=bound, lag=lag, catch=True, max_steps=3000)

    stock, ours = on_each_manager(model_dir, spec, play)
    assert not _state.fallbacks, "kvblocks' manager and hasher must both run"
    if not may_raise:
        assert raised(stock) is None, f"stock vLLM raised: {stock[-1]}"
        assert raised(ours) is None, f"kvblocks raised: {ours[-1]}"
    return stock, ours


def raised(records: list[Any]) -> str | None:
    """The name of the exception that ended the run, if one did (its message is in the record
    too, and compared)."""
    return records[-1][1] if records[-1][:1] == ("raised",) else None


def snapshots(records: list[Any]) -> list[Any]:
    """The snapshot of every step that scheduled."""
    return [record[0] for record in records[:-1] if record[0] is not None]


def results(records: list[Any]) -> list[Any]:
    """Every action's result."""
    return [r for record in records[:-1] for r in record[5]]


# Actions.


def add(request_id: str, prompt: list[int], max_tokens: int = 8, **kwargs: Any) -> Action:
    sampling = kwargs.pop("sampling", None)

    def action(scheduler: Scheduler, hasher: Hasher) -> Any:
        request = make_request(
            request_id, prompt, hasher, max_tokens=max_tokens, sampling=sampling, **kwargs
        )
        scheduler.add_request(request)
        return request_id

    return action


def abort(request_ids: Any) -> Action:
    def action(scheduler: Scheduler, hasher: Hasher) -> Any:
        done = scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return sorted(r.request_id for r in done)

    return action


def reset(**kwargs: Any) -> Action:
    def action(scheduler: Scheduler, hasher: Hasher) -> Any:
        return scheduler.reset_prefix_cache(**kwargs)

    return action


def hashes(request_id: str) -> Action:
    """The request's block hashes and tokens (kvblocks' hasher must follow truncations)."""

    def action(scheduler: Scheduler, hasher: Hasher) -> Any:
        request = scheduler.requests.get(request_id)
        if request is None:
            return None
        return (list(request.block_hashes), list(request.all_token_ids), str(request.status))

    return action


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def shared_workload(
    seed: int,
    n: int,
    *,
    spread: int = 20,
    max_tokens: tuple[int, int] = (1, 20),
    name: str = "r",
) -> dict[int, list[Action]]:
    rng = random.Random(seed)
    prefixes = [tokens(rng, rng.randrange(1, 40)) for _ in range(3)]
    actions: dict[int, list[Action]] = {}
    for i in range(n):
        prompt = rng.choice(prefixes) + tokens(rng, rng.randrange(0, 25))
        step = rng.randrange(0, spread)
        actions.setdefault(step, []).append(add(f"{name}{i}", prompt, rng.randint(*max_tokens)))
    return actions


def merge(*parts: dict[int, list[Action]]) -> dict[int, list[Action]]:
    out: dict[int, list[Action]] = {}
    for part in parts:
        for step, acts in part.items():
            out.setdefault(step, []).extend(acts)
    return out


# Streaming-input sessions (resumable requests).


def session_workload(seed: int, block_size: int, lora: bool = False) -> dict[int, list[Action]]:
    """A resumable session ``s`` that gets several input chunks (some while it runs, so they
    queue; some while it waits for input), ends with a non-resumable chunk, next to ordinary
    requests that share its prefix; its block hashes are read after each turn."""
    rng = random.Random(seed)
    first = tokens(rng, 3 * block_size + 1)
    actions = shared_workload(seed, 8, spread=30)
    keys: dict[str, Any] = {"cache_salt": "tenant"}
    if lora:
        keys["lora_request"] = LoRARequest("adapter-1", 1, "/lora/1")
    plan = [
        (0, add("s", first, 5, resumable=True, session_id="session-1", **keys)),
        (2, add("s", tokens(rng, block_size + 1), 3, resumable=True)),  # queued while running
        (3, add("s", tokens(rng, 2 * block_size + 2), 4, resumable=True)),
        (25, add("s", tokens(rng, 1), 1, resumable=True)),  # waiting for input by now
        (40, add("s", tokens(rng, block_size), 6, resumable=True)),
        (41, add("u", first + tokens(rng, 2), 4, **keys)),  # hits the session's prefix
        (70, add("s", tokens(rng, 5), 2)),  # not resumable: the last chunk
    ]
    for step, act in plan:
        actions.setdefault(step, []).append(act)
    for step in range(0, 90, 3):
        actions.setdefault(step, []).append(hashes("s"))
    return actions


@pytest.mark.parametrize(
    ("async_scheduling", "block_size", "caching", "algo", "lora"),
    [
        (False, 1, True, "sha256", False),
        (False, 4, True, "sha256", True),
        (True, 1, True, "sha256", False),
        (True, 4, True, "sha256", False),
        (True, 4, False, "sha256", False),
        (True, 4, True, "xxhash", True),
        (False, 2, True, "sha256_cbor", True),
        (False, 4, True, "xxhash_cbor", False),
    ],
)
def test_streaming_sessions(
    model_dir: Path, async_scheduling: bool, block_size: int, caching: bool, algo: str, lora: bool
) -> None:
    spec = events_spec(
        400 // block_size,
        24,
        block_size=block_size,
        hash_algo=algo,
        async_scheduling=async_scheduling,
        enable_caching=caching,
    )
    stock, ours = both(model_dir, spec, lambda: session_workload(7, block_size, lora))
    assert_same(stock, ours)
    assert raised(stock) is None
    finished = {rid for snap in snapshots(stock) for rid in snap[4]}
    assert "s" in finished


def test_streaming_session_preempted_and_aborted(model_dir: Path) -> None:
    """A session preempted (with a chunk queued), resumed, continued with the queued chunk,
    then aborted while it waits for input."""
    # The priority policy preempts the session (lowest priority) first.
    spec = events_spec(20, 16, scheduler={"policy": "priority"})

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(3)
        acts = {0: [add("s", tokens(rng, 13), 12, resumable=True, priority=9)]}
        acts[1] = [add("s", tokens(rng, 6), 5, resumable=True)]
        acts = merge(acts, {k + 1: v for k, v in shared_workload(3, 6, spread=2).items()})
        acts.setdefault(95, []).append(abort("s"))  # waiting for input by now
        acts.setdefault(96, []).append(abort(["s", "nope"]))
        for step in range(0, 100, 4):
            acts.setdefault(step, []).append(hashes("s"))
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    preempted = {rid for snap in snapshots(stock) for rid in snap[5]}
    assert "s" in preempted


def test_reset_with_session_waiting_for_input(model_dir: Path, async_scheduling: bool) -> None:
    """A paused session holds blocks: the reset fails, and raises when running requests were
    to be preempted (vLLM's RuntimeError), with either manager."""
    spec = events_spec(40, max_num_batched_tokens=2048, async_scheduling=async_scheduling)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(5)
        return {
            0: [add("s", tokens(rng, 10), 3, resumable=True), add("x", tokens(rng, 9), 30)],
            10: [reset()],
            11: [reset(reset_running_requests=True)],
        }

    stock, ours = both(model_dir, spec, actions, may_raise=True)
    assert_same(stock, ours)  # the exception's message included
    assert raised(stock) == "RuntimeError"
    assert stock[-1][2].startswith("Failed to reset KV cache even when all the running requests")


def reset_unless_paused_session() -> Action:
    """``reset_prefix_cache(reset_running_requests=True)``, skipped while a request outside
    the running queue holds blocks (the reset would raise): a session waiting for input, or,
    under async scheduling, a session back in the waiting queue with its next chunk."""

    def action(scheduler: Scheduler, hasher: Hasher) -> Any:
        if scheduler.num_waiting_for_streaming_input:
            return "skipped"
        running = {request.request_id for request in scheduler.running}
        manager = scheduler.kv_cache_manager
        for request_id in scheduler.requests:
            if request_id not in running and any(manager.get_blocks(request_id).get_block_ids()):
                return "skipped"
        return scheduler.reset_prefix_cache(reset_running_requests=True)

    return action


def test_sessions_in_a_crowded_small_pool(model_dir: Path, async_scheduling: bool) -> None:
    """Sessions under ``max_num_seqs`` (a paused session holds a slot), FCFS preemption, and
    resets that preempt every running request, the session among them."""
    spec = events_spec(34, 16, max_num_seqs=3, async_scheduling=async_scheduling)

    def actions() -> dict[int, list[Action]]:
        acts = session_workload(43, 4)
        for step in (4, 9, 15, 22, 33, 47, 58):
            acts.setdefault(step, []).append(reset_unless_paused_session())
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    assert any(r is True for r in results(stock))
    preempted = {rid for snap in snapshots(stock) for rid in snap[5]}
    assert "s" in preempted


# reset_prefix_cache(reset_running_requests=True).


def test_reset_prefix_cache_preempting_running(model_dir: Path, async_scheduling: bool) -> None:
    spec = events_spec(60, async_scheduling=async_scheduling)

    def actions() -> dict[int, list[Action]]:
        acts = shared_workload(5, 16, spread=20)
        for step in (3, 7, 12, 19):
            acts.setdefault(step, []).append(reset(reset_running_requests=True))
        acts.setdefault(8, []).append(reset())
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    assert True in results(stock)


# Prompt logprobs (skip_reading_prefix_cache), max_tokens=1.


def test_prompt_logprobs_and_single_token_requests(model_dir: Path, async_scheduling: bool) -> None:
    spec = events_spec(80, 40, async_scheduling=async_scheduling)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(11)
        prefix = tokens(rng, 17)
        acts: dict[int, list[Action]] = {}
        for i in range(12):
            sampling: dict[str, Any] = {}
            if i % 3 == 0:
                sampling = {"prompt_logprobs": 1}
            elif i % 3 == 1:
                sampling = {"extra_args": {"kv_cache_report_mode": "full"}}
            prompt = prefix + tokens(rng, i % 5)
            acts.setdefault(i // 3, []).append(
                add(f"r{i}", prompt, 1 if i % 2 else 4, sampling=sampling)
            )
        # Identical prompts in one step, max_tokens=1 (fully cached, one token to compute).
        acts.setdefault(20, []).extend([add(f"same{j}", prefix[:16], 1) for j in range(3)])
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)


#: vLLM 0.34's prefix-cache hit limit (``Request.get_max_cache_hit_length``).
HAS_HIT_LIMIT = hasattr(Request, "get_max_cache_hit_length")


def test_prompt_logprobs_from_a_start_hit_up_to_it(model_dir: Path) -> None:
    """Prompt logprobs from token S, reading the prefix cache: vLLM 0.34 lets such a request
    hit at most S cached tokens (its hit limit), vLLM 0.33 all its cached blocks; the same
    with kvblocks' manager, and a request without prompt logprobs hits all in both."""
    spec = events_spec(80, 40)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(5)
        prefix = tokens(rng, 64)
        acts: dict[int, list[Action]] = {0: [add("warm", prefix + tokens(rng, 3), 2)]}
        for i, start in enumerate((0, 7, 16, 33, 48, 60)):
            sampling = {
                "prompt_logprobs": 1,
                "prompt_logprob_start": start,
                "skip_reading_prefix_cache": False,  # (else the request reads no cache)
            }
            acts[4 + i] = [add(f"s{start}", prefix + tokens(rng, 2), 2, sampling=sampling)]
        acts[12] = [add("free", prefix + tokens(rng, 2), 2)]
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    # Not vacuous: on 0.34 the limits bind (hits of 0, 16, 32 and 48 tokens: whole 4-token
    # blocks), and every request hits the 64 cached tokens where there is no limit.
    hits = {r[0]: r[2] for snap in snapshots(stock) for r in snap[1]}
    expected = (0, 16, 32, 48) if HAS_HIT_LIMIT else (64, 64, 64, 64)
    assert (hits["s0"], hits["s16"], hits["s33"], hits["s48"]) == expected
    assert hits["free"] == 64


HAS_CACHE_AWARE_ADMISSION = scheduler_config_has("cache_aware_admission_window")


@pytest.mark.skipif(
    not HAS_CACHE_AWARE_ADMISSION,
    reason="vLLM 0.33 has no cache-aware admission (0.34's get_num_cached_tokens probe; run "
    "on 0.34: docs/porting.md)",
)
def test_cache_aware_admission_probes_as_vllm(model_dir: Path) -> None:
    """vLLM 0.34's cache-aware admission asks the manager, every step, how many tokens of each
    waiting request in its window are cached (``get_num_cached_tokens``) and admits the
    deepest first: the same order with kvblocks' manager."""
    window = {"cache_aware_admission_window": 6, "cache_aware_admission_threshold": 0.0}
    spec = events_spec(60, 32, max_num_seqs=2, scheduler=window)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(9)
        prefixes = [tokens(rng, 24), tokens(rng, 12)]
        acts: dict[int, list[Action]] = {0: [add("warm0", prefixes[0] + [1], 2)]}
        acts[1] = [add("warm1", prefixes[1] + [2], 2)]
        for i in range(10):
            prompt = (prefixes[i % 3] if i % 3 < 2 else []) + tokens(rng, 6 + i)
            acts.setdefault(4 + i // 4, []).append(add(f"r{i}", prompt, 3))
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    # Not vacuous: the window admitted a later request ahead of an earlier one.
    first = {}
    for step, snap in enumerate(snapshots(stock)):
        for r in snap[1]:
            first.setdefault(r[0], step)
    order = sorted((name for name in first if name.startswith("r")), key=first.__getitem__)
    assert order != sorted(order, key=lambda name: int(name[1:]))


# finish_requests of waiting, unknown and all ids.


def test_finish_requests_waiting_unknown_and_all(model_dir: Path) -> None:
    spec = events_spec(30, 16, max_num_seqs=3)

    def actions() -> dict[int, list[Action]]:
        acts = shared_workload(13, 14, spread=6, max_tokens=(5, 30))
        acts.setdefault(2, []).append(abort(["r1", "r2", "unknown"]))
        acts.setdefault(3, []).append(abort("never-added"))
        acts.setdefault(5, []).append(abort(("r5", "r5")))
        acts.setdefault(9, []).append(abort("r1"))  # already finished
        acts.setdefault(14, []).append(abort(None))  # everything
        acts.setdefault(15, []).extend(shared_workload(14, 6, spread=1, name="late")[0])
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)


# Priority policy.


def test_priority_policy_preemption(model_dir: Path, async_scheduling: bool) -> None:
    spec = events_spec(24, 24, async_scheduling=async_scheduling, scheduler={"policy": "priority"})

    def actions() -> dict[int, list[Action]]:
        r = random.Random(17)
        prefixes = [tokens(r, r.randrange(4, 30)) for _ in range(3)]
        acts: dict[int, list[Action]] = {}
        for i in range(20):
            prompt = r.choice(prefixes) + tokens(r, r.randrange(0, 20))
            acts.setdefault(r.randrange(0, 30), []).append(
                add(f"r{i}", prompt, r.randrange(1, 25), priority=r.randrange(0, 4))
            )
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    assert any(snap[5] for snap in snapshots(stock)), "must preempt"


# Outputs several steps late (pipeline-parallel batch queue with the sync scheduler).


@pytest.mark.parametrize("lag", [2, 3])
def test_batch_queue_outputs_late(model_dir: Path, lag: int) -> None:
    spec = events_spec(30, 20)

    def actions() -> dict[int, list[Action]]:
        acts = shared_workload(19 + lag, 16, spread=25)
        acts.setdefault(10, []).append(abort(["r3", "r4"]))
        acts.setdefault(30, []).append(reset(reset_running_requests=True))
        return acts

    stock, ours = both(model_dir, spec, actions, lag=lag)
    assert_same(stock, ours)


# Many waiting requests under max_num_seqs, long_prefill_token_threshold.


@pytest.mark.parametrize("threshold", [5, 12])
def test_max_num_seqs_and_long_prefill_threshold(model_dir: Path, threshold: int) -> None:
    spec = events_spec(50, max_num_seqs=3, scheduler={"long_prefill_token_threshold": threshold})
    stock, ours = both(model_dir, spec, lambda: shared_workload(23, 25, spread=3))
    assert_same(stock, ours)


# Tiny pools: admission fails again and again; the watermark; reserve_full_isl off.

FULL: tuple[dict[str, Any], ...] = ({}, {"extra_args": {"kv_cache_report_mode": "full"}})


@pytest.mark.parametrize(
    ("num_blocks", "watermark", "full_isl"),
    [(9, 0.0, True), (9, 0.2, True), (12, 0.1, False), (7, 0.0, False)],
)
def test_tiny_pool_admission_failures(
    model_dir: Path, num_blocks: int, watermark: float, full_isl: bool
) -> None:
    spec = events_spec(
        num_blocks,
        12,
        watermark=watermark,
        max_model_len=64,
        scheduler={"scheduler_reserve_full_isl": full_isl},
    )

    def actions() -> dict[int, list[Action]]:
        r = random.Random(num_blocks)
        prefix = tokens(r, 9)
        acts: dict[int, list[Action]] = {}
        for i in range(24):
            # Every request fits in the pool alone (or vLLM would wait forever too).
            extra = r.randrange(0, max(1, 4 * (num_blocks - 3) - 9 - 12))
            acts.setdefault(r.randrange(0, 30), []).append(
                # Report mode "full": a reused-blocks event at every lookup, failed or not.
                add(f"r{i}", prefix + tokens(r, extra), r.randrange(1, 12), sampling=FULL[i % 2])
            )
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)


# A small max_model_len: requests run into it; prompts longer than it.


@pytest.mark.parametrize("kv_events", [False, True])
def test_small_max_model_len(model_dir: Path, kv_events: bool) -> None:
    spec = events_spec(40, 64, kv_events=kv_events, max_model_len=32)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(29)
        prefix = tokens(rng, 20)
        return {
            0: [add("a", prefix + tokens(rng, 6), 30)],  # capped at 32 tokens
            1: [add("b", prefix + tokens(rng, 11), 1)],  # exactly 32 with its output
            2: [add("c", prefix[:16], 40)],
        }

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)


@pytest.mark.parametrize("kv_events", [False, True])
def test_prompt_longer_than_max_model_len(
    model_dir: Path, kv_events: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's input processor rejects such prompts; the scheduler alone still takes them.

    A deliberate divergence with KV events on (docs/vllm.md, "Where kvblocks differs"):
    ``allocate_slots`` gives the 42-token prompt 8 blocks (``max_model_len`` 32) but caches
    ``min(42, num_tokens)`` tokens, i.e. 10 full blocks; vLLM's ``cache_full_blocks`` then
    indexes ``blocks[8]`` while building the ``BlockStored`` event and raises IndexError out of
    ``schedule()``. kvblocks registers the blocks the request has, emits their event and goes
    on; up to vLLM's crash, both runs are identical."""
    spec = events_spec(40, 64, kv_events=kv_events, max_model_len=32)

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(31)
        return {0: [add("long", tokens(rng, 42), 3)], 3: [add("next", tokens(rng, 9), 2)]}

    with outgrown_warnings(caplog) as warnings:
        # With KV events on, stock vLLM raises (see the docstring).
        stock, ours = both(model_dir, spec, actions, may_raise=kv_events)
    assert_same_until_vllm_crashes(stock, ours, kv_events)
    assert_warned(warnings, "long", kv_events)


@pytest.mark.parametrize("kv_events", [False, True])
def test_streaming_session_beyond_max_model_len(
    model_dir: Path, kv_events: bool, async_scheduling: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Each chunk passes the input processor's check (shorter than ``max_model_len``), but
    the session's accumulated tokens outgrow it.

    The same deliberate divergence with KV events on (see the test above): the resumed
    session (37 tokens, 22 computed, 15 scheduled, 9 block hashes, 8 blocks under
    ``max_model_len`` 32) makes vLLM's ``cache_full_blocks`` raise IndexError (``blocks[8]``)
    out of ``schedule()``; kvblocks schedules it and emits a ``BlockStored`` for blocks 5-7."""
    spec = events_spec(
        40, 64, kv_events=kv_events, async_scheduling=async_scheduling, max_model_len=32
    )

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(37)
        return {
            0: [add("s", tokens(rng, 20), 3, resumable=True)],
            1: [add("s", tokens(rng, 15), 3, resumable=True)],
            2: [add("s", tokens(rng, 5), 2)],
            20: [add("t", tokens(rng, 9), 2)],
        }

    with outgrown_warnings(caplog) as warnings:
        # With KV events on, stock vLLM raises (see the docstring).
        stock, ours = both(model_dir, spec, actions, may_raise=kv_events)
    assert_same_until_vllm_crashes(stock, ours, kv_events)
    assert_warned(warnings, "s", kv_events)


@contextmanager
def outgrown_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """The WARNING lines kvblocks logs in the block, with the once-per-process memory of the
    max_model_len warning cleared first."""
    _state._logged.discard("outgrown_max_model_len")
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="vllm.kvblocks"):
        start = len(caplog.records)
        yield lines
        lines += [
            r.getMessage()
            for r in caplog.records[start:]
            if r.name == "vllm.kvblocks" and r.levelno == logging.WARNING
        ]


def assert_warned(warnings: list[str], request_id: str, kv_events: bool) -> None:
    """With KV events, where vLLM crashes, kvblocks said so once, naming the request; without
    them (vLLM and kvblocks identical) nothing."""
    if not kv_events:
        assert warnings == []
        return
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"kvblocks: request {request_id!r} has ")
    assert "outgrew max_model_len=32" in warnings[0]
    assert "stock vLLM with KV events on would raise IndexError out of schedule()" in warnings[0]


def assert_same_until_vllm_crashes(stock: list[Any], ours: list[Any], kv_events: bool) -> None:
    """Without KV events the runs are identical; with them, stock vLLM raises IndexError out of
    ``schedule()`` where kvblocks goes on, and every step before that is identical."""
    if not kv_events:
        assert_same(stock, ours)
        return
    assert raised(stock) == "IndexError"
    assert raised(ours) is None
    crash = len(stock) - 1
    assert_same(stock[:crash], ours[:crash])


def test_stop_tokens_with_steps_in_flight(model_dir: Path, async_scheduling: bool) -> None:
    """Requests and a session that stop on a stop token before ``max_tokens``: under async
    scheduling their next step is already in flight (stale output; a session resumes with
    ``drop_stale_output`` and caches from ``num_computed_tokens - num_in_flight_tokens``)."""
    spec = events_spec(60, 16, block_size=2, async_scheduling=async_scheduling)

    def stops(rid: str, *indices: int) -> dict[str, Any]:
        return {"stop_token_ids": [sampled_token(rid, i) for i in indices]}

    def actions() -> dict[int, list[Action]]:
        rng = random.Random(41)
        prefix = tokens(rng, 7)
        acts: dict[int, list[Action]] = {}
        for i in range(8):
            rid = f"r{i}"
            acts.setdefault(i, []).append(
                add(rid, prefix + tokens(rng, i), 30, sampling=stops(rid, 1 + i % 4))
            )
        session = stops("s", 2, 5, 9, 14, 20)
        acts[0].append(add("s", prefix + tokens(rng, 5), 30, resumable=True, sampling=session))
        for step, n in ((1, 3), (2, 4), (30, 2), (31, 6)):
            acts.setdefault(step, []).append(
                add("s", tokens(rng, n), 30, resumable=True, sampling=session)
            )
        acts.setdefault(60, []).append(add("s", tokens(rng, 3), 4))
        for step in range(0, 70, 2):
            acts.setdefault(step, []).append(hashes("s"))
        return acts

    stock, ours = both(model_dir, spec, actions)
    assert_same(stock, ours)
    reasons = {o[2] for record in stock[:-1] for o in record[1]}
    assert "stop" in reasons


def test_engine_core_reads_of_the_manager(model_dir: Path) -> None:
    """What EngineCore reads off the manager outside the scheduler: the effective attention
    block size at start-up and ``get_kv_cache_group_metadata`` (for external consumers)."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    def read(scheduler: Scheduler, hasher: Hasher) -> tuple[Any, ...]:
        core: Any = SimpleNamespace(scheduler=scheduler, vllm_config=scheduler.vllm_config)
        EngineCore._initialize_effective_attention_block_size(core)
        block_size = scheduler.vllm_config.cache_config.effective_attention_block_size
        return block_size, EngineCore.get_kv_cache_group_metadata(core)

    seen = on_each_manager(model_dir, SchedulerSpec(block_size=8, num_blocks=20), read)
    assert seen[0] == seen[1]
    assert seen[0][0] == 8


# Random mixes of all of the above.


def random_case(seed: int) -> tuple[SchedulerSpec, int, Callable[[], Any]]:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    async_scheduling = rng.random() < 0.4
    lag = 1 if async_scheduling else rng.choice([0, 0, 2])
    num_sessions = rng.randrange(0, 3)
    num_requests = rng.randrange(3, 14)
    longest = 40 + 24 + 12  # a request's prompt + output tokens at most
    session_total = 30 + 4 * (10 + 8) + 8  # a session's tokens at most
    need = -(-max(longest, session_total) // block_size)
    spec = SchedulerSpec(
        block_size=block_size,
        # Odd seeds: a pool barely larger than the largest request (preemption, failed
        # admissions); even seeds: room for the sessions too.
        num_blocks=need
        + (rng.randrange(1, 4) if seed % 2 else num_sessions * need // 2 + rng.randrange(1, need)),
        hash_algo=rng.choice(ALGORITHMS),
        enable_caching=rng.random() < 0.85,
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([8, 16, 48]),
        async_scheduling=async_scheduling,
        watermark=rng.choice([0.0, 0.0, 0.1]),
        kv_events=rng.random() < 0.6,
        scheduler={
            "policy": rng.choice(["fcfs", "priority"]),
            "scheduler_reserve_full_isl": rng.random() < 0.7,
            "long_prefill_token_threshold": rng.choice([0, 0, 6]),
        },
    )

    def actions() -> dict[int, list[Action]]:
        r = random.Random(seed * 7919 + 1)
        prefixes = [tokens(r, r.randrange(1, 40)) for _ in range(3)]
        acts: dict[int, list[Action]] = {}
        for i in range(num_requests):
            rid = f"r{i}"
            sampling: dict[str, Any] = r.choice(
                [{}, {}, {"prompt_logprobs": 1}, {"extra_args": {"kv_cache_report_mode": "full"}}]
            )
            if r.random() < 0.3:
                sampling = {**sampling, "stop_token_ids": [sampled_token(rid, r.randrange(6))]}
            prompt = r.choice(prefixes) + tokens(r, r.randrange(0, 24))
            acts.setdefault(r.randrange(0, 30), []).append(
                add(rid, prompt, r.randrange(1, 12), sampling=sampling, priority=r.randrange(3))
            )
        for j in range(num_sessions):
            sid = f"s{j}"
            step = r.randrange(0, 20)
            session = {"stop_token_ids": [sampled_token(sid, r.randrange(20))]}
            first = r.choice(prefixes)[:30] + tokens(r, r.randrange(1, 5))
            acts.setdefault(step, []).append(
                add(sid, first, r.randrange(1, 8), sampling=session, resumable=True)
            )
            for _ in range(r.randrange(1, 4)):
                step += r.randrange(1, 25)
                acts.setdefault(step, []).append(
                    add(sid, tokens(r, r.randrange(1, 10)), r.randrange(1, 8), resumable=True)
                )
            step += r.randrange(1, 25)
            last = abort(sid) if r.random() < 0.3 else add(sid, tokens(r, 3), 2)
            acts.setdefault(step, []).append(last)
            acts.setdefault(step + 1, []).append(hashes(sid))
        for _ in range(r.randrange(0, 3)):
            acts.setdefault(r.randrange(0, 60), []).append(abort(f"r{r.randrange(num_requests)}"))
        for _ in range(r.randrange(0, 3)):
            acts.setdefault(r.randrange(0, 80), []).append(
                r.choice([reset(), reset_unless_paused_session()])
            )
        return acts

    return spec, lag, actions


@pytest.mark.parametrize("seed", range(60))
def test_random_mixes(model_dir: Path, seed: int) -> None:
    spec, lag, actions = random_case(seed)
    stock, ours = both(model_dir, spec, actions, lag=lag)
    assert_same(stock, ours)
    # The mixes avoid what makes vLLM raise (a reset preempting a paused session): a run
    # that raised would compare only the steps before it.
    assert raised(stock) is None, stock[-1]


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
def test_lookahead_hashing_without_full_attention_falls_back(kind: str) -> None:
    """What was the second documented divergence: with lookahead hashing of two or more tokens
    a request has fewer block hashes than full blocks, and in a layout without full attention
    vLLM's sliding-window and chunked-local hit searches index past ``block_hashes`` and raise
    IndexError. kvblocks refuses that configuration, so vLLM's manager (and its error) stay;
    one lookahead token, or a full-attention group in the layout, runs on kvblocks."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvblocks.vllm.kv_cache_manager import KVCacheManager
    from kvblocks.vllm.support import Unsupported

    common: dict[str, Any] = {
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.float32,
    }
    spec: Any = (
        SlidingWindowSpec(**common, sliding_window=8)
        if kind == "sliding_window"
        else ChunkedLocalAttentionSpec(**common, attention_chunk_size=8)
    )

    def kwargs(*specs: Any, lookahead: int = 2) -> dict[str, Any]:
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
        config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
        return {
            "kv_cache_config": config,
            "max_model_len": 64,
            "scheduler_block_size": 4,
            "hash_block_size": 4,
            "num_hash_lookahead_tokens": lookahead,
        }

    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256, 2)
    request = make_request("r", list(range(13)), hasher)
    assert len(request.block_hashes) == 2  # block 2 (tokens 8..11) waits for tokens 12 and 13
    with pytest.raises(IndexError):  # why kvblocks steps aside
        VllmKVCacheManager(**kwargs(spec)).get_computed_blocks(request)
    with pytest.raises(Unsupported) as refused:
        KVCacheManager(**kwargs(spec))
    assert refused.value.reason == _state.Reason.LOOKAHEAD_WITHOUT_FULL
    assert isinstance(KVCacheManager(**kwargs(spec, lookahead=1)), KVCacheManager)
    assert isinstance(KVCacheManager(**kwargs(spec, FullAttentionSpec(**common))), KVCacheManager)
