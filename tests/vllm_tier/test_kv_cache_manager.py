"""vLLM's scheduler on vLLM's own KV-cache manager against the same scheduler on kvblocks'
manager: the same scripts, compared step by step (the harness: ``harness.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvblocks.vllm import _state
from kvblocks.vllm.block_hasher import ALGORITHMS
from tests.vllm_driver import SchedulerSpec, make_request
from tests.vllm_tier.harness import (
    Hasher,
    RequestSpec,
    Script,
    assert_same,
    both,
    events_spec,
    featured_script,
    on_each_manager,
    shared_prefix_script,
    soak_script,
)
from tests.vllm_tier.simulation import run


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_shared_prefixes_chunked_prefill_and_preemption(model_dir: Path, algo: str) -> None:
    spec = SchedulerSpec(block_size=8, num_blocks=40, hash_algo=algo, max_num_batched_tokens=48)
    stock, ours = both(model_dir, shared_prefix_script(spec, 40, seed=3))
    assert_same(stock, ours)
    assert any(record[0][5] for record in stock[:-1]), "the small pool must preempt"
    hits = sum(record[2][1][3] for record in stock[:-1] if record[2] is not None)
    assert hits > 0, "shared prefixes must hit"


def test_kv_events_stats_aborts_and_resets(model_dir: Path, async_scheduling: bool) -> None:
    spec = events_spec(48, async_scheduling=async_scheduling, watermark=0.05)
    stock, ours = both(model_dir, featured_script(spec))
    assert_same(stock, ours)
    kinds = {kind for record in stock[:-1] for batch in record[3] for kind, _ in batch}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert {record[4] for record in stock[:-1]} >= {True}


def test_prefix_caching_off(model_dir: Path) -> None:
    spec = events_spec(50, max_num_batched_tokens=2048, enable_caching=False)
    stock, ours = both(model_dir, shared_prefix_script(spec, 20, seed=5))
    assert_same(stock, ours)


def test_long_soak_thousands_of_steps(model_dir: Path) -> None:
    spec = SchedulerSpec(block_size=4, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=8)
    stock, ours = both(model_dir, soak_script(spec, seed=99))
    assert len(stock) > 1000
    assert_same(stock, ours)


# Random scripts.


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=40), min_size=1, max_size=3)
    )
    n = draw(st.integers(1, 10))
    requests = []
    for _ in range(n):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 999), max_size=30))
        sampling: dict[str, Any] = draw(
            st.sampled_from(
                [
                    {},
                    {},
                    {},
                    {"skip_reading_prefix_cache": True},
                    {"extra_args": {"kv_cache_report_mode": "full"}},
                ]
            )
        )
        requests.append(
            RequestSpec(
                prompt=prompt,
                max_tokens=draw(st.integers(1, 24)),
                step=draw(st.integers(0, 12)),
                salt=draw(st.sampled_from([None, None, "a", "b"])),
                lora=draw(st.sampled_from([None, None, None, 1, 2])),
                sampling=sampling,
            )
        )
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    min_blocks = -(-longest // block_size) + 2
    spec = SchedulerSpec(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 40)),
        hash_algo=draw(st.sampled_from(ALGORITHMS)),
        enable_caching=draw(st.sampled_from([True, True, True, False])),
        max_num_seqs=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64, 512])),
        async_scheduling=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1])),
        kv_events=draw(st.booleans()),
    )
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1)), max_size=2))
    resets = draw(st.lists(st.integers(0, 60), max_size=2))
    return Script(spec, requests, aborts, resets)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)


def test_zmq_event_stream_is_identical(model_dir: Path) -> None:
    """vLLM's own ZMQ KV-event publisher (what KV-aware routers subscribe to), on loopback:
    the batches a subscriber receives are the same with either manager.

    PUB/SUB drops what is sent before the connection and the subscription are up (the slow
    joiner), so before the run the test publishes marker batches until one arrives, and after
    it an end marker, reading until that arrives; the sequence numbers in between must have no
    gap, so nothing was dropped."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    spec = events_spec(40)
    script = shared_prefix_script(spec, 16, seed=21)
    script.requests.append(RequestSpec(script.requests[0].prompt, 3, 200))
    script.resets = [199]
    context = zmq.Context.instance()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    hello, end = -1.0, -2.0  # the markers' timestamps (the scheduler's are times)
    timeout = 60.0  # seconds, generous for a loaded machine

    def receive(subscriber: Any, deadline: float) -> tuple[int, KVEventBatch] | None:
        if not subscriber.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            return None
        topic, seq, payload = subscriber.recv_multipart()
        assert topic == b"kv"
        return int.from_bytes(seq, "big"), decoder.decode(payload)

    def play_to_subscriber(scheduler: Scheduler, hasher: Hasher) -> list[Any]:
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.setsockopt(zmq.RCVHWM, 0)  # keep everything until read
        port = subscriber.bind_to_random_port("tcp://127.0.0.1")
        publisher = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", topic="kv")
        try:
            deadline = time.monotonic() + timeout
            received = None
            while received is None:  # until a marker gets through: connected and subscribed
                assert time.monotonic() < deadline, "no marker reached the subscriber"
                publisher.publish(KVEventBatch(ts=hello, events=[]))
                received = receive(subscriber, min(deadline, time.monotonic() + 0.1))
            seqs = [received[0]]
            arrivals = [
                (r.step, make_request(f"r{i}", r.prompt, hasher, max_tokens=r.max_tokens))
                for i, r in enumerate(script.requests)
            ]
            run(scheduler, arrivals, resets=script.resets, publisher=publisher)
            publisher.publish(KVEventBatch(ts=end, events=[]))
            batches = []
            deadline = time.monotonic() + timeout
            while True:
                received = receive(subscriber, deadline)
                assert received is not None, "the end marker did not arrive"
                seq, batch = received
                seqs.append(seq)
                if batch.ts == end:
                    break
                if batch.ts != hello:  # markers still in flight from the handshake
                    batches.append(
                        [(type(e).__name__, msgspec.to_builtins(e)) for e in batch.events]
                    )
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a batch was dropped"
            return batches
        finally:
            publisher.shutdown()
            subscriber.close(linger=0)

    stock, ours = on_each_manager(model_dir, spec, play_to_subscriber)
    assert not _state.fallbacks, "kvblocks' manager and hasher must both run"
    assert len(stock) > 10
    flat = [event for batch in stock for event in batch]
    assert {event[0] for event in flat} >= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert ours == stock


