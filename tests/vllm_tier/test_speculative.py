"""Speculative decoding (n-gram on the CPU and the GPU, suffix, EAGLE, EAGLE-3, MTP, a
separate draft model, DFlash, DSpark): vLLM's scheduler on vLLM's KV-cache manager against
the same scheduler on kvblocks', step by step (the harness: ``harness.py``; the drafts:
``tests.vllm_driver.drafts``).

Every step's record holds the ``SchedulerOutput`` with its scheduled draft tokens, the
request outputs (accepted drafts plus the bonus token), the prefix-cache and
speculative-decoding statistics and KV-cache usage, every KV-event batch and every live
request's block tables. The speculative config is vLLM's own ``SpeculativeConfig``; the
scheduler derives the manager's arguments from it (EAGLE block drop, lookahead slots, prefill
lookahead, lookahead hashing), and each run asserts both managers got the same ones, that
kvblocks' manager and hasher ran (no fallback), the hasher's lookahead, the scheduler class
(``AsyncScheduler`` under async scheduling) and the model runner vLLM picked (V2 for DSpark,
which vLLM 0.33 runs on no other: ``tests.vllm_driver.speculative.v2_model_runner``).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvblocks.vllm import _state
from kvblocks.vllm.block_hasher import ALGORITHMS
from tests.vllm_driver import (
    SchedulerSpec,
    Speculation,
    make_vllm_config,
    sampled_token,
)
from tests.vllm_driver.speculative import HAS_PARD, HAS_V1_MODEL_RUNNER, V2_ONLY, v2_model_runner
from tests.vllm_tier.harness import (
    Hasher,
    RequestSpec,
    Script,
    assert_same,
    events_spec,
    on_each_manager,
    play,
    shared_prefix_script,
    soak_script,
)
from tests.vllm_tier.test_review_paths import both as review_paths_both
from tests.vllm_tier.test_review_paths import random_case

CONFIGS = {
    "ngram": Speculation("ngram", 3),
    "suffix": Speculation("suffix", 4),
    "eagle": Speculation("eagle", 3),
    "eagle-drop": Speculation("eagle", 3, disable_lookahead_block_hashes=True),
    "eagle3": Speculation("eagle3", 2),
    "mtp": Speculation("mtp", 3),  # three MTP modules: num_prefill_lookahead 3
    # vLLM's GPU n-gram drafter: async scheduling on with the V1 model runner; -1 padding.
    "ngram_gpu": Speculation("ngram_gpu", 3),
    "draft_model": Speculation("draft_model", 3),
    **({"pard": Speculation("draft_model", 2, parallel_drafting=True)} if HAS_PARD else {}),
    "dflash": Speculation("dflash", 3),
    "dspark": Speculation("dspark", 3),  # on vLLM's V2 model runner
    "dspark-fill-in": Speculation("dspark", 2, fill_in=True),
}
#: What vLLM 0.33 derives from each config with prefix caching on (its rules, read from
#: ``vllm/config/vllm.py`` and the scheduler, written out here): draft tokens, lookahead
#: slots, prefill lookahead, lookahead-hash tokens, and whether the manager drops the last
#: hit block (``use_eagle``). Without prefix caching nothing is hashed, so the EAGLE
#: family drops instead. DFlash and DSpark draft from the target's hidden states alone, so
#: they neither drop nor hash ahead; DFlash and fill-in DSpark reserve a bonus query's slot.
EXPECTED = {
    "ngram": (3, 0, 0, 0, False),
    "suffix": (4, 0, 0, 0, False),
    "eagle": (3, 3, 1, 1, False),
    "eagle-drop": (3, 3, 1, 0, True),
    "eagle3": (2, 2, 1, 1, False),
    "mtp": (3, 3, 3, 3, False),
    "ngram_gpu": (3, 0, 0, 0, False),
    "draft_model": (3, 3, 0, 0, False),
    "pard": (2, 2, 0, 0, False),
    "dflash": (3, 4, 1, 0, False),
    "dspark": (3, 3, 1, 0, False),
    "dspark-fill-in": (2, 3, 1, 0, False),
}
#: The input slots each decoding request adds for drafting
#: (``SpeculativeConfig.max_num_new_slots_for_drafting``, the scheduler's budget): a separate
#: draft model keeps one unsliced token, PARD queries all k; the others none.
DRAFT_SLOTS = {"draft_model": 1, "pard": 2}
EAGLE_FAMILY = {"eagle", "eagle-drop", "eagle3", "mtp"}
#: gpt-oss's layout (full attention and a sliding window) with a window that matters in a
#: short run of 4-token blocks.
GPT_OSS_SMALL: list[tuple[str, int]] = [("full", 0), ("sliding_window", 16)]
LAYOUTS: dict[str, str | list[tuple[str, int]]] = {"llama": "llama", "gpt-oss": GPT_OSS_SMALL}
MATRIX = [
    pytest.param(name, layout, sync_or_async, id=f"{name}-{layout}-{sync_or_async}")
    for name in CONFIGS
    for layout in LAYOUTS
    for sync_or_async in ("sync", "async")
    if not (name == "suffix" and sync_or_async == "async")  # no vLLM runner does that
]


def settings_of(scheduler: Scheduler) -> tuple[Any, ...]:
    """What the scheduler and its manager took from the speculative config."""
    manager = scheduler.kv_cache_manager
    return (
        scheduler.num_spec_tokens,
        scheduler.num_lookahead_tokens,
        scheduler.num_prefill_lookahead,
        scheduler.num_hash_lookahead_tokens,
        scheduler.use_eagle_block_drop,
        manager.use_eagle,
        sorted(manager.coordinator.eagle_group_ids),
    )


def each_manager(
    model_dir: Path, spec: SchedulerSpec, run: Callable[[Scheduler, Hasher], Any]
) -> list[Any]:
    """``on_each_manager`` with the model runner the method needs selected for the whole run
    (the scheduler reads it when built)."""
    with v2_model_runner(spec.speculative):
        return on_each_manager(model_dir, spec, run)


def compare(model_dir: Path, script: Script) -> list[Any]:
    """Runs ``script`` on both managers, asserts kvblocks' manager and hasher ran (with the
    config's lookahead) on the scheduler class and model runner the spec asks for, and that
    every step is the same; returns stock vLLM's records."""
    speculation = script.spec.speculative
    v2 = speculation is not None and speculation.method in V2_ONLY

    def noting(scheduler: Scheduler, hasher: Hasher) -> tuple[Any, ...]:
        assert isinstance(scheduler, AsyncScheduler) == script.spec.async_scheduling
        # vLLM 0.34 has only the V2 model runner, and no flag for it.
        assert getattr(scheduler, "use_v2_model_runner", v2) == v2
        return play(script, scheduler, hasher), dict(_state.active), settings_of(scheduler)

    (stock, _, stock_settings), (ours, active, our_settings) = each_manager(
        model_dir, script.spec, noting
    )
    assert not _state.fallbacks, "kvblocks' manager and hasher must both run"
    assert "kv_cache_manager" in active
    lookahead = stock_settings[3]
    algo = script.spec.hash_algo
    assert active["hasher"] == (f"{algo}, {lookahead} lookahead tokens" if lookahead else algo)
    assert our_settings == stock_settings
    assert_same(stock, ours)
    return stock


