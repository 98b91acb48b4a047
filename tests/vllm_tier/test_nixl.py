"""vLLM's NIXL connector (disaggregated prefill and decode) in its pull mode
(``NixlConnector``: the decode node reads) and its push mode (``NixlPushConnector``: the
prefill node writes) on vLLM's scheduler, with vLLM's own KV-cache manager and with
kvblocks', step by step. One scheduler plays both roles: prefill requests keep their blocks
after they finish until the (fake) decode node has them; decode requests get their prompt's
KV from a (fake) remote prefill node into the blocks allocated for them, asynchronously.
Every ``SchedulerOutput``, the connector's decisions of every step (which transfers start,
into which local blocks, with how many blocks already cached per group; push mode's
registrations of local blocks; which finished prefills are handed over, with which blocks),
every request output with the ``kv_transfer_params`` it returns (a prefill's block ids for
the decode node), statistic, KV event and block table must be identical, and kvblocks'
manager must have run (``both`` asserts it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

import kvblocks.vllm
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from tests.vllm_driver import SchedulerSpec, Speculation, make_scheduler, nixl
from tests.vllm_driver.config import scheduler_config_has
from tests.vllm_tier.harness import (
    CONNECTOR_LAYOUTS,
    RequestSpec,
    Script,
    assert_same,
    both,
    connector_spec,
    disaggregated_script,
    draw_disaggregated_script,
    draw_sizes,
    records_of,
    served_scheduler,
)

#: Fields of a step's ``SchedulerOutput`` record (``vllm_driver.snapshot``): the connector's
#: reads, hand-overs, and requests in the batch / not to be sent.
PREEMPTED, RECV, SEND, OTHER = 5, 9, 10, 11
#: NIXL's transfer modes (``SchedulerSpec.nixl_transfer_mode``).
MODES = ["pull", "push"]
#: With vLLM's MultiConnector of NIXL and CPU offloading, the OffloadingConnector's load and
#: store jobs follow NIXL's three fields.
LOADS, STORES = 12, 13

LAYOUTS = CONNECTOR_LAYOUTS


def spec_for(layout: str, mode: str = "pull", **kwargs: Any) -> SchedulerSpec:
    return connector_spec(layout, **{"nixl": True, "nixl_transfer_mode": mode, **kwargs})


@pytest.mark.parametrize(
    ("mode", "connector"), [("pull", "NixlConnector"), ("push", "NixlPushConnector")]
)
def test_the_scheduler_gets_nixl_and_kvblocks_serves_it(
    model_dir: Path, mode: str, connector: str
) -> None:
    # (NixlConnector is vLLM's name for the pull mode's class)
    described = f"prefix caching on, {connector}"
    served_scheduler(model_dir, spec_for("llama", mode), f"Nixl{mode.title()}Connector", described)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nixl": True, "nixl_transfer_mode": "pulled"}, "'pull' or 'push'"),
        ({"decode_bench": "always"}, "'per request' or 'startup'"),
        ({"mooncake": True, "nixl": True}, "one KV connector at a time"),
        ({"decode_bench": "startup", "kv_offloading": 4}, "one KV connector at a time"),
        ({"decode_bench": "startup", "mooncake": True}, "one KV connector at a time"),
        ({"kv_offloading": -1}, "kv_offloading must be >= 0"),
        ({"nixl_failed_loads": 3}, "for NIXL alone"),
        ({"nixl": True, "kv_offloading": 4, "nixl_failed_loads": 3}, "for NIXL alone"),
        ({"nixl": True, "nixl_failed_loads": -1}, "count >= 0"),
        ({"nixl": True, "kv_load_failure_policy": "retry"}, "'fail' or 'recompute'"),
    ],
)
def test_the_driver_refuses_connector_specs_it_cannot_build(
    fields: dict[str, Any], message: str
) -> None:
    """NIXL with CPU offloading is vLLM's MultiConnector; any other pair of connectors, an
    unknown mode or policy, a negative CPU tier or failed loads other than NIXL's alone are
    refused when the spec is made."""
    with pytest.raises(ValueError, match=message):
        SchedulerSpec(**fields)


def test_nixl_configs_name_the_mode_and_nixl_with_offloading_is_one_connector() -> None:
    with pytest.raises(ValueError, match="'pull' or 'push'"):
        nixl.kv_transfer_config("pulled")
    assert nixl.kv_transfer_config("push").kv_connector == "NixlPushConnector"
    assert SchedulerSpec(nixl=True, kv_offloading=4).has_kv_connector


def assert_decode_requests_got_remote_kv(records: list[Any], mode: str) -> None:
    """Pull mode: reads the decode requests wait for, into their blocks. Push mode: the
    decode requests' registrations of their blocks (which the prefill node writes), with
    the same blocks in the metadata's requests to receive (not waited on: no read)."""
    reads = [r for record in records for r in record[0][RECV]]
    if mode == "pull":
        assert any(awaiting and any(blocks) for _, blocks, _, awaiting in reads), "remote reads"
        return
    registered = [r for record in records for r in record[0][OTHER][2]]
    assert any(any(blocks) for _, blocks in registered), "registrations of local blocks"
    assert sorted(registered) == sorted(
        (request_id, blocks) for request_id, blocks, _, awaiting in reads if blocks
    )
    assert not any(awaiting for *_, awaiting in reads)