def test_req_to_blocks_reads_like_vllms_defaultdict(model_dir: Path) -> None:
    """A group manager's ``req_to_blocks`` on both managers, read directly: a request holding
    blocks is a member, with the same blocks, until it is freed; then, as any id holding
    none, it reads as no blocks (vLLM's is a ``defaultdict``; reading there also adds an
    empty entry, which kvblocks' view does not, so that read comes last)."""
    spec = SchedulerSpec(block_size=4, num_blocks=40, layout=[("full", 0), ("sliding_window", 8)])

    def play(scheduler: Scheduler, hasher: Hasher) -> list[Any]:
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        views = [m.req_to_blocks for m in managers]
        seen: list[Any] = [[("a" in v, len(v), sorted(v)) for v in views]]
        scheduler.add_request(make_request("a", list(range(30)), hasher, max_tokens=2))
        scheduler.schedule()
        seen.append([(sorted(v), "a" in v, [b.block_id for b in v["a"]]) for v in views])
        scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        seen.append([("a" in v, len(v), sorted(v)) for v in views])
        seen.append([(list(v["a"]), list(v["never"])) for v in views])
        return seen

    stock, ours = on_each_manager(model_dir, spec, play)
    assert ours == stock
    assert stock[0] == stock[2] == [(False, 0, [])] * 2
    assert all(held and ids for _, held, ids in stock[1])
    assert stock[3] == [([], [])] * 2
