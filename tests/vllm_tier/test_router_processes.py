"""kvblocks.router over real processes: each replica is a child process running vLLM's own
``Scheduler`` (kvblocks' KV-cache manager, the fake model) that publishes its KV event
batches through vLLM's own ``ZmqEventPublisher`` on loopback, with a replay endpoint; the
index runs here and follows each replica with a :class:`~kvblocks.router.ReplicaFeed`.

For a random trace routed by the index, the hit each replica's scheduler takes is the one the
index predicted; and the index converges to the replicas' true state after batches it never
received (it connects after a replica has published: the replay endpoint repairs the gap),
after a replica is killed and restarted on the same endpoints (its sequence numbers start
again: the index clears it), and after a replica's ``reset_prefix_cache()``
(``AllBlocksCleared``). Routing by the index saves prefill tokens over round-robin on the
same trace (reported)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvblocks.router import ReplicaFeed, ReplicaLayout, RoutingIndex
from tests.fresh_process import CHECKOUT
from tests.processes import Lines

REPLICA = r"""
import json, sys, time
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.lora.request import LoRARequest
from vllm.v1.core import kv_cache_utils
import dataclasses
import kvblocks.vllm
from kvblocks.router import ReplicaLayout
from tests.vllm_driver import SchedulerSpec, block_hasher, make_request, make_scheduler
from tests.vllm_tier.simulation import run

port, replay_port = int(sys.argv[1]), int(sys.argv[2])
kvblocks.vllm.install("all")
layout = json.loads(sys.argv[4])  # a layout name, or [[kind, size], ...]
spec = SchedulerSpec(block_size=16, num_blocks=int(sys.argv[3]), hash_algo="sha256",
                     kv_events=True, max_num_seqs=4,
                     layout=layout if isinstance(layout, str) else [tuple(g) for g in layout])
scheduler = make_scheduler(tiny_model_dir := __import__("tests.vllm_driver",
                           fromlist=["tiny_model_dir"]).tiny_model_dir(), spec)
class CountingHasher:  # counts the blocks the replica's own request hasher hashes
    def __init__(self, inner):
        self.inner, self.blocks = inner, 0
    def __call__(self, request):
        hashes = self.inner(request)
        self.blocks += len(hashes)
        return hashes

hasher = CountingHasher(block_hasher("sha256", 16))
publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                              replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=10_000)

class Counting:
    def __init__(self):
        self.count = 0
    def publish(self, batch):
        publisher.publish(batch)
        self.count += 1
    def shutdown(self):
        pass

counting = Counting()
manager = type(scheduler.kv_cache_manager).__module__
# what a replica tells its router of its KV-cache groups (kvblocks.router.ReplicaLayout)
groups = dataclasses.asdict(ReplicaLayout.from_kv_cache_config(
    scheduler.kv_cache_manager.kv_cache_config))