# What the records show.


def steps(records: list[Any]) -> list[Any]:
    return records[:-1]


def spec_stats(records: list[Any]) -> list[dict[str, Any]]:
    """Each step's speculative-decoding statistics (vLLM's ``SpecDecodingStats`` fields),
    where a step verified drafts."""
    return [r[2][3] for r in steps(records) if r[2] is not None and r[2][3] is not None]


def preempted(records: list[Any]) -> bool:
    return any(r[0] is not None and r[0][5] for r in steps(records))


def prefix_hits(records: list[Any]) -> int:
    return sum(r[2][1][3] for r in steps(records) if r[2] is not None)


def scheduled_drafts(records: list[Any]) -> list[tuple[str, list[int]]]:
    return [d for r in steps(records) if r[0] is not None for d in r[0][6]]


def assert_speculated(records: list[Any]) -> None:
    """Drafts were scheduled and verified, some steps accepting all of them, some part."""
    stats = [(s["num_draft_tokens"], s["num_accepted_tokens"]) for s in spec_stats(records)]
    assert scheduled_drafts(records)
    assert stats
    assert any(accepted < drafted for drafted, accepted in stats)
    assert any(accepted == drafted for drafted, accepted in stats)


# The scheduler really runs the speculative config.


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_scheduler_sees_the_speculative_settings(
    model_dir: Path, name: str, caching: bool
) -> None:
    spec = events_spec(64, layout=GPT_OSS_SMALL, enable_caching=caching, speculative=CONFIGS[name])

    def inspect(scheduler: Scheduler, hasher: Hasher) -> tuple[Any, ...]:
        groups = scheduler.kv_cache_config.kv_cache_groups
        config = scheduler.vllm_config.speculative_config
        return (
            settings_of(scheduler),
            [g.is_eagle_group for g in groups],
            groups[1].kv_cache_spec.extra_retained_tokens,
            config.method,
            config.max_num_new_slots_for_drafting,
            getattr(scheduler, "use_v2_model_runner", None),
            type(scheduler.kv_cache_manager).__module__,
        )

    stock, ours = each_manager(model_dir, spec, inspect)
    assert ours[:-1] == stock[:-1]
    assert (stock[-1], ours[-1]) == (
        "vllm.v1.core.kv_cache_manager",
        "kvblocks.vllm.kv_cache_manager",
    )
    assert not _state.fallbacks
    k, slots, prefill, hashed, drop = EXPECTED[name]
    if not caching:
        hashed, drop = 0, name in EAGLE_FAMILY
    eagle = name in EAGLE_FAMILY
    # vLLM flags the group of the draft layers (the full-attention one) for the EAGLE family.
    assert stock[:-1] == (
        (k, slots, prefill, hashed, drop, drop, [0] if eagle else []),
        [eagle, False],
        max(prefill - 1, 0),  # the window keeps the MTP modules' extra tokens
        CONFIGS[name].method,
        DRAFT_SLOTS.get(name, 0),
        CONFIGS[name].method in V2_ONLY if HAS_V1_MODEL_RUNNER else None,
    )


