"""A seeded, time-boxed differential over the cross product where the Qwen3.5 n-gram case
hid (docs/vllm.md, "The null block in a Mamba table"): Mamba groups (prefix caching in
vLLM's ``align`` mode with and without prefill checkpoints, or ``none``), full attention at
every group position, speculative decoding (n-gram with k = 1..4 and draft accuracies down
to 10% so that most drafts are rejected, EAGLE with lookahead hashing or the block drop,
MTP, suffix), block sizes 1, 2 and 4, small pools that preempt, vLLM's CPU offloading, and
synchronous or asynchronous scheduling. Each scenario runs on stock vLLM's manager and on
kvblocks' (active: nothing fell back) and the two must agree step by step; where stock vLLM
raises one of the errors docs/vllm.md lists (its pool running dry after its own admission
count, its prefill-checkpoint assertion), the steps before must agree and kvblocks must not
raise there.

``KVBLOCKS_CAMPAIGN_SECONDS`` (default 60) bounds the run and ``KVBLOCKS_CAMPAIGN_SEED``
(default 40) picks the scenarios; the test prints how many scenarios and steps it ran and
each dimension's values it covered. A long campaign: ``KVBLOCKS_CAMPAIGN_SECONDS=3600
KVBLOCKS_CAMPAIGN_SEED=$RANDOM pytest tests/vllm_tier/test_mamba_speculative_campaign.py
-s`` (and with vLLM 0.34 first on ``PYTHONPATH``, as ``.ci/run`` runs the tier)."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import kvblocks.vllm
from kvblocks.vllm import _state
from tests.vllm_driver import SchedulerSpec, Speculation
from tests.vllm_tier import simulation
from tests.vllm_tier.harness import RequestSpec, Script, on_each_manager, play

#: The errors stock vLLM raises out of ``schedule()`` where kvblocks goes on (docs/vllm.md,
#: "Where kvblocks differs"): (exception type, start of its message, where it is raised).
STOCK_RAISES = {
    # its pool runs dry after its own admission count
    ("ValueError", "Cannot get ", "block_pool.py:get_new_blocks"),
    # a prefill checkpoint armed in a decode step with drafts, keyed past the hashes
    ("AssertionError", "", "block_pool.py:_get_partial_block_hash"),
}
#: The reasons a scenario of this product may be refused (then it is counted, not run):
#: align mode with lookahead hashing of two or more tokens, and a vLLM rejection.
REFUSALS = {"mamba_prefix_caching", "vllm_rejects"}

MAMBA_MODES = ("align, checkpoints", "align", "none")
SPECULATIONS: dict[str, Speculation] = {
    **{f"ngram k={k}": Speculation("ngram", k) for k in (1, 2, 3, 4)},
    "eagle, lookahead hashes": Speculation("eagle", 2),
    "eagle, block drop": Speculation("eagle", 2, disable_lookahead_block_hashes=True),
    "mtp": Speculation("mtp", 2, mtp_modules=1),
    "suffix": Speculation("suffix", 3),
}
BLOCK_SIZES = (1, 2, 4)
NUM_MAMBA = 3


def scenario(rng: random.Random) -> tuple[dict[str, Any], Script]:
    """One scenario of the product, drawn from ``rng``: what it chose and its script."""
    choice: dict[str, Any] = {
        "mamba": rng.choice(MAMBA_MODES),
        "full_at": rng.randrange(NUM_MAMBA + 1),
        "speculation": rng.choice(list(SPECULATIONS)),
        "block_size": rng.choice(BLOCK_SIZES),
        "preemption": rng.random() < 0.5,
        "offloading": rng.random() < 0.3,
        "async": rng.random() < 0.5,
        "accuracy": rng.choice((0.1, 0.25, 0.5, 0.9)),
    }
    if choice["speculation"] == "suffix":
        choice["async"] = False  # vLLM runs suffix decoding only with async scheduling off
    if choice["mamba"] == "none" or choice["speculation"].startswith(("eagle", "mtp")):
        # vLLM offloads a hybrid model only with prefix caching; the driver's fake offloading
        # worker has no draft-model layers.
        choice["offloading"] = False
    b = choice["block_size"]
    n = rng.randrange(1, 7)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(2)]
    requests = []
    for _ in range(n):
        prompt = rng.choice(prefixes)[:] + [rng.randrange(1000) for _ in range(rng.randrange(12))]
        requests.append(RequestSpec(prompt, rng.randrange(1, 24), rng.randrange(8)))
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    # Room for the longest request (its attention blocks, each Mamba group's states and
    # draft blocks); a small pool preempts others around it.
    need = -(-longest // b) + 4 + (NUM_MAMBA + 1) * 8
    extra = rng.randrange(0, 10) if choice["preemption"] else 200
    layout: list[tuple[str, int]] = [("mamba", 0)] * NUM_MAMBA
    layout.insert(choice["full_at"], ("full", 0))
    caching = choice["mamba"] != "none"
    spec = SchedulerSpec(
        block_size=b,
        num_blocks=need + extra,
        layout=layout,
        hash_algo=rng.choice(["sha256", "sha256_cbor"]),
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([16, 64]),
        max_model_len=256,
        enable_caching=caching,
        kv_events=rng.random() < 0.5,
        async_scheduling=choice["async"],
        speculative=SPECULATIONS[choice["speculation"]],
        mamba_checkpoint_alignment=b if choice["mamba"] == "align, checkpoints" else None,
        retention_interval=rng.choice([None, 0]) if caching else 0,
        kv_offloading=rng.choice([4, 16]) if choice["offloading"] else 0,
    )
    script = Script(
        spec, requests, draft_seed=rng.randrange(1000), draft_accuracy=choice["accuracy"]
    )
    if rng.random() < 0.3:
        script.aborts = [(rng.randrange(20), rng.randrange(n))]
    return choice, script


def run_scenario(model_dir: Path, script: Script) -> tuple[str, int]:
    """("same" | "stock raised" | "refused: ..." , steps compared); asserts agreement."""
    sites: list[str | None] = []

    def playing(scheduler: Any, hasher: Any) -> list[Any]:
        simulation.last_raise = None
        records = play(script, scheduler, hasher, catch=True)
        sites.append(simulation.last_raise)
        return records

    try:
        stock, ours = on_each_manager(model_dir, script.spec, playing)
    except AssertionError:
        if _state.fallbacks:  # the harness saw the manager fall back: refused
            (reason,) = {reason for _, reason in _state.fallbacks}
            assert reason in REFUSALS, f"fell back: {dict(_state.fallbacks)}"
            return f"refused: {reason}", 0
        raise
    assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
    raised = next((i for i, record in enumerate(stock) if record[0] == "raised"), None)
    if raised is None:
        assert len(ours) == len(stock)
        for step, (a, b) in enumerate(zip(stock, ours, strict=True)):
            assert b == a, f"step {step} differs"
        return "same", len(stock) - 1
    _, kind, message = stock[raised]
    site = sites[0]
    assert any(
        (kind, site) == (k, where) and message.startswith(m) for k, m, where in STOCK_RAISES
    ), (*stock[raised], site)
    assert ours[:raised] == stock[:raised]
    assert ours[raised][0] != "raised", ours[raised]
    return "stock raised", raised


#: Scenarios the long campaign found, as (seed, index of the scenario drawn): each runs on
#: every release the tier runs. (11275, 7293): vLLM 0.34 passed ``allocate_slots`` a
#: negative ``reserved_blocks`` (the blocks its parked async loads still need, a sum of
#: counts that may be negative), which kvblocks refused with an OverflowError out of
#: ``schedule()`` (CPU offloading, n-gram k=4, preemption).
FOUND = [(11275, 7293)]


@pytest.mark.parametrize(("seed", "index"), FOUND)
def test_found_scenario(model_dir: Path, seed: int, index: int) -> None:
    rng = random.Random(seed)
    for _ in range(index + 1):
        choice, script = scenario(rng)
    outcome, steps = run_scenario(model_dir, script)
    assert outcome in ("same", "stock raised"), (outcome, choice)
    assert steps > 0


def test_mamba_speculative_cross_product(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seconds = float(os.environ.get("KVBLOCKS_CAMPAIGN_SECONDS", "60"))
    seed = int(os.environ.get("KVBLOCKS_CAMPAIGN_SEED", "40"))
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    outcomes: Counter[str] = Counter()
    covered: dict[str, Counter[Any]] = {}
    steps = 0
    defects_before = kvblocks.vllm.status().vllm_defects.get("mamba_null_state", 0)
    while time.monotonic() < deadline:
        choice, script = scenario(rng)
        try:
            outcome, compared = run_scenario(model_dir, script)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}, scenario {sum(outcomes.values())}: {choice}") from (
                error
            )
        outcomes[outcome.split(":")[0]] += 1
        if not outcome.startswith("refused"):
            steps += compared
            for key, value in choice.items():
                covered.setdefault(key, Counter())[value] += 1
    ran = outcomes["same"] + outcomes["stock raised"]
    defects = kvblocks.vllm.status().vllm_defects.get("mamba_null_state", 0) - defects_before
    with capsys.disabled():
        print(
            f"\nMamba x speculative decoding, seed {seed}, {seconds:.0f} s: {ran} scenarios "
            f"({outcomes['stock raised']} where stock vLLM raised as documented), {steps} "
            f"steps compared, {outcomes['refused']} refused by the allowlist; vLLM's null "
            f"Mamba states kept: {defects}"
        )
        for key, values in covered.items():
            print(f"  {key}: {dict(sorted(values.items(), key=str))}")
    assert ran > 0
    # Every value of the modes, positions, methods and block sizes ran (the default time box
    # runs enough scenarios for that).
    for key, values in (
        ("mamba", MAMBA_MODES),
        ("full_at", range(NUM_MAMBA + 1)),
        ("block_size", BLOCK_SIZES),
    ):
        assert set(covered.get(key, ())) == set(values), (key, covered.get(key))