def assert_partly_cached_decode_requests(records: list[Any], script: Script, mode: str) -> None:
    """Decode requests whose prompt is partly cached locally get only the rest: pull mode
    says how many blocks each group has cached; push mode registers fewer blocks than the
    prompt's."""
    reads = [r for record in records for r in record[0][RECV]]
    if mode == "pull":
        assert any(any(cached) for _, _, cached, _ in reads)
        return
    block_size = script.spec.block_size
    prompt_blocks = {f"r{i}": len(r.prompt) // block_size for i, r in enumerate(script.requests)}
    registered = [r for record in records for r in record[0][OTHER][2]]
    assert any(0 < len(blocks[0]) < prompt_blocks[rid] for rid, blocks in registered)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_disaggregated_prefill_and_decode(
    model_dir: Path, layout: str, mode: str, async_scheduling: bool
) -> None:
    """Under async scheduling the scheduler also defers freeing a request's blocks while a
    step in flight may still write them (``pop_blocks_for_free``, then the block pool)."""
    spec = spec_for(layout, mode, async_scheduling=async_scheduling)
    if async_scheduling:
        assert make_scheduler(model_dir, spec).defer_block_free
    script = disaggregated_script(spec, 24, seed=3)
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    records = records_of(stock)
    assert_decode_requests_got_remote_kv(records, mode)
    assert any(record[0][SEND] for record in records), "finished prefills handed over"
    handed = [o[4] for record in stock[:-1] for o in record[1] if o[4]]
    assert any(params["remote_block_ids"] for params in handed), "a prefill's blocks handed on"
    assert {params["transfer_mode"] for params in handed} == {mode}
    if mode == "push":  # the prefill node's workers get the finished prefills' blocks
        finished = {rid: blocks for record in records for rid, blocks in record[0][OTHER][3]}
        assert finished == {
            params["remote_request_id"]: [list(g) for g in params["remote_block_ids"]]
            for params in handed
            if any(params["remote_block_ids"])
        }
    if not layout.endswith("prefix caching off"):
        assert_partly_cached_decode_requests(records, script, mode)


@pytest.mark.parametrize("mode", MODES)
def test_divergent_hybrid_hits(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str, async_scheduling: bool
) -> None:
    """With Mamba prefix caching NIXL takes vLLM's per-group lookup: on a small pool a
    prompt's full-attention blocks often outlive its Mamba states or the reverse, the hit
    *diverges*, and a decode request is admitted with the full-attention hit, its Mamba
    state coming with the remote KV (the lists differ in length). Both managers must flag
    the same divergences (counted by wrapping each one's lookup) and decide alike after."""
    counts: dict[str, list[bool]] = {"stock": [], "ours": []}
    for name, cls in (("stock", VllmKVCacheManager), ("ours", KVCacheManager)):
        lookup = cls.get_computed_blocks_for_connector

        def counted(self: Any, *args: Any, _lookup: Any = lookup, _name: str = name) -> Any:
            found = _lookup(self, *args)
            counts[_name].append(found[3])
            return found

        monkeypatch.setattr(cls, "get_computed_blocks_for_connector", counted)
    spec = spec_for("qwen3.5", mode, num_blocks=60, async_scheduling=async_scheduling)
    stock, ours = both(model_dir, disaggregated_script(spec, 24, seed=5))
    assert_same(stock, ours)
    assert counts["ours"] == counts["stock"]
    assert sum(counts["stock"]) >= 10, "hits diverge"
    assert_decode_requests_got_remote_kv(records_of(stock), mode)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
@pytest.mark.parametrize("mode", MODES)
def test_speculative_decoding_with_mamba_prefix_caching(
    model_dir: Path, mode: str, method: str, async_scheduling: bool
) -> None:
    """Draft tokens on the qwen3.5 layout with its Mamba states cached: each request's
    Mamba table also holds the draft states' blocks, and before admitting a load the
    scheduler reserves what every loading request still needs, counting a Mamba group by the
    main model's tokens and the prefill's checkpoint (a small pool, so that reservations
    decide admissions)."""
    spec = spec_for(
        "qwen3.5",
        mode,
        num_blocks=60,
        speculative=Speculation(method, 3),
        async_scheduling=async_scheduling,
    )
    stock, ours = both(model_dir, disaggregated_script(spec, 24, seed=5))
    assert_same(stock, ours)
    records = records_of(stock)
    assert_decode_requests_got_remote_kv(records, mode)
    assert any(record[0][RECV] and record[0][SEND] for record in records)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("layout", ["llama", "qwen3.5"])
@pytest.mark.parametrize("mode", MODES)
def test_failed_loads(
    model_dir: Path, mode: str, layout: str, policy: str, async_scheduling: bool
) -> None:
    """Every third load fails as NIXL's worker reports it (the request in ``failed_recving``;
    with one KV-cache group also its blocks in ``invalid_block_ids``). With vLLM's default
    policy the request ends with an error; with "recompute" its blocks are freed and it is
    computed locally (hitting what is cached). The scheduler's failure handling reads the
    request's blocks (``get_block_ids``) and frees them."""
    spec = spec_for(
        layout,
        mode,
        nixl_failed_loads=3,
        kv_load_failure_policy=policy,
        async_scheduling=async_scheduling,
    )
    script = disaggregated_script(spec, 24, seed=3)
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    reasons = [o[2] for record in stock[:-1] for o in record[1]]
    if policy == "fail":
        assert reasons.count("error") >= 2, "failed loads end their requests"
    else:
        assert "error" not in reasons
        # A loaded decode request computes only its last prompt token; a failed one more.
        first: dict[str, int] = {}
        for record in records_of(stock):
            for rid, tokens in record[0][0]:
                first.setdefault(rid, tokens)
        decode = [f"r{i}" for i in range(1, len(script.requests), 3)]
        assert any(first.get(rid, 0) > 1 for rid in decode), "failed loads computed locally"


@pytest.mark.parametrize("mode", MODES)
def test_small_pool_preempts_identically(model_dir: Path, mode: str) -> None:
    spec = spec_for("llama", mode, num_blocks=28, max_num_batched_tokens=64)
    stock, ours = both(model_dir, disaggregated_script(spec, 30, seed=7))
    assert_same(stock, ours)
    assert any(record[0][PREEMPTED] for record in records_of(stock)), "must preempt"


@pytest.mark.parametrize("mode", MODES)
def test_aborts_and_resets(model_dir: Path, mode: str) -> None:
    """Prefill requests aborted as they arrive (not to be sent), decode requests aborted one
    step after they arrive (while their KV is being transferred: in push mode the scheduler
    holds their blocks until the prefill node's write completes), resets that fail and one
    that finds the engine idle."""
    script = disaggregated_script(spec_for("gpt-oss", mode), 24, seed=5)
    step = [r.step for r in script.requests]
    script.aborts = sorted([(step[0], 0), (step[3], 3), (step[1] + 1, 1), (step[4] + 1, 4)])
    script.resets = [2, 25, 299]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(record[0][OTHER][1] for record in records_of(stock)), "aborted prefills"


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    layout = draw(st.sampled_from(list(LAYOUTS)))
    caching_off = layout.endswith("prefix caching off")
    offloading = 0 if caching_off else draw(st.sampled_from([0, 0, 16, 64]))
    spec = spec_for(
        layout,
        draw(st.sampled_from(MODES)),
        # (a smaller pool can leave a request waiting forever under async scheduling: vLLM's
        # scheduler with NIXL does, on either manager, which the harness cannot compare)
        **draw_sizes(draw, min_blocks=60),
        # with CPU offloading too: vLLM's MultiConnector of NIXL and the OffloadingConnector
        # (which needs prefix caching with Mamba groups: vLLM refuses the layout without it)
        kv_offloading=offloading,
        # NIXL alone: some loads fail, the requests recomputed or failed
        nixl_failed_loads=0 if offloading else draw(st.sampled_from([0, 0, 2, 5])),
        kv_load_failure_policy=draw(st.sampled_from(["fail", "recompute"])),
    )
    return draw_disaggregated_script(draw, spec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)


def two_waves(spec: SchedulerSpec, seed: int) -> Script:
    """:func:`disaggregated_script`, then the same prompts again once the engine is idle and
    its prefix cache reset, so that their blocks come back from the CPU tier."""
    script = disaggregated_script(spec, 18, seed=seed)
    again = [
        RequestSpec(r.prompt, r.max_tokens, r.step + 150, sampling=r.sampling)
        for r in script.requests
    ]
    script.requests += again
    script.resets = [149]
    return script


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["llama", "gpt-oss"])
def test_nixl_with_cpu_offloading(
    model_dir: Path, layout: str, mode: str, async_scheduling: bool
) -> None:
    """vLLM's MultiConnector of NIXL and the OffloadingConnector (disaggregated prefill with
    CPU offloading): NIXL's transfers and the offloading jobs (stores, then loads from the
    CPU tier after a reset) compared step by step, on kvblocks' manager."""
    spec = spec_for(layout, mode, kv_offloading=64, async_scheduling=async_scheduling)
    kvblocks.vllm.install("all")
    make_scheduler(model_dir, spec)
    described = f"MultiConnector of {nixl.CONNECTOR_NAMES[mode]}, OffloadingConnector"
    assert described in str(kvblocks.vllm.status())
    # (seeds whose prompts come back from the CPU tier: with a sliding window, fewer do)
    stock, ours = both(model_dir, two_waves(spec, seed={"llama": 4, "gpt-oss": 6}[layout]))
    assert_same(stock, ours)
    records = records_of(stock)
    assert_decode_requests_got_remote_kv(records, mode)
    assert any(record[0][SEND] for record in records), "finished prefills handed over"
    assert any(record[0][STORES] for record in records), "blocks stored to the CPU tier"
    assert any(record[0][LOADS] for record in records), "blocks loaded from the CPU tier"
    assert any(record[4] for record in stock[:-1]), "the prefix cache was reset"


