"""Scenarios found by a differential fuzz run of vLLM 0.33's scheduler (``data/*.json``: the
configuration, the layout, the requests with their token ids, and where the two sides parted).
Two where stock vLLM raises inside ``allocate_slots`` and kvblocks' manager goes on, and one
where kvblocks raised and stock vLLM went on (vLLM's Mamba table holds the null block where
the worker writes a state). Replayed here on the driver's scheduler, on each vLLM release the
tier runs on (``.ci/run``: 0.33 and 0.34), with kvblocks' manager active and nothing fallen
back; every allocation passes kvblocks' invariant (the tier's fixtures check that none
failed). docs/vllm.md, "Where kvblocks differs", explains all three."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvblocks.vllm
from kvblocks.vllm import _state
from tests.vllm_driver import SchedulerSpec
from tests.vllm_driver.speculative import Speculation
from tests.vllm_tier.harness import RequestSpec, Script, assert_same, on_each_manager, play

DATA = Path(__file__).parent / "data"


def scenario(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return document


def spec_of(found: dict[str, Any], **kwargs: Any) -> SchedulerSpec:
    """The scheduler of a file's scenario: its sizes and budgets, ``kwargs`` the rest."""
    config = found["scenario"]["config"]
    return SchedulerSpec(
        block_size=config["block_size"],
        hash_algo=config["hash_algo"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_model_len=config["max_model_len"],
        scheduler={
            "long_prefill_token_threshold": config["long_prefill_token_threshold"],
            "scheduler_reserve_full_isl": config["reserve_full_isl"],
        },
        **kwargs,
    )


def requests_of(found: dict[str, Any]) -> list[RequestSpec]:
    return [
        RequestSpec(
            r["prompt"],
            r["max_tokens"],
            r["arrive"],
            lora=r["lora"][1] if r["lora"] else None,
        )
        for r in found["scenario"]["requests"]
    ]


def replay(model_dir: Path, script: Script) -> tuple[list[Any], list[Any]]:
    """(stock's records, kvblocks'), each run ending at an exception if one is raised."""
    stock, ours = on_each_manager(
        model_dir,
        script.spec,
        lambda scheduler, hasher: play(script, scheduler, hasher, catch=True),
    )
    assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
    return stock, ours


def scheduled(record: Any) -> dict[str, int]:
    """A step's scheduled tokens per request (``simulation.run``'s record: the step's
    ``snapshot`` first)."""
    return dict(record[0][0]) if record[0] is not None else {}


def computed_when_scheduled(record: Any, request_id: str) -> int:
    """The computed tokens a request was scheduled with in a step's record."""
    new = [computed for rid, _, computed in record[0][1] if rid == request_id]
    cached = [computed for rid, _, computed, _ in record[0][2] if rid == request_id]
    (computed,) = new + cached
    return computed


def finished(records: list[Any]) -> list[str]:
    return [r for record in records[:-1] if record[0] is not None for r in record[0][4]]


def test_jamba_offload_preempt(model_dir: Path) -> None:
    """Three Mamba groups and one full-attention group, CPU offloading with synchronous
    loads, a 22-block pool. At step 2 the preempted request r3 comes back with 16 tokens
    found in the CPU tier and 2 to compute. vLLM counts each Mamba group one block (its cap of
    one column per chunk) where it takes two (the loaded state's column and the running
    state's), admits r3 with 7 free blocks for the 8 it takes, and its pool runs dry in the
    full-attention group, filled last. kvblocks counts 8 and leaves r3 waiting; before its
    fix it admitted r3 and its full-attention group held 1 block for 18 tokens."""
    found = scenario("jamba-offload-preempt")
    config = found["scenario"]["config"]
    offload = found["scenario"]["layout"]["offload"]
    requests = requests_of(found)
    # The driver's fake offloading worker finishes a store one step later than the fuzz
    # harness's, so r3 comes back one step later, when r1 and r2 would have finished: they
    # decode a little longer here, and the pool is 3 blocks smaller, so that r3 comes back to
    # 7 free blocks as in the file.
    requests[0].max_tokens, requests[1].max_tokens = 3, 4
    spec = spec_of(
        found,
        num_blocks=config["num_blocks"] - 3,
        layout=[("mamba", 0)] * 3 + [("full", 0)],
        kv_offloading=offload["chunks"],
        kv_offloading_config={"sync_load_budget_bytes": offload["sync_load_budget"]},
    )
    stock, ours = replay(model_dir, Script(spec, requests))
    crash = found["divergence"]["step"] + 1  # one step later here (see above)
    assert stock[crash] == ("raised", "ValueError", "Cannot get 1 free blocks from the pool")
    assert len(stock) == crash + 1
    assert ours[:crash] == stock[:crash]
    # The file's r3 is the driver's third request, "r2": preempted at step 1.
    assert stock[1][0][5] == ["r2"]  # preempted
    # kvblocks' decision: r3 waits at that step (its 8 blocks are not free), and comes
    # back once the others have finished, with its 16 tokens from the CPU tier.
    assert "r2" not in scheduled(ours[crash])
    assert all(record[0] != "raised" for record in ours)
    back = next(record for record in ours[crash + 1 :] if "r2" in scheduled(record))
    assert computed_when_scheduled(back, "r2") == 16


def test_qwen35_checkpoints_ngram(model_dir: Path) -> None:
    """Three gated delta-net (Mamba) groups with prefill checkpoints on the 2-token block
    grid, one full-attention group, n-gram drafts (all accepted), one request of one prompt
    token. In a decode step with two drafts vLLM's Mamba manager arms a *prefill* checkpoint
    at a position counted with the drafts, past the request's block hashes, and its block
    pool's assertion fails while keying it (``0 < num_hash_blocks <= len(block_hashes)``).
    kvblocks arms and reserves the same checkpoint block (the same counts), keys nothing
    there (no hash exists for that position), and goes on; every allocation passes its
    invariant."""
    found = scenario("qwen35-checkpoints-ngram")
    config = found["scenario"]["config"]
    speculative = found["scenario"]["layout"]["spec"]
    spec = SchedulerSpec(
        block_size=config["block_size"],
        num_blocks=config["num_blocks"],
        layout=[("mamba", 0)] * 3 + [("full", 0)],
        hash_algo=config["hash_algo"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_model_len=config["max_model_len"],
        mamba_checkpoint_alignment=config["block_size"],  # "grid"
        # The file's KVCacheConfig keeps every checkpoint (vLLM's dataclass default, None);
        # vLLM's command-line default, 0, drops transient checkpoints before keying them.
        retention_interval=None,
        speculative=Speculation(speculative["method"], speculative["k"]),
    )
    # The driver's n-gram drafter with seed 3 proposes what the file's did where it matters:
    # no draft at step 1, two at step 2.
    script = Script(spec, requests_of(found), draft_accuracy=1.0, draft_seed=3)
    stock, ours = replay(model_dir, script)
    crash = found["divergence"]["step"]
    assert stock[crash] == ("raised", "AssertionError", "")
    assert ours[:crash] == stock[:crash]
    assert scheduled(ours[crash - 1]) == {"r0": 1}
    assert scheduled(ours[crash]) == {"r0": 3}  # the sampled token and two drafts
    assert all(record[0] != "raised" for record in ours)
    # The request finished (3 tokens, every draft accepted).
    assert finished(ours) == ["r0"]


def mamba_null_states(scheduler: Any, out: Any) -> int:
    """How many running or draft state columns of the Mamba groups the worker writes in this
    step hold the null block, from the scheduler's own tables: per scheduled request, columns
    ``cdiv(n, B) - 1`` to ``cdiv(n, B) - 1 + K`` once ``n`` tokens are computed and scheduled
    (vLLM's ``preprocess_mamba``: the running state, then the ``K`` draft states)."""
    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    count = 0
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        spec = manager.kv_cache_spec
        if type(spec).__name__ != "MambaSpec":
            continue
        for request_id, scheduled in out.num_scheduled_tokens.items():
            n = computed[request_id] + scheduled
            running = -(-n // spec.block_size) - 1
            blocks = manager.req_to_blocks[request_id]
            live = blocks[running : running + 1 + spec.num_speculative_blocks]
            count += sum(block.is_null for block in live)
    return count


def test_qwen35_ngram_null_block(model_dir: Path) -> None:
    """Three gated delta-net groups in align mode with full attention second, n-gram drafts
    (k = 2) on 2-token blocks, one request (the file's; the driver's drafter with seed 3 and
    a quarter of its guesses right gives the pattern the file's found). A step schedules
    three tokens (one sampled, two drafts) that take the running column two columns on, so
    vLLM's allocation moves the draft block left behind to the end of the table and nulls its
    column; both drafts are rejected, and the next step's single token puts the running
    column back onto that null column. vLLM's table is long enough, so its allocation keeps
    it: the worker writes the request's state into the null block. kvblocks' tables are
    vLLM's, step by step; its invariant used to call that table unsound and raise out of
    ``schedule()``, ending an engine that stock vLLM kept serving. Now it counts each such
    column as vLLM's own (``status().vllm_defects``) and goes on, identical to stock."""
    found = scenario("qwen35-ngram-null-block")
    config = found["scenario"]["config"]
    kinds = {"mamba": ("mamba", 0), "full": ("full", 0)}
    spec = spec_of(
        found,
        num_blocks=config["num_blocks"],
        layout=[kinds[g["kind"]] for g in found["scenario"]["layout"]["groups"]],
        speculative=Speculation("ngram", found["scenario"]["layout"]["spec"]["k"]),
    )
    assert spec.layout[1] == ("full", 0)  # full attention second, as in the file
    script = Script(spec, requests_of(found), draft_accuracy=0.25, draft_seed=3)
    null_states = []

    def playing(scheduler: Any, hasher: Any) -> list[Any]:
        schedule, seen = scheduler.schedule, []

        def recorded() -> Any:
            out = schedule()
            seen.append(mamba_null_states(scheduler, out))
            return out

        scheduler.schedule = recorded
        records = play(script, scheduler, hasher)  # no catch: an exception fails the test
        null_states.append(seen)
        return records

    before = kvblocks.vllm.status().vllm_defects.get("mamba_null_state", 0)
    stock, ours = on_each_manager(model_dir, spec, playing)
    assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
    assert_same(stock, ours)
    stock_nulls, our_nulls = null_states
    assert stock_nulls == our_nulls
    # vLLM's own tables hold the null block where the worker writes a state, three groups at
    # a time; kvblocks counted every one of them.
    assert sum(stock_nulls) >= 3
    assert sum(stock_nulls) % 3 == 0
    counted = kvblocks.vllm.status().vllm_defects.get("mamba_null_state", 0) - before
    assert counted == sum(stock_nulls)
    assert finished(ours) == ["r0"]