print(json.dumps({"none_hash": bytes(kv_cache_utils.NONE_HASH).hex(), "manager": manager,
                  "layout": groups}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "run":
        lora = command["lora"]
        # hashes a frontend or router forwarded (vLLM 0.34's EngineCoreRequest.block_hashes)
        forwarded = command.get("hashes")
        extra = {} if forwarded is None else {
            "block_hashes": [bytes.fromhex(h) for h in forwarded]}
        before = hasher.blocks
        request = make_request(
            command["id"], command["prompt"], hasher, max_tokens=command["max_tokens"],
            lora_request=LoRARequest(f"adapter-{lora}", lora, "/lora") if lora else None,
            cache_salt=command["salt"], **extra)
        hashed_at_arrival = hasher.blocks - before
        records = run(scheduler, [(0, request)], publisher=counting)
        hit = next(c for rec in records[:-1] if rec[0] is not None
                   for rid, _, c in rec[0][1] if rid == command["id"])
        print(json.dumps({
            "hit": hit, "seq": counting.count - 1, "hashed_at_arrival": hashed_at_arrival,
            "block_hashes": [bytes(h).hex() for h in request.block_hashes],
            "outputs": list(request.output_token_ids)}), flush=True)
    elif command["op"] == "reset":
        assert scheduler.reset_prefix_cache()
        events = scheduler.kv_cache_manager.take_events()
        counting.publish(KVEventBatch(ts=time.time(), events=events))
        print(json.dumps({"seq": counting.count - 1}), flush=True)
    else:
        break
time.sleep(0.2)
publisher.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """A replica process and its two endpoints."""

    def __init__(
        self, num_blocks: int, ports: tuple[int, int] | None = None, layout: Any = "llama"
    ) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([CHECKOUT, os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("KVBLOCKS_VLLM", None)
        for attempt in range(3):
            self.ports = ports or (free_port(), free_port())
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    REPLICA,
                    *map(str, self.ports),
                    str(num_blocks),
                    json.dumps(layout),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=CHECKOUT,
            )
            self.lines = Lines(self.process)
            try:
                hello = json.loads(self.read())
                break
            except AssertionError:
                # Ports this process chose may be taken before the replica binds them: a
                # replica that exited at start-up gets new ones (given ports are the test's).
                try:
                    exited = self.process.wait(10) is not None
                except subprocess.TimeoutExpired:
                    exited = False
                if ports is not None or not exited or attempt == 2:
                    raise
        self.none_hash = bytes.fromhex(hello["none_hash"])
        assert hello["manager"] == "kvblocks.vllm.kv_cache_manager"
        fields = hello["layout"]
        sets = fields["lookup_sets"]
        self.layout = ReplicaLayout(
            **{**fields, "kinds": tuple(fields["kinds"]), "lookup_sets": tuple(map(tuple, sets))}
        )

    def read(self) -> str:
        return self.lines.next(timeout=120)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self.read())
        return answer

    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[0]}"

    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    def feed(self, index: RoutingIndex, name: str) -> ReplicaFeed:
        """The index's feed of this replica's events, replays included."""
        return ReplicaFeed(index, name, self.endpoint(), replay_endpoint=self.replay_endpoint())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.ask_nowait({"op": "exit"})
            self.process.wait(20)

    def ask_nowait(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()


def config(none_hash: bytes) -> SimpleNamespace:
    return SimpleNamespace(
        hash_algo="sha256", hash_block_size=16, none_hash=none_hash, num_lookahead_tokens=0
    )


def catch_up(feed: ReplicaFeed, seq: int) -> None:
    deadline = time.monotonic() + 20
    while feed.last_seq is None or feed.last_seq < seq:
        assert time.monotonic() < deadline, f"{feed.name}: at {feed.last_seq}, waiting for {seq}"
        feed.poll(100)


def trace(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(40, 200))] for _ in range(4)]
    out = []
    for i in range(n):
        prefix = rng.choice(prefixes)
        prompt = prefix[: rng.randrange(len(prefix) + 1)]
        prompt += [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
        out.append(
            {
                "op": "run",
                "id": f"q{i}",
                "prompt": prompt,
                "max_tokens": rng.randrange(1, 6),
                "lora": rng.choice([None, None, 1]),
                "salt": rng.choice([None, None, "t"]),
            }
        )
    return out


@pytest.fixture
def fleet() -> Any:
    replicas: list[Replica] = []
    feeds: list[ReplicaFeed] = []
    yield replicas, feeds
    for feed in feeds:
        feed.close()
    for replica in replicas:
        replica.stop() if replica.process.poll() is None else None


def test_the_index_follows_replicas_over_zmq(fleet: Any) -> None:
    replicas, feeds = fleet
    index = RoutingIndex()
    for i in range(3):
        replicas.append(Replica(num_blocks=48))
        index.add_replica(f"r{i}", config(replicas[-1].none_hash))
    # r0 publishes before anything listens: its first batches are lost to the SUB socket.
    warm = trace(99, 3)
    for command in warm:
        replicas[0].ask(command)
    for i, replica in enumerate(replicas):
        feeds.append(replica.feed(index, f"r{i}"))
    time.sleep(0.5)  # the SUB sockets' subscriptions reach the publishers
    rng = random.Random(3)
    saved = {"index": 0, "round robin": 0}
    for i, command in enumerate(trace(5, 45)):
        if i == 15:  # r1 drops its cache
            seq = replicas[1].ask({"op": "reset"})["seq"]
            catch_up(feeds[1], seq)
            assert index.held("r1") == 0
        if i == 30:  # r2 is killed, and a new r2 starts on the same endpoints, empty
            replicas[2].kill()
            replicas[2] = Replica(num_blocks=48, ports=replicas[2].ports)
            assert replicas[2].none_hash == replicas[0].none_hash  # sha256: the same seed
            time.sleep(1.0)  # the feed's SUB socket reconnects to the new publisher
        for feed in feeds:
            feed.poll(0)
        kwargs = {"cache_salt": command["salt"]}
        if command["lora"]:
            from vllm.lora.request import LoRARequest

            kwargs["lora_request"] = LoRARequest("adapter-1", 1, "/lora")
        predicted = index.score(command["prompt"], **kwargs)
        name = index.best(command["prompt"], **kwargs) if rng.random() < 0.8 else f"r{i % 3}"
        saved["index"] += max(v for v in predicted.values() if v is not None)
        saved["round robin"] += predicted[f"r{i % 3}"] or 0
        if i == 30:
            # The index learns of the restart from the new process's first batch (its numbers
            # start again from 0): until then it still has the old r2's blocks.
            answer = replicas[2].ask(command)
            assert answer["hit"] == 0
            deadline = time.monotonic() + 20
            while feeds[2].restarts + feeds[2].resyncs == 0 or feeds[2].last_seq < answer["seq"]:
                assert time.monotonic() < deadline
                feeds[2].poll(100)
            continue
        target = int(name[1:])
        answer = replicas[target].ask(command)
        assert answer["hit"] == predicted[name], (i, name, predicted, answer)
        catch_up(feeds[target], answer["seq"])
    # Not vacuous: the gap before r0's feed connected was replayed; r2's restart was seen.
    assert feeds[0].replayed >= 1
    assert feeds[2].restarts == 1 or feeds[2].resyncs == 1
    assert all(feed.malformed == 0 for feed in feeds)
    assert index.counts()["unknown_removals"] == 0
    print(f"\nprefill tokens found cached: {saved}")
    assert saved["index"] > saved["round robin"]


def test_hybrid_replicas_over_zmq(fleet: Any) -> None:
    """Replica processes on a gpt-oss-like layout (full attention and a 48-token sliding
    window), each telling the router its layout as it reads its own ``KVCacheConfig``: every
    predicted hit is the one the replica's scheduler takes, under eviction, and the window's
    rule decided some of them."""
    replicas, feeds = fleet
    index = RoutingIndex()
    for i in range(2):
        replicas.append(Replica(num_blocks=120, layout=[["full", 0], ["sliding_window", 48]]))
        assert replicas[i].layout.kinds == ("full_attention", "sliding_window")
        index.add_replica(f"r{i}", config(replicas[i].none_hash), replicas[i].layout)
        feeds.append(replicas[i].feed(index, f"r{i}"))
    time.sleep(0.5)  # the SUB sockets' subscriptions reach the publishers
    hits = cut_short = 0
    for i, command in enumerate(trace(23, 40)):
        for feed in feeds:
            feed.poll(0)
        kwargs = {"cache_salt": command["salt"]}
        if command["lora"]:
            from vllm.lora.request import LoRARequest

            kwargs["lora_request"] = LoRARequest("adapter-1", 1, "/lora")
        predicted = index.score(command["prompt"], **kwargs)
        name = index.best(command["prompt"], **kwargs) if i % 3 else f"r{i % 2}"
        # what the full-attention group alone holds of the prompt
        hashes = index.route(command["prompt"], **kwargs).block_hashes or []
        usable = hashes[: (len(command["prompt"]) - 1) // 16]
        full = index.group_prefix(name, usable, 0) * 16
        target = int(name[1:])
        answer = replicas[target].ask(command)
        assert answer["hit"] == predicted[name], (i, name, predicted, answer)
        hits += answer["hit"] > 0
        cut_short += predicted[name] < full
        catch_up(feeds[target], answer["seq"])
    counts = index.counts()
    # Not vacuous: hits, evictions, and hits the window's rule made shorter than full
    # attention's prefix.
    assert hits > 5
    assert counts["removed"] > 0
    assert cut_short > 0
    assert counts["unknown_removals"] == 0


def test_kvblocks_route_over_http_routes_real_replicas(fleet: Any) -> None:
    """``kvblocks route`` (kvblocks.router.scorer) following two replica processes: for a trace
    routed mostly by its HTTP answers, each replica's scheduler takes the hit the answer
    predicted for it."""
    import urllib.request

    from kvblocks.router.fleet import load_fleet
    from kvblocks.router.scorer import serve

    replicas, _feeds = fleet
    for _ in range(2):
        replicas.append(Replica(num_blocks=48))
    entries = [
        {
            "name": f"r{i}",
            "url": f"http://replica-{i}:8000",
            "events": replica.endpoint(),
            "replay": replica.replay_endpoint(),
            "hash_algo": "sha256",
            "hash_block_size": 16,
            "none_hash": replica.none_hash.hex(),
        }
        for i, replica in enumerate(replicas)
    ]
    routed = {"r0": 0, "r1": 0}
    found = 0  # prompt tokens the replicas found cached, as predicted
    with serve(load_fleet({"replicas": entries}), port=0) as running:
        time.sleep(0.5)  # the feeds' subscriptions reach the publishers
        for i, command in enumerate(trace(11, 30)):
            if command["lora"]:
                continue  # LoRA over HTTP: lora_name and lora_path, checked in tests/test_route.py
            body = {"prompt_token_ids": command["prompt"], "cache_salt": command["salt"]}
            request = urllib.request.Request(
                running.url + "/score",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read())
            best = answer["best"]
            assert answer["url"] == f"http://replica-{best[1:]}:8000"
            assert answer["scores"][best] == max(answer["scores"].values())
            # every third request goes elsewhere (as a router balancing load would send it):
            # the prediction holds for every replica, not only the best
            name = best if i % 3 else f"r{i % 2}"
            result = replicas[int(name[1:])].ask(command)
            assert result["hit"] == answer["scores"][name], (command["id"], answer, result)
            routed[name] += 1
            found += result["hit"]
            deadline = time.monotonic() + 20
            feed = running.service.feeds[name]
            while feed.last_seq is None or feed.last_seq < result["seq"]:
                assert time.monotonic() < deadline, f"{name} never caught up"
                time.sleep(0.01)
        hits = sum(running.service.index.held(n) for n in routed)
    # Not vacuous: both replicas served, hits were predicted, the index holds blocks.
    assert min(routed.values()) > 0, routed
    assert found > 0
    assert hits > 0


def test_forwarded_hashes_skip_the_replicas_hashing(fleet: Any) -> None:
    """Hash once: the router's hashes of a routed prompt (``RoutingIndex.route``) are the ones
    the chosen replica would compute, so a router forwards them (vLLM 0.34's
    ``EngineCoreRequest.block_hashes``) and the replica's own hasher hashes none of the
    prompt's blocks. Each routed replica has a twin that gets the same requests without the
    hashes and hashes them itself: same hashes, same hits (the predicted ones), same
    outputs."""
    import inspect

    from vllm.v1.request import Request

    if "block_hashes" not in inspect.signature(Request.__init__).parameters:
        pytest.skip("vLLM 0.33 takes no frontend block hashes (0.34's EngineCoreRequest's)")
    replicas, feeds = fleet
    index = RoutingIndex()
    for _ in range(4):  # r0, r1 routed (forwarded hashes); r2, r3 their twins
        replicas.append(Replica(num_blocks=64))
    for i in range(2):
        index.add_replica(f"r{i}", config(replicas[i].none_hash))
        feeds.append(replicas[i].feed(index, f"r{i}"))
    time.sleep(0.5)  # the SUB sockets' subscriptions reach the publishers
    skipped = 0
    for i, command in enumerate(trace(17, 24)):
        if command["lora"]:
            command["lora"] = None  # LoRA hashing is checked by test_router.py
        route = index.route(command["prompt"], cache_salt=command["salt"])
        assert route.replica is not None
        # mostly the best replica, every fourth request the other way (the replicas hash alike:
        # the route's hashes are every replica's)
        target = int(route.replica[1:]) if i % 4 else i % 2
        name = f"r{target}"
        hashes = route.block_hashes
        assert hashes is not None
        forwarded = replicas[target].ask({**command, "hashes": [h.hex() for h in hashes]})
        own = replicas[target + 2].ask(command)
        assert forwarded["hashed_at_arrival"] == 0, (i, forwarded)
        assert own["hashed_at_arrival"] == len(command["prompt"]) // 16
        assert forwarded["block_hashes"] == own["block_hashes"]
        assert forwarded["block_hashes"][: len(hashes)] == [h.hex() for h in hashes]
        assert forwarded["outputs"] == own["outputs"]
        assert forwarded["hit"] == own["hit"] == route.scores[name], (i, name, route)
        skipped += len(hashes)
        catch_up(feeds[target], forwarded["seq"])
    # Not vacuous: prompt blocks were forwarded, and some hits found.
    assert skipped > 50