HAS_KV_LOAD_PARKING = scheduler_config_has("max_num_inflight_kv_loads")


@pytest.mark.skipif(
    not HAS_KV_LOAD_PARKING,
    reason="vLLM 0.33 has no --max-num-inflight-kv-loads (0.34's parked async KV loads; run "
    "on 0.34: docs/porting.md)",
)
@pytest.mark.parametrize("layout", ["llama", "qwen3.5"])
def test_parked_async_kv_loads(model_dir: Path, layout: str, async_scheduling: bool) -> None:
    """vLLM 0.34 caps the async KV loads in flight (``max_num_inflight_kv_loads``): the decode
    requests past it wait in their own queue, their remaining blocks reserved through the
    coordinator's ``get_num_blocks_to_allocate``, and start while the batch is full. The same
    steps with kvblocks' manager."""
    limit = {"max_num_inflight_kv_loads": 1}
    spec = spec_for(layout, scheduler=limit, async_scheduling=async_scheduling, max_num_seqs=4)
    script = disaggregated_script(spec, 24, seed=3)
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert_decode_requests_got_remote_kv(records_of(stock), "pull")
    # Not vacuous: without the cap vLLM schedules otherwise.
    free = dataclasses.replace(script, spec=dataclasses.replace(spec, scheduler={}))
    uncapped, _ = both(model_dir, free)
    assert records_of(uncapped) != records_of(stock)
