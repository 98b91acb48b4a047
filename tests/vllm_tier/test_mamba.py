"""Mamba and linear-attention groups (Qwen3.5 / Qwen3-Next, Jamba, Nemotron-H): vLLM's
scheduler on vLLM's own manager against the same scheduler on kvblocks', step by step, with
prefix caching off (vLLM's ``mamba_cache_mode="none"``) and on (its "align" mode: states at
block boundaries cached, prefill checkpoints, retention, same-step deferral). Every
``SchedulerOutput`` (the blocks to zero included), request output, statistic, KV event and
block table must be identical, and kvblocks' manager must have run (``both`` asserts it).
Where kvblocks does not implement align mode (lookahead hashing of two or more tokens), it
falls back, naming the reason.

Also KV-cache zeroing without Mamba (a mixed-precision cache), with prefix caching on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

import kvblocks.vllm
from kvblocks.vllm import _state
from tests.vllm_driver import SchedulerSpec, Speculation, make_scheduler
from tests.vllm_tier.harness import (
    RequestSpec,
    Script,
    assert_same,
    both,
    draw_aborts_and_resets,
    featured_script,
    group_tables,
    shared_prefix_script,
    soak_script,
)

#: The families' layouts (the Mamba block size is vLLM's default without prefix caching:
#: max_model_len), and a Mamba-only model.
LAYOUTS: dict[str, list[tuple[str, int]]] = {
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
    "jamba": [("full", 0)] + [("mamba", 0)] * 7,
    "gpt-oss + mamba": [("full", 0), ("sliding_window", 16), ("mamba", 0)],
    "mamba only": [("mamba", 0)],
}
MAX_MODEL_LEN = 512
#: Fields of a step's ``SchedulerOutput`` record (``vllm_driver.snapshot``).
PREEMPTED, DRAFTS, ZERO = 5, 6, 7


def spec_for(layout: str, num_blocks: int = 200, **kwargs: Any) -> SchedulerSpec:
    kwargs = {
        "block_size": 4,
        "max_num_batched_tokens": 48,
        "max_model_len": MAX_MODEL_LEN,
        "enable_caching": False,
        **kwargs,
    }
    return SchedulerSpec(layout=LAYOUTS[layout], num_blocks=num_blocks, **kwargs)


def align_spec(
    layout: str, checkpoint: int | None = 4, retention: int | None = 0, **kwargs: Any
) -> SchedulerSpec:
    """Prefix caching on (vLLM's "align" mode, Mamba blocks of the attention block size):
    ``checkpoint`` is the Mamba layers' prefill checkpoint alignment (4, the block size:
    Qwen3.5's gated delta-net; 1: Mamba2; None: Mamba1, no checkpoints), ``retention`` the
    retention interval (vLLM's default 0: only the states a replay or a sibling resumes from;
    None: every state; 8: also one per 8 tokens)."""
    kwargs = {"kv_events": True, **kwargs}
    return spec_for(
        layout,
        enable_caching=True,
        mamba_checkpoint_alignment=checkpoint,
        retention_interval=retention,
        **kwargs,
    )


def hits_of(stock: list[Any]) -> int:
    """The prefix-cache hits (tokens) the run's statistics record."""
    return sum(record[2][1][3] for record in stock[:-1] if record[2] is not None)


def records_of(stock: list[Any]) -> list[Any]:
    """The per-step records (the last entry is the run's block hashes)."""
    return [record for record in stock[:-1] if record[0] is not None]


def blocks_to_zero(stock: list[Any]) -> list[int]:
    return [b for record in records_of(stock) for b in record[0][ZERO] or ()]


def preempted(stock: list[Any]) -> bool:
    return any(record[0][PREEMPTED] for record in records_of(stock))


def test_the_scheduler_gets_mamba_groups_and_zeroing(model_dir: Path) -> None:
    """What the layouts give vLLM: Mamba specs in "none" mode with max_model_len-token
    blocks, zeroing on, the scheduler's block size the groups' LCM, vLLM's no-prefix-cache
    coordinator; and kvblocks' manager really runs them."""
    spec = spec_for("qwen3.5", speculative=Speculation("ngram", 3))
    kvblocks.vllm.install("all")
    scheduler = make_scheduler(model_dir, spec)
    assert type(scheduler.kv_cache_manager).__module__ == "kvblocks.vllm.kv_cache_manager"
    described = "4 groups (full_attention, mamba, mamba, mamba), 4/512/512/512-token blocks"
    assert f"kv_cache_manager on {described}, prefix caching off" in str(kvblocks.vllm.status())
    config = scheduler.kv_cache_config
    mamba = [g.kv_cache_spec for g in config.kv_cache_groups[1:]]
    assert all(type(s) is MambaSpec for s in mamba)
    assert {(s.mamba_cache_mode, s.block_size, s.num_speculative_blocks) for s in mamba} == {
        ("none", MAX_MODEL_LEN, 3)
    }
    assert config.needs_kv_cache_zeroing
    assert scheduler.block_size == MAX_MODEL_LEN  # lcm(4, 512)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_prefixes(model_dir: Path, layout: str, async_scheduling: bool) -> None:
    spec = spec_for(layout, async_scheduling=async_scheduling)
    stock, ours = both(model_dir, shared_prefix_script(spec, 24, seed=3, prefix_lens=(1, 90)))
    assert_same(stock, ours)
    zeroed = blocks_to_zero(stock)
    # Only attention groups' blocks are zeroed; a Mamba-only model has none.
    assert bool(zeroed) == (layout != "mamba only")


@pytest.mark.parametrize(
    ("layout", "num_blocks", "prefix_lens"),
    [("qwen3.5", 60, (10, 60)), ("gpt-oss + mamba", 30, (10, 40))],
)
def test_small_pool_preempts_identically(
    model_dir: Path,
    layout: str,
    num_blocks: int,
    prefix_lens: tuple[int, int],
    async_scheduling: bool,
) -> None:
    spec = spec_for(layout, num_blocks=num_blocks, async_scheduling=async_scheduling)
    script = shared_prefix_script(spec, 24, seed=7, prefix_lens=prefix_lens, suffix_lens=(0, 12))
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert preempted(stock), "must preempt"


@pytest.mark.parametrize("layout", ["qwen3.5", "jamba"])
def test_aborts_salts_lora_and_resets(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, watermark=0.05, kv_events=True)
    stock, ours = both(model_dir, featured_script(spec, prefix_lens=(5, 80)))
    assert_same(stock, ours)


@pytest.mark.parametrize(
    ("method", "drafts", "caching"),
    [
        ("ngram", 3, False),
        ("eagle", 3, False),
        ("mtp", 3, False),
        ("ngram", 3, True),
        ("eagle", 3, True),
        ("mtp", 3, True),
    ],
)
def test_speculative_blocks(
    model_dir: Path, method: str, drafts: int, caching: bool, async_scheduling: bool
) -> None:
    """n-gram, EAGLE and MTP (Qwen3.5's own drafter) drafts: each Mamba group also holds
    blocks for the draft tokens' states (``num_speculative_blocks``). With prefix caching,
    draft-state blocks left behind move to the end of the table, EAGLE drops a hit's last
    block and moves the checkpoints, and MTP with one module run three times (Qwen3.5's)
    hashes one lookahead token."""
    make_spec = align_spec if caching else spec_for
    modules = 1 if method == "mtp" and caching else None
    spec = make_spec(
        "qwen3.5",
        num_blocks=90,
        speculative=Speculation(method, drafts, mtp_modules=modules),
        async_scheduling=async_scheduling,
    )
    script = shared_prefix_script(spec, 20, seed=11, prefix_lens=(4, 50))
    script.aborts = [(5, 2), (12, 9)]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(record[0][DRAFTS] for record in records_of(stock)), "drafts were scheduled"
    assert (hits_of(stock) > 0) == caching


@pytest.mark.parametrize("layout", ["qwen3.5", "gpt-oss + mamba"])
def test_soak(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, num_blocks=120, max_num_batched_tokens=24, max_num_seqs=8)
    script = soak_script(spec, seed=5)
    stock, ours = both(model_dir, script)
    assert len(stock) > 1000
    assert_same(stock, ours)


def test_mixed_precision_zeroing_with_prefix_caching(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV-cache zeroing without Mamba (vLLM turns it on for mixed-precision caches): every
    attention group's fresh blocks, with prefix hits, windows and events."""
    # A mixed-precision cache, from which each release derives needs_kv_cache_zeroing (0.33:
    # a property; 0.34: a field its __post_init__ sets).
    monkeypatch.setattr(KVCacheConfig, "has_mixed_precision_kv_cache", property(lambda self: True))
    spec = SchedulerSpec(
        layout=[("full", 0), ("sliding_window", 16)],
        num_blocks=81,
        block_size=4,
        max_num_batched_tokens=48,
        kv_events=True,
    )
    stock, ours = both(model_dir, shared_prefix_script(spec, 24, seed=2, prefix_lens=(8, 90)))
    assert_same(stock, ours)
    assert blocks_to_zero(stock)
    hits = sum(record[2][1][3] for record in stock[:-1] if record[2] is not None)
    assert hits > 0


def test_align_mode_runs_on_kvblocks(model_dir: Path) -> None:
    """With prefix caching vLLM gives the Mamba groups "align" mode, the attention block
    size and (Qwen3.5's layers) one prefill checkpoint block; kvblocks' manager runs it."""
    kvblocks.vllm.install("all")
    scheduler = make_scheduler(model_dir, align_spec("qwen3.5"))
    assert type(scheduler.kv_cache_manager).__module__ == "kvblocks.vllm.kv_cache_manager"
    described = "4 groups (full_attention, mamba, mamba, mamba), 4-token blocks"
    assert f"kv_cache_manager on {described}, prefix caching on" in str(kvblocks.vllm.status())
    mamba = [g.kv_cache_spec for g in scheduler.kv_cache_config.kv_cache_groups[1:]]
    assert {(s.mamba_cache_mode, s.block_size, s.num_prefill_checkpoint_blocks) for s in mamba} == {
        ("align", 4, 1)
    }
    assert scheduler.need_mamba_block_aligned_split


#: (checkpoint alignment, retention interval) pairs the align-mode tests run.
ALIGN_VARIANTS = [(4, 0), (None, 0), (1, None), (4, 8)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("checkpoint", "retention"), ALIGN_VARIANTS)
def test_align_shared_prefixes(
    model_dir: Path,
    layout: str,
    checkpoint: int | None,
    retention: int | None,
    async_scheduling: bool,
) -> None:
    spec = align_spec(layout, checkpoint, retention, async_scheduling=async_scheduling)
    stock, ours = both(model_dir, shared_prefix_script(spec, 24, seed=3, prefix_lens=(1, 90)))
    assert_same(stock, ours)
    assert hits_of(stock) > 0


@pytest.mark.parametrize("retention", [0, 16, None])
@pytest.mark.parametrize(
    ("drop", "draft_groups"),
    [(False, None), (True, None), (True, [])],
    ids=["lookahead-hashes", "block-drop", "block-drop-every-group"],
)
def test_align_eagle_checkpoints_are_keyed_by_their_position(
    model_dir: Path, retention: int | None, drop: bool, draft_groups: list[int] | None
) -> None:
    """EAGLE either hashes one lookahead token or (lookahead block hashes off) drops a hit's
    last block: in the draft's group, or, where no group is flagged as the draft's, in every
    group, the Mamba groups too. With the drop a prompt's checkpoint is one block before the
    last full one, and the chunk writes it into the column after that state's own: the
    manager keys the block by the checkpoint's position (replacing the key its column would
    give it), or drops a key no hit may use. Prompts of every length modulo the block size,
    each sent three times, and siblings branching off them."""
    speculation = Speculation(
        "eagle", 3, disable_lookahead_block_hashes=drop, draft_groups=draft_groups
    )
    spec = align_spec("qwen3.5", retention=retention, speculative=speculation)
    base = [list(range(100 + 97 * i, 100 + 97 * i + n)) for i, n in enumerate((37, 50, 61, 44))]
    requests = [
        RequestSpec(prompt, 4, step)
        for step in (0, 20, 40)
        for prompt in (*base, *([*p[: len(p) - 6], 7, 8] for p in base))
    ]
    stock, ours = both(model_dir, Script(spec, requests))
    assert_same(stock, ours)
    assert hits_of(stock) > 0


@pytest.mark.parametrize(
    ("layout", "num_blocks"), [("qwen3.5", 60), ("gpt-oss + mamba", 60), ("mamba only", 12)]
)
def test_align_small_pool_preempts_identically(
    model_dir: Path, layout: str, num_blocks: int
) -> None:
    spec = align_spec(layout, num_blocks=num_blocks)
    script = shared_prefix_script(spec, 24, seed=7, prefix_lens=(10, 60), suffix_lens=(0, 12))
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert preempted(stock), "must preempt"


@pytest.mark.parametrize("layout", ["qwen3.5", "mamba only"])
def test_align_aborts_salts_lora_and_resets(model_dir: Path, layout: str) -> None:
    spec = align_spec(layout, watermark=0.05)
    stock, ours = both(model_dir, featured_script(spec, prefix_lens=(5, 80)))
    assert_same(stock, ours)


def test_align_defers_a_hit_cached_in_the_same_step(model_dir: Path) -> None:
    """A request whose Mamba hit is a state another request cached during this very step
    waits for the next step (vLLM's manager answers that it needs more blocks than exist, and
    the scheduler stops admitting): r0's first chunk (36 of its 40 tokens: the split stops at
    the prompt's last reusable state) caches the state after 36 tokens, and r1, with the same
    prompt, is looked up right after it in the same step."""
    spec = align_spec("qwen3.5", checkpoint=None)
    prompt = list(range(100, 140))
    script = Script(spec, [RequestSpec(prompt, 3, 0), RequestSpec(prompt, 3, 0)])
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    scheduled = [dict(record[0][0]) for record in records_of(stock)]
    assert scheduled[0] == {"r0": 36}, "r1 waits although the token budget has room"
    new = {r[0]: r for record in records_of(stock) for r in record[0][1]}
    assert "r1" in scheduled[1], "then r1 is admitted"
    assert new["r1"][2] == 36, "and hits what r0 cached"


@pytest.mark.parametrize("layout", ["qwen3.5", "jamba"])
def test_align_soak(model_dir: Path, layout: str) -> None:
    spec = align_spec(layout, num_blocks=120, max_num_batched_tokens=24, max_num_seqs=8)
    stock, ours = both(model_dir, soak_script(spec, seed=5))
    assert len(stock) > 1000
    assert_same(stock, ours)
    assert hits_of(stock) > 0


def test_multi_token_lookahead_hashing_falls_back(model_dir: Path) -> None:
    """Lookahead hashing of two or more tokens (multi-module MTP) with Mamba prefix caching
    is not implemented: vLLM's own manager runs, and status() names the reason."""
    kvblocks.vllm.install("all")
    spec = align_spec("qwen3.5", speculative=Speculation("mtp", 3))
    scheduler = make_scheduler(model_dir, spec)
    assert scheduler.vllm_config.num_hash_lookahead_tokens >= 2
    assert type(scheduler.kv_cache_manager) is VllmKVCacheManager
    assert _state.fallbacks == {("kv_cache_manager", "mamba_prefix_caching"): 1}
    assert "lookahead hashing of two or more tokens" in str(kvblocks.vllm.status())


#: The speculative decoding the random scripts draw: none, n-gram, EAGLE with lookahead hashes,
#: EAGLE with the block drop (in the draft group, or in every group) and one-module MTP.
SPECULATIONS = [
    None,
    Speculation("ngram", 3),
    Speculation("eagle", 3),
    Speculation("eagle", 3, disable_lookahead_block_hashes=True),
    Speculation("eagle", 3, disable_lookahead_block_hashes=True, draft_groups=[]),
    Speculation("mtp", 3, mtp_modules=1),
]


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Random requests, aborts and resets on a random Mamba layout, prefix caching off or on
    (with a random checkpoint alignment and retention interval). Prompts share prefixes of
    two random token runs (some are resent whole), so that states are hit."""
    layout = draw(st.sampled_from(list(LAYOUTS)))
    caching = draw(st.booleans())
    n = draw(st.integers(1, 10))
    bases = draw(
        st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=80), min_size=2, max_size=2)
    )
    requests = []
    for _ in range(n):
        base = draw(st.sampled_from(bases))
        prompt = base[: draw(st.integers(1, len(base)))]
        prompt += draw(st.lists(st.integers(0, 999), max_size=12))
        requests.append(
            RequestSpec(prompt, max_tokens=draw(st.integers(1, 24)), step=draw(st.integers(0, 12)))
        )
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    attention_blocks = -(-longest // 4) + 2
    groups = len(LAYOUTS[layout])
    speculation = draw(st.sampled_from(SPECULATIONS))
    spec = spec_for(
        layout,
        # room for the longest request: its attention blocks and each Mamba group's states
        num_blocks=draw(st.integers(attention_blocks, attention_blocks + 30)) + 6 * groups,
        max_num_seqs=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64])),
        async_scheduling=draw(st.booleans()),
        kv_events=draw(st.booleans()),
        speculative=speculation,
        enable_caching=caching,
        mamba_checkpoint_alignment=draw(st.sampled_from([None, 1, 4])) if caching else None,
        retention_interval=draw(st.sampled_from([None, 0, 8, 16])) if caching else 0,
    )
    aborts, resets = draw_aborts_and_resets(draw, n)
    return Script(spec, requests, aborts, resets)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)


@pytest.mark.parametrize("caching", [False, True])
def test_req_to_blocks_reads_as_vllms(model_dir: Path, caching: bool) -> None:
    """Each group manager's ``req_to_blocks`` reads the same on both managers at every step,
    Mamba groups included (with prefix caching: their tables indexed by position, null
    blocks before the running state)."""
    spec = align_spec("qwen3.5") if caching else spec_for("qwen3.5")
    script = shared_prefix_script(spec, 16, seed=5, prefix_lens=(8, 60))
    script.aborts = [(4, 1)]
    script.actions = {step: [group_tables] for step in range(60)}
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    tables = [table for record in stock[:-1] for result in record[5] for table in result]
    mamba = [b for rows in tables[1::4] for _, held in rows for b in held]
    assert mamba, "Mamba groups' blocks"
    assert any(is_null for _, is_null, _ in mamba) == caching