def test_speculation_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown speculative method"):
        Speculation("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Speculation("ngram", 0)
    with pytest.raises(ValueError, match="mtp_modules"):
        Speculation("eagle", mtp_modules=2)
    with pytest.raises(ValueError, match="suffix decoding under async"):
        SchedulerSpec(async_scheduling=True, speculative=Speculation("suffix"))
    with pytest.raises(ValueError, match="parallel_drafting"):
        Speculation("eagle", parallel_drafting=True)
    with pytest.raises(ValueError, match="fill_in"):
        Speculation("dflash", fill_in=True)


class _AsksForAsync(SchedulerSpec):
    """Asks vLLM's config for async scheduling whatever the method (the driver does not ask
    for plain n-gram, which the V1 model runner refuses)."""

    @property
    def config_async_scheduling(self) -> bool:
        return self.async_scheduling


@pytest.mark.parametrize("method", ["ngram_gpu", "draft_model", "dflash"])
def test_vllm_keeps_async_scheduling_on_for(model_dir: Path, method: str) -> None:
    """vLLM 0.33's V1 model runner (the CPU's) refuses async scheduling with plain n-gram
    (0.34 has only its V2 runner, which accepts it), and accepts it with the GPU n-gram
    drafter, a draft model and DFlash: what the issue's ``ngram_gpu`` is for."""
    plain = _AsksForAsync(async_scheduling=True, speculative=Speculation("ngram"))
    if HAS_V1_MODEL_RUNNER:
        with pytest.raises(ValueError, match="ngram-based speculative decoding"):
            make_vllm_config(model_dir, plain)
    else:  # vLLM 0.34 (V2 model runner only) accepts it
        assert make_vllm_config(model_dir, plain).speculative_config.method == "ngram"
    spec = _AsksForAsync(async_scheduling=True, speculative=Speculation(method))
    assert make_vllm_config(model_dir, spec).speculative_config.method == method


def test_dspark_runs_only_on_the_v2_model_runner(model_dir: Path) -> None:
    """vLLM 0.33 refuses DSpark on its V1 model runner; the driver selects V2 as a user does
    (``VLLM_USE_V2_MODEL_RUNNER=1``) while its config is built, and leaves the environment as
    it was."""
    from vllm.config import ParallelConfig, VllmConfig

    from kvblocks.vllm.bench.config import model_config
    from tests.vllm_driver.speculative import speculative_config

    target = model_config(model_dir)
    dspark = speculative_config(Speculation("dspark", 3), target, ParallelConfig())
    with pytest.MonkeyPatch.context() as mp:
        if HAS_V1_MODEL_RUNNER:  # (vLLM 0.34 has only the V2 runner, and no such variable)
            mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
            with pytest.raises(ValueError, match="V1 does not support: dspark"):
                VllmConfig(model_config=target, speculative_config=dspark)
            mp.delenv("VLLM_USE_V2_MODEL_RUNNER")
        config = make_vllm_config(model_dir, SchedulerSpec(speculative=Speculation("dspark", 3)))
        assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert config.speculative_config.method == "dspark"


def test_suffix_config_leaves_vllm_as_it_was(model_dir: Path) -> None:
    """Suffix decoding's config is built with vLLM's ``arctic_inference`` check answered yes
    for the moment, then the check is vLLM's again."""
    from vllm.config import speculative

    check = getattr(speculative, "has_arctic_inference", None)  # (vLLM 0.34 has none)
    spec = SchedulerSpec(speculative=Speculation("suffix", 4))
    config = make_vllm_config(model_dir, spec).speculative_config
    assert getattr(speculative, "has_arctic_inference", None) is check
    assert (config.method, config.num_speculative_tokens) == ("suffix", 4)
    assert type(config) is speculative.SpeculativeConfig


# The fake model: drafts reach the scheduler as vLLM's engine core hands them.


def outputs_by_request(records: list[Any]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for record in steps(records):
        for request_id, new, *_ in record[1]:
            tokens.setdefault(request_id, []).extend(new)
    return tokens


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft_model", "dflash", "dspark"])
def test_perfect_drafts_are_the_next_outputs(model_dir: Path, method: str) -> None:
    """Drafts that are always right: each draft list scheduled for a request (synchronous
    scheduling hands the scheduler the real tokens) is the request's next outputs, and every
    verifying step accepts all of them."""
    spec = events_spec(200, speculative=Speculation(method, 3))
    script = shared_prefix_script(spec, 10, seed=4)
    script.draft_accuracy = 1.0
    records = compare(model_dir, script)
    outputs = outputs_by_request(records)
    emitted: dict[str, int] = {}
    checked = 0
    for record in steps(records):
        for request_id, drafts in record[0][6] if record[0] else ():
            if drafts[0] == -1:  # a newly admitted request padded to 1 + k tokens
                continue
            done = emitted.get(request_id, 0)
            # Drafts guess the step's outputs (its first output verifies the first draft).
            future = outputs[request_id][done : done + len(drafts)]
            assert drafts[: len(future)] == future
            checked += 1
        for request_id, new, *_ in record[1]:
            emitted[request_id] = emitted.get(request_id, 0) + len(new)
    assert checked > 20
    stats = spec_stats(records)
    assert stats
    assert all(s["num_accepted_tokens"] == s["num_draft_tokens"] for s in stats)


@pytest.mark.parametrize("sync_or_async", ["sync", "async"])
def test_drafts_that_are_always_wrong_are_all_rejected(model_dir: Path, sync_or_async: str) -> None:
    spec = events_spec(
        200, async_scheduling=sync_or_async == "async", speculative=Speculation("eagle", 3)
    )
    script = shared_prefix_script(spec, 10, seed=4)
    script.draft_accuracy = 0.0
    records = compare(model_dir, script)
    stats = spec_stats(records)
    assert stats
    assert all(s["num_accepted_tokens"] == 0 for s in stats)
    for request_id, tokens in outputs_by_request(records).items():
        # One token a step, the model's own: what a run without drafts samples.
        assert tokens == [sampled_token(request_id, i) for i in range(len(tokens))]


def test_async_drafts_stay_in_the_worker(model_dir: Path) -> None:
    """Under async scheduling the scheduler schedules -1 placeholders; the worker verifies
    its own drafts from the previous batch, so right drafts are still accepted."""
    spec = events_spec(200, async_scheduling=True, speculative=Speculation("mtp", 3))
    script = shared_prefix_script(spec, 10, seed=4)
    script.draft_accuracy = 1.0
    records = compare(model_dir, script)
    drafts = scheduled_drafts(records)
    assert drafts
    assert all(tokens == [-1] * len(tokens) for _, tokens in drafts)
    stats = spec_stats(records)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    assert accepted > 0.8 * sum(s["num_draft_tokens"] for s in stats)
    assert max(len(new) for r in steps(records) for _, new, *_ in r[1]) == 4


def test_ngram_proposes_up_to_k_drafts(model_dir: Path) -> None:
    spec = events_spec(200, speculative=Speculation("ngram", 3))
    records = compare(model_dir, shared_prefix_script(spec, 10, seed=4))
    lengths = {len(tokens) for _, tokens in scheduled_drafts(records)}
    assert lengths == {1, 2, 3}


def valid(drafts: list[int]) -> list[int]:
    """The drafts before the first ``-1`` padding."""
    return drafts[: drafts.index(-1)] if -1 in drafts else drafts


def test_ngram_gpu_schedules_its_padding(model_dir: Path) -> None:
    """vLLM's GPU n-gram drafter hands the scheduler k drafts a request, its 0..k matches
    then ``-1``: the scheduler schedules (and the manager allocates for) all k, and the step
    accepts the right ones, never the padding."""
    spec = events_spec(200, speculative=Speculation("ngram_gpu", 3))
    script = shared_prefix_script(spec, 10, seed=4)
    script.draft_accuracy = 1.0
    records = compare(model_dir, script)
    drafts = scheduled_drafts(records)
    assert {len(tokens) for _, tokens in drafts} == {3}
    assert {len(valid(tokens)) for _, tokens in drafts} == {0, 1, 2, 3}
    outputs = outputs_by_request(records)
    emitted: dict[str, int] = {}
    for record in steps(records):
        for request_id, tokens in record[0][6] if record[0] else ():
            done = emitted.get(request_id, 0)
            future = outputs[request_id][done : done + len(valid(tokens))]
            assert valid(tokens)[: len(future)] == future
        for request_id, new, *_ in record[1]:
            emitted[request_id] = emitted.get(request_id, 0) + len(new)
    stats = spec_stats(records)
    assert sum(s["num_draft_tokens"] for s in stats) == 3 * len(drafts)
    assert sum(s["num_accepted_tokens"] for s in stats) == sum(len(valid(t)) for _, t in drafts)


def test_ngram_gpu_under_async_scheduling(model_dir: Path) -> None:
    """The point of ``ngram_gpu``: n-gram drafting with async scheduling (an
    ``AsyncScheduler``, which ``compare`` asserts), on kvblocks' manager. The scheduler
    schedules k placeholders; the worker verifies its own matches, never its padding."""
    spec = events_spec(200, async_scheduling=True, speculative=Speculation("ngram_gpu", 3))
    script = shared_prefix_script(spec, 10, seed=4)
    script.draft_accuracy = 1.0
    records = compare(model_dir, script)
    drafts = scheduled_drafts(records)
    assert drafts
    assert all(tokens == [-1] * 3 for _, tokens in drafts)
    stats = spec_stats(records)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    assert 0 < accepted < sum(s["num_draft_tokens"] for s in stats)
    assert max(len(new) for r in steps(records) for _, new, *_ in r[1]) == 4


# Stock vLLM against kvblocks, step by step.


#: Pools other than 40 blocks (prefix caching) or 56 (none) for :func:`matrix_script`: DFlash's
#: bonus slot leaves a long prompt on gpt-oss preempting itself forever under async scheduling
#: in 40 blocks, on vLLM's own manager; a draft model without prefix caching does not preempt
#: on llama in 56.
MATRIX_POOLS = {("dflash", True): 42, ("draft_model", False): 60}


def matrix_script(name: str, layout: str, sync_or_async: str, *, caching: bool = True) -> Script:
    """Shared prefixes, chunked prefill (32-token budget), a pool small enough to preempt,
    KV events on, aborts (one of a waiting request), salts, a LoRA, a failed and an idle
    cache reset, a repeated prompt after it. (Without prefix caching the pool is larger: a
    40-block pool leaves a long prompt on gpt-oss preempting itself forever under async
    scheduling, on either manager; :data:`MATRIX_POOLS` has the other exceptions.)"""
    spec = events_spec(
        MATRIX_POOLS.get((name, caching), 40 if caching else 56),
        layout=LAYOUTS[layout],
        async_scheduling=sync_or_async == "async",
        enable_caching=caching,
        speculative=CONFIGS[name],
    )
    script = shared_prefix_script(spec, 24, seed=17)
    script.requests[2].salt = "tenant"
    script.requests[4].lora = 1
    script.requests[6].sampling = {"extra_args": {"kv_cache_report_mode": "full"}}
    script.aborts = [(3, 0), (9, 11), (20, 23)]
    script.requests.append(RequestSpec(script.requests[1].prompt, 6, 400))
    script.resets = [2, 399]
    return script


@pytest.mark.parametrize(("name", "layout", "sync_or_async"), MATRIX)
def test_step_by_step(model_dir: Path, name: str, layout: str, sync_or_async: str) -> None:
    records = compare(model_dir, matrix_script(name, layout, sync_or_async))
    assert_speculated(records)
    assert preempted(records), "the small pool must preempt"
    assert prefix_hits(records) > 0, "shared prefixes must hit"
    assert {r[4] for r in steps(records)} >= {False, True}, "one reset fails, one succeeds"


@pytest.mark.parametrize(
    ("name", "layout", "sync_or_async"),
    [
        pytest.param(name, layout, mode, id=f"{name}-{layout}-{mode}")
        for name in CONFIGS
        for layout, mode in (("llama", "sync"), ("gpt-oss", "async"))
        if not (name == "suffix" and mode == "async")
    ]
    + [pytest.param("suffix", "gpt-oss", "sync", id="suffix-gpt-oss-sync")],
)
def test_step_by_step_without_prefix_caching(
    model_dir: Path, name: str, layout: str, sync_or_async: str
) -> None:
    records = compare(model_dir, matrix_script(name, layout, sync_or_async, caching=False))
    assert_speculated(records)
    assert preempted(records)
    assert prefix_hits(records) == 0


# Random scripts.


#: The methods kvblocks serves since the GPU n-gram drafter's issue (their own random
#: scripts and mixes, so that the earlier ones keep their draws).
NEWER_METHODS = ["ngram_gpu", "draft_model", "dflash", "dspark"]


@st.composite
def speculative_scripts(
    draw: st.DrawFn, methods: tuple[str, ...] = ("ngram", "suffix", "eagle", "eagle3", "mtp")
) -> Script:
    method = draw(st.sampled_from(methods))
    k = draw(st.integers(1, 4))
    caching = draw(st.sampled_from([True, True, False]))
    # vLLM reuses MTP modules only in whole rounds (k a multiple of their number).
    modules = draw(st.sampled_from([m for m in range(1, k + 1) if k % m == 0]))
    speculation = Speculation(
        method,
        k,
        disable_lookahead_block_hashes=draw(st.booleans()),
        disable_eagle_block_drop=draw(st.sampled_from([False, False, False, True])),
        mtp_modules=modules if method == "mtp" else None,
        draft_groups=draw(st.sampled_from([None, None, (), (0,), (0, 1)])),
        parallel_drafting=method == "draft_model" and HAS_PARD and draw(st.booleans()),
        fill_in=method == "dspark" and draw(st.booleans()),
    )
    block_size = draw(st.sampled_from([2, 4, 8]))
    multi_module = method == "mtp" and min(speculation.mtp_modules or k, k) > 1
    # vLLM refuses multi-module MTP with prefix caching and blocks shorter than k.
    assume(not (caching and multi_module and k > block_size))
    window = draw(st.sampled_from([8, 16]))
    layout = draw(
        st.sampled_from(
            [
                "llama",
                [("full", 0), ("sliding_window", window)],
                [("sliding_window", window), ("full", 0)],
                "mla",
                [("chunked_local", window), ("full", 0)],
            ]
        )
    )
    drops = (
        method in ("eagle", "eagle3", "mtp")
        and not speculation.disable_eagle_block_drop
        and (speculation.disable_lookahead_block_hashes or not caching)
    )
    # vLLM's chunked-local hit search refuses the EAGLE drop (kvblocks steps aside).
    assume(not (drops and isinstance(layout, list) and layout[0][0] == "chunked_local"))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=40), min_size=1, max_size=3)
    )
    n = draw(st.integers(1, 10))
    # A small max_model_len: drafts and lookahead slots run into it (prompts stay shorter,
    # as vLLM's input processor requires).
    max_model_len = draw(st.sampled_from([8192, 8192, 48]))
    requests = [
        RequestSpec(
            prompt=(
                draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 999), max_size=30))
            )[: max_model_len - 1],
            max_tokens=draw(st.integers(1, 24)),
            step=draw(st.integers(0, 12)),
            salt=draw(st.sampled_from([None, None, "a"])),
        )
        for _ in range(n)
    ]
    groups = 1 if isinstance(layout, str) else 2
    longest = max(len(r.prompt) + r.max_tokens for r in requests) + k + 1
    min_blocks = groups * (-(-longest // block_size) + 2)
    sliding = isinstance(layout, list) and any(kind == "sliding_window" for kind, _ in layout)
    spec = SchedulerSpec(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 40)),
        layout=layout,
        retention_interval=draw(st.sampled_from([0, None, 4 * block_size])) if sliding else 0,
        max_model_len=max_model_len,
        hash_algo=draw(st.sampled_from(ALGORITHMS)),
        enable_caching=caching,
        max_num_seqs=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64, 512])),
        async_scheduling=method != "suffix" and draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1])),
        kv_events=draw(st.booleans()),
        speculative=speculation,
    )
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1)), max_size=2))
    resets = draw(st.lists(st.integers(0, 60), max_size=2))
    return Script(
        spec,
        requests,
        aborts,
        resets,
        draft_seed=draw(st.integers(0, 2**16)),
        draft_accuracy=draw(st.sampled_from([0.0, 0.5, 0.75, 0.9, 1.0])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=speculative_scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    compare(model_dir, script)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=speculative_scripts(tuple(NEWER_METHODS)))
def test_random_scripts_of_the_newer_methods(model_dir: Path, script: Script) -> None:
    """n-gram on the GPU (async scheduling drawn half the time), a draft model (and PARD),
    DFlash and DSpark (sampling from the anchor or filling in)."""
    compare(model_dir, script)


# The review paths' random mixes, speculating.


def speculative_mix(seed: int, methods: list[str] | None = None) -> tuple[SchedulerSpec, int, Any]:
    """``test_review_paths.random_case`` (streaming sessions, stop tokens, prompt logprobs,
    the priority policy, resets preempting running requests, long-prefill thresholds,
    ``scheduler_reserve_full_isl``, tiny pools) with a random speculative config and layout;
    outputs one step late under async scheduling, else at once."""
    spec, _, actions = random_case(seed)
    rng = random.Random(f"speculative-{seed}")
    if methods is None:
        methods = ["ngram", "eagle", "eagle3", "mtp"] + (
            [] if spec.async_scheduling else ["suffix"]
        )
    method = rng.choice(methods)
    k = rng.randint(1, 4)
    if method == "mtp" and spec.enable_caching:
        k = min(k, spec.block_size)  # vLLM refuses more MTP modules than a block holds
    layout = rng.choice(["llama", "llama", GPT_OSS_SMALL, "mla"])
    speculation = Speculation(
        method,
        k,
        disable_lookahead_block_hashes=rng.random() < 0.4,
        mtp_modules=k if method == "mtp" else None,
        parallel_drafting=method == "draft_model" and HAS_PARD and rng.random() < 0.5,
        fill_in=method == "dspark" and rng.random() < 0.5,
    )
    groups = 1 if isinstance(layout, str) else 2
    spec = dataclasses.replace(
        spec,
        speculative=speculation,
        layout=layout,
        num_blocks=spec.num_blocks * groups + k,
        max_num_batched_tokens=max(spec.max_num_batched_tokens, 16),
    )
    return spec, 1 if spec.async_scheduling else 0, actions


@pytest.mark.parametrize("seed", range(24))
def test_random_mixes_of_the_review_paths(model_dir: Path, seed: int) -> None:
    spec, lag, actions = speculative_mix(seed)
    stock, ours = review_paths_both(model_dir, spec, actions, lag=lag)
    assert_same(stock, ours)
    assert stock[-1][:1] != ("raised",), stock[-1]  # every mix runs to its end
    assert scheduled_drafts(stock)


@pytest.mark.parametrize("seed", range(24, 40))
def test_random_mixes_of_the_review_paths_with_the_newer_methods(
    model_dir: Path, seed: int
) -> None:
    spec, lag, actions = speculative_mix(seed, NEWER_METHODS)
    with v2_model_runner(spec.speculative):
        stock, ours = review_paths_both(model_dir, spec, actions, lag=lag)
    assert_same(stock, ours)
    assert stock[-1][:1] != ("raised",), stock[-1]
    assert scheduled_drafts(stock)


# Soaks: more than a thousand steps.


SOAKS = {
    "eagle-gpt-oss-async": (Speculation("eagle", 3), GPT_OSS_SMALL, True),
    "ngram-llama-sync": (Speculation("ngram", 3), "llama", False),
}


@pytest.mark.parametrize("soak", list(SOAKS))
def test_soak_thousands_of_steps(model_dir: Path, soak: str) -> None:
    speculation, layout, async_scheduling = SOAKS[soak]
    spec = SchedulerSpec(
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        layout=layout,
        async_scheduling=async_scheduling,
        kv_events=True,
        speculative=speculation,
    )
    # Drafts finish requests sooner: arrivals every 7 steps keep the pool busy.
    script = soak_script(spec, seed=99, spacing=7)
    script.draft_seed = 99
    records = compare(model_dir, script)
    assert len(records) > 1000
    assert_speculated(records)
    assert preempted(records)
    assert prefix_hits(records) > 0
