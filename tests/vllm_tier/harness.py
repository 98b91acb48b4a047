"""The differential harness of the vLLM tier: scripts of requests, one run of a script on
stock vLLM's KV-cache manager and one on kvblocks', and the step-by-step comparison.

Each step's record holds the ``SchedulerOutput`` (scheduled tokens per request, new and
cached requests' block ids, computed tokens, resumed, finished and preempted ids), the
request outputs, the prefix-cache statistics and KV-cache usage, every KV-event batch, and
the result of any ``reset_prefix_cache``; the run ends with every request's block hashes."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import strategies as st
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm.bench import mamba_checkpoint_alignment_for
from tests.vllm_driver import (
    SchedulerSpec,
    block_hasher,
    drafter_for,
    make_request,
    make_scheduler,
    mooncake,
    nixl,
)
from tests.vllm_tier.simulation import IMPLS, Action, implementation, run

Hasher = Callable[[Request], list[bytes]]
T = TypeVar("T")
#: The module of the request block hasher ``kv_cache_utils`` builds, by implementation.
HASHER_MODULES = {"vllm": "vllm.v1.core.kv_cache_utils", "kvblocks": "kvblocks.vllm.block_hasher"}


@dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    step: int
    salt: str | None = None
    lora: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class Script:
    spec: SchedulerSpec
    requests: list[RequestSpec]
    aborts: list[tuple[int, int]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    #: Speculative decoding: the fake drafter's seed and how often its guesses are right.
    draft_seed: int = 0
    draft_accuracy: float = 0.75
    #: Calls on the scheduler before a step's ``schedule()``, by step; their results are in
    #: the step's record (``simulation.run``).
    actions: dict[int, list[Action]] = field(default_factory=dict)


def on_each_manager(
    model_dir: Path,
    spec: SchedulerSpec,
    play: Callable[[Scheduler, Hasher], T],
    *,
    seed: str = "0",
) -> list[T]:
    """``play`` on a fresh scheduler and request block hasher for ``spec``, with stock vLLM,
    then with kvblocks; asserts each run had the KV-cache manager and the hasher it should,
    and that the scheduler built both managers with the same arguments. The hasher is
    ``EngineCore``'s, with the config's lookahead (EAGLE/MTP lookahead hashing)."""
    results = []
    arguments: list[dict[str, Any]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", seed)  # one NONE_HASH for both runs (xxhash)
        for impl in IMPLS:
            with implementation(impl) as manager, _recording(arguments):
                scheduler = make_scheduler(model_dir, spec)
                assert type(scheduler.kv_cache_manager) is manager
                lookahead = scheduler.vllm_config.num_hash_lookahead_tokens
                hasher = block_hasher(spec.hash_algo, spec.block_size, lookahead)
                assert hasher.__module__ == HASHER_MODULES[impl]
                # Inside vLLM a failed allocation check finishes the request with an error
                # instead of raising (status().contained_errors): here it must never happen.
                contained = _state.contained_errors
                results.append(play(scheduler, hasher))
                assert _state.contained_errors == contained, "an allocation failed its check"
    stock_arguments, ours_arguments = arguments
    assert ours_arguments == stock_arguments
    return results


@contextmanager
def _recording(arguments: list[dict[str, Any]]) -> Iterator[None]:
    """Records the keyword arguments of the KV-cache manager a scheduler builds inside
    (through whatever vLLM's scheduler module names ``KVCacheManager``: vLLM's class, or
    kvblocks' factory)."""
    build = scheduler_module.KVCacheManager

    def recording(**kwargs: Any) -> Any:
        arguments.append(kwargs)
        return build(**kwargs)

    scheduler_module.KVCacheManager = recording
    try:
        yield
    finally:
        scheduler_module.KVCacheManager = build


def play(script: Script, scheduler: Scheduler, hasher: Hasher, *, catch: bool = False) -> list[Any]:
    """One run of the script (no request hashing where prefix caching is off, as in
    ``EngineCore``); with ``catch``, an exception ends the run as its last record
    (``simulation.run``)."""
    arrivals = []
    # EngineCore hashes requests for prefix caching or a KV connector.
    spec = script.spec
    hashed = spec.enable_caching or spec.has_kv_connector
    for i, r in enumerate(script.requests):
        kwargs: dict[str, Any] = {"cache_salt": r.salt}
        if r.lora is not None:
            kwargs["lora_request"] = LoRARequest(f"adapter-{r.lora}", r.lora, f"/lora/{r.lora}")
        request = make_request(
            f"r{i}",
            r.prompt,
            hasher if hashed else None,
            max_tokens=r.max_tokens,
            # a copy per run: KV connectors change a request's kv_transfer_params
            sampling=copy.deepcopy(r.sampling),
            **kwargs,
        )
        arrivals.append((r.step, request))
    aborts = [(step, f"r{i}") for step, i in script.aborts]
    drafter = drafter_for(scheduler, seed=script.draft_seed, accuracy=script.draft_accuracy)
    return run(
        scheduler,
        arrivals,
        aborts=aborts,
        resets=script.resets,
        max_steps=5_000,
        drafter=drafter,
        actions=script.actions,
        catch=catch,
    )


def both(model_dir: Path, script: Script, *, seed: str = "0") -> tuple[list[Any], list[Any]]:
    """(stock vLLM's records, kvblocks' records); asserts kvblocks' manager and hasher really
    ran, and that nothing fell back to vLLM's code (a hasher fallback for some request would
    compare vLLM with vLLM there)."""
    stock, ours = on_each_manager(
        model_dir, script.spec, lambda scheduler, hasher: play(script, scheduler, hasher), seed=seed
    )
    assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
    return stock, ours


def assert_same(stock: list[Any], ours: list[Any]) -> None:
    assert len(ours) == len(stock)
    for step, (a, b) in enumerate(zip(stock, ours, strict=True)):
        assert b == a, f"step {step} differs"


def group_tables(scheduler: Any) -> list[list[tuple[str, list[tuple[int, bool, bool]]]]]:
    """What each group manager's ``req_to_blocks`` holds, as plain values: per group, per
    request holding blocks, each block's id, whether it is the null block and whether it
    is registered in the prefix cache (has a hash). Empty entries are left out: vLLM's
    ``req_to_blocks`` is a ``defaultdict`` that keeps one for each request a Mamba group only
    looked up; kvblocks' view lists the requests holding blocks."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return [
        sorted(
            (rid, [(b.block_id, b.is_null, b.block_hash is not None) for b in blocks])
            for rid, blocks in manager.req_to_blocks.items()
            if blocks
        )
        for manager in managers
    ]


#: The layouts the KV-connector tests run (test_nixl, test_mooncake, test_decode_bench): one
#: full-attention group, gpt-oss's window and full attention, and a Qwen3.5-like layout without
#: prefix caching (Mamba groups in cache mode "none").
CONNECTOR_LAYOUTS: dict[str, Any] = {
    "llama": [("full", 0)],
    "gpt-oss": [("full", 0), ("sliding_window", 16)],
    "qwen3.5, prefix caching off": [("full", 0)] + [("mamba", 0)] * 3,
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
}


def connector_spec(layout: str, **kwargs: Any) -> SchedulerSpec:
    """A :data:`CONNECTOR_LAYOUTS` layout on small blocks, KV events on, prefix caching as
    the layout's name says (qwen3.5's Mamba groups then with prefill checkpoints on the block
    grid, as Qwen3.5's gated delta-net exports them); ``kwargs`` choose the connector and
    override the rest."""
    kwargs = {
        "block_size": 4,
        "num_blocks": 200,
        "max_num_batched_tokens": 48,
        "max_model_len": 512,
        "kv_events": True,
        "enable_caching": not layout.endswith("prefix caching off"),
        **kwargs,
    }
    kwargs.setdefault(
        "mamba_checkpoint_alignment", mamba_checkpoint_alignment_for(layout, kwargs["block_size"])
    )
    return SchedulerSpec(layout=CONNECTOR_LAYOUTS[layout], **kwargs)


def served_scheduler(model_dir: Path, spec: SchedulerSpec, connector: str, described: str) -> Any:
    """A scheduler for ``spec`` with kvblocks installed, after checking that its KV connector
    is vLLM's ``connector`` (a class name), bound to kvblocks' manager, that status() says
    ``described`` of the manager, and that nothing fell back."""
    kvblocks.vllm.install("all")
    _state.fallbacks.clear()
    scheduler = make_scheduler(model_dir, spec)
    manager = scheduler.kv_cache_manager
    assert type(manager).__module__ == "kvblocks.vllm.kv_cache_manager"
    assert type(scheduler.connector).__name__ == connector
    assert scheduler.connector._kv_cache_manager is manager
    assert described in str(kvblocks.vllm.status())
    assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
    return scheduler


def disaggregated_script(spec: SchedulerSpec, n: int, seed: int) -> Script:
    """``n`` requests over 30 steps, a third each prefill requests, decode requests and plain
    ones (with the ``kv_transfer_params`` of the spec's connector: Mooncake's, or NIXL's),
    their prompts a shared prefix (one of three) and a tail of their own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 60))] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        role, request_id = i % 3, f"r{i}"
        params: dict[str, Any] | None = None
        if spec.mooncake and role < 2:
            params = (mooncake.prefill_params, mooncake.decode_params)[role](request_id)
        elif role == 0:
            params = nixl.prefill_params()
        elif role == 1:
            params = nixl.decode_params(request_id, -(-len(prompt) // spec.block_size))
        requests.append(
            RequestSpec(
                prompt,
                max_tokens=1 if role == 0 else rng.randrange(2, 12),
                step=rng.randrange(30),
                sampling={"extra_args": {"kv_transfer_params": params}} if params else {},
            )
        )
    return Script(spec, requests)


def draw_sizes(draw: st.DrawFn, min_blocks: int = 60, max_blocks: int = 200) -> dict[str, Any]:
    """SchedulerSpec sizes for a hypothesis script: pool, batch and token budget, and whether
    scheduling is asynchronous."""
    return {
        "num_blocks": draw(st.integers(min_blocks, max_blocks)),
        "max_num_seqs": draw(st.sampled_from([2, 4, 16])),
        "max_num_batched_tokens": draw(st.sampled_from([16, 48])),
        "async_scheduling": draw(st.booleans()),
    }


def draw_disaggregated_script(draw: st.DrawFn, spec: SchedulerSpec) -> Script:
    """:func:`disaggregated_script` of 1 to 12 requests, with aborts and resets drawn."""
    n = draw(st.integers(1, 12))
    script = disaggregated_script(spec, n, seed=draw(st.integers(0, 1000)))
    script.aborts, script.resets = draw_aborts_and_resets(draw, n)
    return script


def records_of(stock: list[Any]) -> list[Any]:
    """A run's step records that scheduled (what KV connectors' tests read)."""
    return [record for record in stock[:-1] if record[0] is not None]


def events_spec(num_blocks: int, max_num_batched_tokens: int = 32, **kw: Any) -> SchedulerSpec:
    """Block size 4 and KV events on, unless ``kw`` says otherwise."""
    kw = {"block_size": 4, "kv_events": True, **kw}
    return SchedulerSpec(num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens, **kw)


def shared_prefix_script(
    spec: SchedulerSpec,
    n: int,
    seed: int,
    *,
    vocab: int = 1000,
    prefix_lens: tuple[int, int] = (1, 70),
    suffix_lens: tuple[int, int] = (0, 40),
    arrival_steps: int = 25,
    **request_kwargs: Any,
) -> Script:
    """``n`` requests arriving over ``arrival_steps`` steps, each prompt one of three prefixes
    then a suffix of its own (lengths in ``range(*prefix_lens)``, ``range(*suffix_lens)``)."""
    rng = random.Random(seed)

    def tokens(lens: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randrange(*lens))]

    prefixes = [tokens(prefix_lens) for _ in range(3)]
    requests = []
    for _ in range(n):
        prompt = rng.choice(prefixes) + tokens(suffix_lens)
        requests.append(
            RequestSpec(
                prompt, rng.randrange(1, 30), rng.randrange(0, arrival_steps), **request_kwargs
            )
        )
    return Script(spec, requests)


def featured_script(spec: SchedulerSpec, seed: int = 11, **kwargs: Any) -> Script:
    """A 30-request shared-prefix script with one request each using LoRA, a cache salt,
    ``kv_cache_report_mode="full"`` and ``skip_reading_prefix_cache``, three aborts, a reset
    at step 2 that fails (blocks in use) and one at 299 that finds the engine idle, after
    which a request repeating an earlier prompt must miss what it would have hit."""
    script = shared_prefix_script(spec, 30, seed=seed, **kwargs)
    script.requests[3].lora = 2
    script.requests[5].salt = "tenant"
    script.requests[7].sampling = {"extra_args": {"kv_cache_report_mode": "full"}}
    script.requests[9].sampling = {"skip_reading_prefix_cache": True}
    script.aborts = [(4, 0), (9, 12), (30, 25)]
    script.requests.append(RequestSpec(script.requests[1].prompt, 5, 300))
    script.resets = [2, 299]
    return script


def soak_script(spec: SchedulerSpec, seed: int, *, spacing: int = 8) -> Script:
    """A long run: 150 shared-prefix requests arriving every ``spacing`` steps (more than a
    thousand steps), every 7th salted, every 11th with a LoRA adapter, 20 aborts and a
    prefix-cache reset every 97 steps."""
    script = shared_prefix_script(spec, 150, seed=seed)
    for i, r in enumerate(script.requests):
        r.step = i * spacing
        if i % 7 == 0:
            r.salt = "s"
        if i % 11 == 0:
            r.lora = 1 + i % 2
    script.aborts = [(i * 40, i * 3) for i in range(20)]
    script.resets = list(range(0, 1500, 97))
    return script


def draw_aborts_and_resets(
    draw: Any, num_requests: int, *, max_resets: int = 2
) -> tuple[list[tuple[int, int]], list[int]]:
    """For a random script (hypothesis ``draw``): up to two aborts (step, request index) and
    up to ``max_resets`` prefix-cache resets (steps)."""
    aborts = draw(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, num_requests - 1)), max_size=2)
    )
    resets = draw(st.lists(st.integers(0, 60), max_size=max_resets))
    return aborts, resets
