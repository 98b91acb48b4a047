"""Hypothesis drives the Rust manager and the pure-Python reference with the same random operations
on a small pool (so that eviction, allocation failure and copy-on-write happen often), compares
every result after every step, and checks the pool's invariants."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvblocks
import kvblocks.reference as ref

IDS = st.sampled_from([f"r{i}" for i in range(4)])
# A few shared prefixes, so that prefix hits and duplicate keys are common.
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
TOKENS = st.lists(st.integers(0, 6), min_size=0, max_size=10)


def outcome(call: Any) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except (KeyError, ValueError, TypeError) as e:
        return (type(e).__name__, None)


class ManagerPair(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        num_blocks=st.integers(2, 16),
        block_size=st.sampled_from([1, 2, 4]),
        enable_caching=st.booleans(),
        verify_tokens=st.booleans(),
        debug_key_bytes=st.sampled_from([None, None, 1]),
        watermark=st.sampled_from([0.0, 0.0, 0.25]),
        algo=st.sampled_from(["sha256_cbor", "xxh3_128", "sha256"]),
    )
    def setup(self, **kwargs: Any) -> None:
        event(f"{kwargs['num_blocks']} blocks")
        num_blocks, block_size = kwargs.pop("num_blocks"), kwargs.pop("block_size")
        common = {
            "enable_caching": kwargs["enable_caching"],
            "verify_tokens": kwargs["verify_tokens"],
            "_debug_key_bytes": kwargs["debug_key_bytes"],
            "watermark": kwargs["watermark"],
            "hash_algo": kwargs["algo"],
            "hash_seed": "stateful",
            "enable_events": True,
            "max_model_len": 64,
        }
        self.rust = kvblocks.BlockManager(num_blocks, block_size, **common)
        self.reference = ref.BlockManager(num_blocks, block_size, **common)
        self.num_blocks = num_blocks

    def both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        a = outcome(lambda: getattr(self.rust, method)(*args, **kwargs))
        b = outcome(lambda: getattr(self.reference, method)(*args, **kwargs))
        assert a == b, (method, args, kwargs, a, b)
        return a[1]

    @rule(
        target=requests,
        rid=IDS,
        prefix=st.sampled_from(PREFIXES),
        tail=TOKENS,
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(self, rid: str, prefix: list[int], tail: list[int], salt: str | None) -> str:
        self.both("add_request", rid, prefix + tail, cache_salt=salt)
        return rid

    @rule(
        target=requests,
        rid=IDS,
        prefix=st.sampled_from(PREFIXES[1:]),
        tail=TOKENS,
        salt=st.sampled_from([None, None, "s"]),
    )
    def admit(self, rid: str, prefix: list[int], tail: list[int], salt: str | None) -> str:
        """What a scheduler does for a new request: add it, look up its prefix, allocate."""
        self.add(rid, prefix, tail, salt)
        self.schedule(rid, use_hits=True, chunk=64, lookahead=0)
        return rid

    @rule()
    def evictions(self) -> None:
        events = self.both("take_events")
        if any(isinstance(e, kvblocks.BlockRemoved) for e in events):
            event("eviction")

    @rule(rid=requests, tokens=TOKENS)
    def append(self, rid: str, tokens: list[int]) -> None:
        self.both("append_token_ids", rid, tokens)

    @rule(
        rid=requests,
        use_hits=st.booleans(),
        chunk=st.integers(1, 12),
        lookahead=st.sampled_from([0, 0, 0, 3]),
    )
    def schedule(self, rid: str, use_hits: bool, chunk: int, lookahead: int) -> None:
        """Admission (with the lookup) or the next chunk / decode step of a running request."""
        if rid not in self.rust:
            self.both("allocate_slots", rid, 1)
            return
        hits, num_hit = self.both("get_computed_blocks", rid)
        computed = self.both("num_computed_tokens", rid)
        if not use_hits or computed:
            hits, num_hit = [], 0
        todo = self.both("num_tokens", rid) - computed - num_hit
        result = self.both(
            "allocate_slots",
            rid,
            min(chunk, todo),
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_lookahead_tokens=lookahead,
        )
        event("allocation refused" if result is None and todo > 0 else "allocation made")
        if num_hit:
            event("prefix hit used")

    @rule(rid=requests, token=st.integers(0, 6))
    def decode(self, rid: str, token: int) -> None:
        self.both("append_token_ids", rid, token)
        self.both("allocate_slots", rid, 1)

    @rule(rid=requests)
    def free(self, rid: str) -> None:
        self.both("free", rid)

    @rule(rid=IDS)
    def remove(self, rid: str) -> None:
        self.both("remove_request", rid)

    @rule(target=requests, parent=requests, child=IDS)
    def fork(self, parent: str, child: str) -> str:
        self.both("fork", parent, child)
        return child

    @rule(
        rids=st.lists(IDS, min_size=1, max_size=4, unique=True),
        data=st.data(),
    )
    def batched_step(self, rids: list[str], data: st.DataObject) -> None:
        """One schedule_step over several requests (the reference defines it as the per-request
        calls, so equal results prove the native batch does exactly those calls)."""
        live = [r for r in rids if r in self.rust]
        if not live:
            return
        handles = [self.rust.handle(r) for r in live]
        tokens = [data.draw(st.lists(st.integers(0, 6), max_size=2)) for _ in live]
        offsets = [0]
        for t in tokens:
            offsets.append(offsets[-1] + len(t))
        new, hits = [], []
        for rid, t in zip(live, tokens, strict=True):
            computed = self.rust.num_computed_tokens(rid)
            hit = 0
            if computed == 0 and data.draw(st.booleans()):
                hit = self.rust.get_computed_blocks(rid)[1]
            todo = self.rust.num_tokens(rid) + len(t) - computed - hit
            new.append(min(data.draw(st.integers(1, 12)), todo))
            hits.append(hit)
        kwargs = {
            "num_new_computed_tokens": hits,
            "new_token_ids": [x for t in tokens for x in t],
            "new_token_offsets": offsets,
            "num_lookahead_tokens": data.draw(st.sampled_from([0, 0, 2])),
        }

        def run(m: Any) -> Any:
            step = m.schedule_step(handles, new, **kwargs)
            return (
                step.num_scheduled,
                step.num_scheduled_tokens,
                step.block_table.tolist(),
                step.slot_mapping.tolist(),
                step.seq_lens.tolist(),
                step.query_start_loc.tolist(),
                step.block_copies.tolist(),
                step.evicted_block_ids.tolist(),
            )

        a, b = outcome(lambda: run(self.rust)), outcome(lambda: run(self.reference))
        assert a == b, (a, b)
        if a[0] == "ok" and a[1][0] < len(live):
            event("batched step stopped early")
        elif a[0] == "ok":
            event("batched step scheduled all")

    @rule()
    def reset(self) -> None:
        self.both("reset_prefix_cache")

    @rule(target=requests, parent=requests, child=IDS, token=st.integers(0, 6))
    def fork_and_decode(self, parent: str, child: str, token: int) -> str:
        """Parallel sampling: the child's first token lands in the shared last block."""
        self.fork(parent, child)
        self.decode(child, token)
        return child

    @rule()
    def drain(self) -> None:
        self.evictions()
        self.both("make_prefix_cache_stats")
        a, b = self.rust.take_block_copies(), self.reference.take_block_copies()
        assert a.tolist() == b.tolist()
        if len(a):
            event("copy-on-write copies")

    @invariant()
    @precondition(lambda self: hasattr(self, "rust"))
    def same_state_and_invariants(self) -> None:
        state = self.rust.debug_state()
        assert state == self.reference.debug_state()
        assert self.rust.num_free_blocks == self.reference.num_free_blocks
        assert self.rust.usage == self.reference.usage
        refs, free = state["ref_counts"], state["free_block_ids"]
        held = Counter(b for table in state["block_tables"].values() for b in table)
        for block in range(1, self.num_blocks):
            assert refs[block] == held[block], (block, refs[block], held[block])
        assert len(free) == len(set(free))
        assert all(refs[b] == 0 for b in free)
        assert set(free) | {b for b in range(1, self.num_blocks) if refs[b] > 0} == set(
            range(1, self.num_blocks)
        )
        assert 0 not in free
        assert refs[0] == 0 if self.num_blocks else True
        for key, blocks in state["cached"].items():
            assert blocks
            assert all(state["block_keys"][b] == key for b in blocks)
        keyed = sum(k is not None for k in state["block_keys"])
        assert keyed == sum(len(v) for v in state["cached"].values())


ManagerPair.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerPair = ManagerPair.TestCase
