"""``kvblocks route`` (kvblocks.router): the fleet file, the HTTP answers, and a replica's KV
events arriving over ZMQ as vLLM's ``ZmqEventPublisher`` sends them (``[topic, seq, batch]``,
the batch msgpack-encoded as vLLM's ``KVEventBatch``: ``[ts, [event, ...], dp_rank]`` with each
event a map tagged ``type``), here written by hand with msgspec and pyzmq. The same service
against real vLLM replica processes: tests/vllm_tier/test_router_processes.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvblocks._core import BlockHasher
from kvblocks.router.fleet import load_fleet
from kvblocks.router.index import RoutingIndex
from kvblocks.router.scorer import RouteService, serve
from tests.processes import Lines

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

SEED = "7"
NONE_HASH = BlockHasher("sha256", seed=SEED).none_hash


#: A field :func:`fleet_json` leaves out.
DROP = object()


def fleet_json(**replica: Any) -> dict[str, Any]:
    base = {"name": "a", "hash_algo": "sha256", "hash_block_size": 16, "hash_seed": SEED}
    entry = {k: v for k, v in {**base, **replica}.items() if v is not DROP}
    return {"replicas": [entry]}


def post(url: str, body: Any) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def block_hashes(tokens: list[int], **keys: Any) -> list[bytes]:
    return BlockHasher("sha256", block_size=16).hash_blocks(tokens, parent=NONE_HASH, **keys)


def stored(hashes: list[bytes], tokens: list[int]) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM encodes it, its hashes as ints (vLLM's default)."""
    return {
        "type": "BlockStored",
        "block_hashes": [int.from_bytes(h[-8:], "big") for h in hashes],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": ""}, "needs a name"),
        ({"hash_block_size": 0}, "hash_block_size"),
        ({"none_hash": "00"}, "not both"),
        ({"none_hash": "zz", "hash_seed": DROP}, "must be hex"),
        ({"hash_algo": "xxhash", "hash_seed": DROP}, "draws its NONE_HASH at random"),
        ({"colour": "red"}, "unknown fields"),
        ({"kinds": "full_attention"}, "kinds must be a list"),
        ({"kinds": ["full_attention", "sliding_window"]}, "needs its sliding_window"),
        ({"kinds": ["full_attention"] * 2, "lookup_sets": [[0]]}, "every group must be in one"),
        ({"lookup_sets": [0]}, "list of lists"),
        ({"use_eagle": 1}, "true or false"),
        ({"eagle_groups": 0}, "list of group ids"),
        ({"use_eagle": True, "eagle_groups": [1]}, "must be group ids"),
        ({"events": 5557}, "events must be a string"),
    ],
)
def test_a_bad_fleet_file_names_its_field(change: dict[str, Any], message: str) -> None:
    data = fleet_json(**change)
    with pytest.raises(ValueError, match=message):
        load_fleet(data)


def test_a_fleet_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet_json(url="http://a:8000", kinds=["full_attention"] * 2)))
    (spec,) = load_fleet(path).replicas
    assert spec.prefix_hash_config.none_hash == NONE_HASH
    assert (spec.url, spec.layout.kinds) == ("http://a:8000", ("full_attention",) * 2)
    # a SHA-256 engine without PYTHONHASHSEED: vLLM's fixed seed
    (default,) = load_fleet(fleet_json(hash_seed=DROP)).replicas
    expected = BlockHasher("sha256", seed="vllm-none-hash").none_hash
    assert default.prefix_hash_config.none_hash == expected
    twice = {"replicas": fleet_json()["replicas"] * 2}
    with pytest.raises(ValueError, match="unique"):
        load_fleet(twice)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_fleet(path)


def test_scores_over_http_from_events_over_zmq() -> None:
    port = free_port()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    fleet = {
        "replicas": [
            *fleet_json(url="http://a:8000", events=f"tcp://127.0.0.1:{port}")["replicas"],
            *fleet_json(name="b", url="http://b:8000")["replicas"],
            # a group kind kvblocks does not reproduce: scored None, never guessed
            *fleet_json(name="w", kinds=["full_attention", "sink_full_attention"])["replicas"],
            # a hybrid layout kvblocks reproduces: scored (it holds nothing)
            *fleet_json(name="g", kinds=["full_attention", "sliding_window"], sliding_window=32)[
                "replicas"
            ],
        ]
    }
    prompt = list(range(100, 180))  # 5 blocks
    hashes = block_hashes(prompt)
    encoder = msgspec.msgpack.Encoder()
    try:
        with serve(load_fleet(fleet), port=0) as running:
            assert get(running.url + "/health") == {"status": "ok"}
            time.sleep(0.3)  # the feed's subscription reaches the publisher
            # replica a stores the prompt's first 3 blocks (sequence 0)
            batch = [time.time(), [stored(hashes[:3], prompt[:48])], None]
            publisher.send_multipart([b"", (0).to_bytes(8, "big"), encoder.encode(batch)])
            deadline = time.monotonic() + 10
            while running.service.index.held("a") < 3:
                assert time.monotonic() < deadline, "the event never arrived"
                time.sleep(0.02)
            status, answer = post(running.url + "/score", {"prompt_token_ids": prompt})
            assert status == 200
            assert answer == {
                "scores": {"a": 48, "b": 0, "w": None, "g": 0},
                "best": "a",
                "url": "http://a:8000",
            }
            # the hashes to forward with the request: the best replica's engine's
            _, forward = post(
                running.url + "/score", {"prompt_token_ids": prompt, "return_block_hashes": True}
            )
            assert forward["block_hashes"] == [h.hex() for h in hashes]
            # a cache salt keys the blocks apart: nothing cached for a salted prompt
            _, salted = post(
                running.url + "/score", {"prompt_token_ids": prompt, "cache_salt": "s"}
            )
            assert salted["scores"] == {"a": 0, "b": 0, "w": None, "g": 0}
            # the CPU tier holds nothing
            _, cpu = post(running.url + "/score", {"prompt_token_ids": prompt, "medium": "CPU"})
            assert cpu["scores"]["a"] == 0
            replicas = get(running.url + "/replicas")
            assert replicas["replicas"]["a"]["blocks_held"] == 3
            assert replicas["replicas"]["a"]["feed"]["last_seq"] == 0
            assert replicas["replicas"]["b"]["feed"] is None
            assert replicas["counts"]["stored"] == 3
            # bad requests: a 400 naming the problem, and the service goes on
            for body, message in [
                ({"prompt_token_ids": []}, "non-empty list"),
                ({"prompt_token_ids": [1, -2]}, "out of range"),
                ({"prompt_token_ids": [1], "temperature": 0}, "unknown fields"),
                ({"prompt_token_ids": [1], "lora_name": "x"}, "lora_path"),
                ([1, 2], "JSON object"),
            ]:
                status, error = post(running.url + "/score", body)
                assert status == 400, (body, error)
                assert message in error["error"], (body, error)
            assert post(running.url + "/score", {"prompt_token_ids": prompt})[1]["best"] == "a"
            # a batch with an event type the index does not know, beside a store it does,
            # then one that is not a batch at all: counted, skipped, the stream goes on
            unknown = {"type": "BlockTeleported", "block_hashes": [1]}
            batch = [time.time(), [unknown, stored(hashes[3:4], prompt[48:64])], None]
            publisher.send_multipart([b"", (1).to_bytes(8, "big"), encoder.encode(batch)])
            publisher.send_multipart([b"", (2).to_bytes(8, "big"), b"not msgpack"])
            feed = running.service.feeds["a"]
            deadline = time.monotonic() + 10
            while feed.last_seq != 2:
                assert time.monotonic() < deadline, "the batches never arrived"
                time.sleep(0.02)
            counts = get(running.url + "/replicas")
            assert counts["replicas"]["a"]["blocks_held"] == 4
            assert counts["counts"]["skipped_events"] == 1
            assert counts["replicas"]["a"]["feed"]["malformed"] == 1
    finally:
        publisher.close(linger=0)


class BlockStored(SimpleNamespace):
    """Stands in for vLLM's event class of that name (the index reads its type's name)."""


def test_the_score_needs_no_http() -> None:
    """As a router's scorer: RouteService.score without the server; vLLM looks up at most
    all but the last prompt token, so a fully cached 2-block prompt scores 1 block."""
    service = RouteService(load_fleet(fleet_json()))
    prompt = list(range(32))
    event = BlockStored(block_hashes=block_hashes(prompt), medium=None, group_idx=0)
    service.index.apply_events("a", [event])
    assert service.score({"prompt_token_ids": prompt}) == {
        "scores": {"a": 16},
        "best": "a",
        "url": None,
    }
    assert service.score({"prompt_token_ids": [*prompt, 5]})["scores"] == {"a": 32}


def test_a_prefix_counts_as_far_as_every_group_holds_it() -> None:
    """Two full-attention groups (as a model with two attention specs has): the hit is the
    shorter of the groups' prefixes; a one-group replica beside it is scored on its own."""
    fleet = {
        "replicas": [
            *fleet_json(name="two", kinds=["full_attention", "mla_attention"])["replicas"],
            *fleet_json(name="one")["replicas"],
        ]
    }
    service = RouteService(load_fleet(fleet))
    prompt = list(range(80))  # 5 blocks; 4 may hit
    hashes = block_hashes(prompt)
    service.index.apply_events(
        "two",
        [
            BlockStored(block_hashes=hashes[:4], medium=None, group_idx=0),
            BlockStored(block_hashes=hashes[:2], medium=None, group_idx=1),
        ],
    )
    service.index.apply_events(
        "one", [BlockStored(block_hashes=hashes[:3], medium=None, group_idx=None)]
    )
    assert service.score({"prompt_token_ids": prompt})["scores"] == {"two": 32, "one": 48}


class AllBlocksCleared(SimpleNamespace):
    """Stands in for vLLM's event class of that name."""


def test_all_blocks_cleared_clears_the_device_tier_alone() -> None:
    """vLLM's block pool publishes AllBlocksCleared on reset_prefix_cache(), which leaves an
    offloading tier's blocks where they are: the index forgets the replica's GPU blocks and
    keeps its CPU ones (and the blocks of another replica); clearing the replica itself (a
    restart, or a gap in its events) forgets every tier."""
    fleet = {"replicas": [*fleet_json()["replicas"], *fleet_json(name="b")["replicas"]]}
    service = RouteService(load_fleet(fleet))
    prompt = list(range(80))  # 5 blocks; 4 may hit
    hashes = block_hashes(prompt)
    index = service.index
    for name in ("a", "b"):
        index.apply_events(
            name,
            [
                BlockStored(block_hashes=hashes[:4], medium="GPU", group_idx=0),
                BlockStored(block_hashes=hashes[:3], medium="CPU", group_idx=0),
            ],
        )
    assert (index.held("a"), index.num_keys) == (7, 7)
    index.apply_events("a", [AllBlocksCleared()])
    assert index.score(prompt) == {"a": 0, "b": 64}
    assert index.score(prompt, medium="CPU") == {"a": 48, "b": 48}
    assert (index.held("a"), index.held("b")) == (3, 7)
    assert index.counts()["cleared"] == 4
    assert index.clear_replica("a", medium="CPU") == 3
    assert index.score(prompt, medium="CPU") == {"a": 0, "b": 48}
    assert index.clear_replica("b") == 7
    assert index.score(prompt, medium="CPU") == {"a": 0, "b": 0}
    assert index.clear_replica("b", medium="NVMe") == 0  # a medium no event named


def test_a_reload_changes_what_changed_and_keeps_the_rest() -> None:
    """RouteService.reload: at the next poll a new replica is registered and its feed
    followed, a changed one registered again (its blocks forgotten), an unchanged one keeps
    its blocks, a removed one is forgotten and its feed closed; a replica whose feed cannot be
    opened is left out, saying why, and the rest of the change holds."""
    port = free_port()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    prompt = list(range(100, 180))
    hashes = block_hashes(prompt)
    a, b = fleet_json(name="a")["replicas"][0], fleet_json(name="b")["replicas"][0]
    c = fleet_json(name="c", events=f"tcp://127.0.0.1:{port}")["replicas"][0]
    service = RouteService(load_fleet({"replicas": [a, b]}))
    try:
        for name in ("a", "b"):
            event = BlockStored(block_hashes=hashes[:3], medium=None, group_idx=0)
            service.index.apply_events(name, [event])
        service.reload(load_fleet({"replicas": [a, {**b, "url": "http://b2:8000"}, c]}))
        assert service.index.replicas == ["a", "b"]  # not before the next poll
        service.poll(0)
        assert service.reloads == [{"added": ["c"], "removed": [], "changed": ["b"]}]
        assert service.index.replicas == ["a", "b", "c"]
        assert (service.index.held("a"), service.index.held("b")) == (3, 0)
        assert service.urls["b"] == "http://b2:8000"
        assert list(service.feeds) == ["c"]
        encoder = msgspec.msgpack.Encoder()
        batch = encoder.encode([time.time(), [stored(hashes[:2], prompt[:32])], None])
        deadline = time.monotonic() + 10
        while service.index.held("c") < 2:  # the subscription reaches the publisher
            assert time.monotonic() < deadline, "the new replica's feed never applied a batch"
            publisher.send_multipart([b"", (0).to_bytes(8, "big"), batch])
            service.poll(100)
        assert service.score({"prompt_token_ids": prompt})["scores"] == {"a": 48, "b": 0, "c": 32}
        bad = {**fleet_json(name="d", events="tcp://127.0.0.1:port")["replicas"][0]}
        service.reload(load_fleet({"replicas": [a, bad]}))
        service.poll(0)
        assert service.index.replicas == ["a"]
        assert service.feeds == {}
        assert "ZMQError" in str(service.reload_error)
        assert len(service.reloads) == 1  # the change that failed is not listed as done
        assert service.poll(50) == 0
    finally:
        service.close()
        publisher.close(linger=0)


def test_the_command_reads_its_fleet_file_again_on_change_and_on_sighup(tmp_path: Path) -> None:
    """``kvblocks route``: a rewritten fleet file is served within seconds; a change the file's
    time, size and inode do not show (written in place, its time put back) waits for SIGHUP;
    a file that no longer loads is reported and the fleet stays; SIGTERM still ends it with
    status 0, its ``--snapshot`` written."""
    path, snap = tmp_path / "fleet.json", tmp_path / "index.snapshot"
    path.write_text(json.dumps({"replicas": fleet_json(name="a")["replicas"]}))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvblocks",
            "route",
            str(path),
            "--port",
            "0",
            "--snapshot",
            str(snap),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def replicas(url: str) -> list[str]:
        return sorted(get(url + "/replicas")["replicas"])

    def until(url: str, names: list[str], timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while replicas(url) != names:
            assert time.monotonic() < deadline, f"never served {names}: {replicas(url)}"
            time.sleep(0.1)

    try:
        line = Lines(process).next(timeout=60)
        url = line.split("serving on ", 1)[1].split()[0]
        assert replicas(url) == ["a"]
        path.write_text(json.dumps({"replicas": fleet_json(name="b")["replicas"]}))
        until(url, ["b"])
        before = path.stat()
        with path.open("r+") as f:  # same size, same inode
            f.write(json.dumps({"replicas": fleet_json(name="c")["replicas"]}))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(2.5)  # more than the command's interval between looks at the file
        assert replicas(url) == ["b"]
        process.send_signal(signal.SIGHUP)
        until(url, ["c"])
        path.write_text("{")
        time.sleep(2.5)
        assert replicas(url) == ["c"]
        process.terminate()
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "kvblocks route: fleet reloaded: b" in err
    assert "kvblocks route: fleet reloaded: c" in err
    assert f"kvblocks route: {path} not reloaded: " in err
    assert "Traceback" not in err
    # --snapshot: written as the command stopped, with the fleet it had then
    restored = RouteService(load_fleet({"replicas": fleet_json(name="c")["replicas"]}))
    assert restored.restore(snap.read_bytes()) == {"c": "restored 0 blocks"}
    restored.close()


class Publisher:
    """A replica's event endpoints as vLLM's ``ZmqEventPublisher`` serves them: a PUB socket
    sending ``[topic, seq, batch]``, and a ROUTER replay endpoint that answers ``[id, "",
    start]`` with ``[id, "", topic, seq, batch]`` for every batch it keeps from ``start`` on,
    then the end marker (sequence number 2^64 - 1)."""

    def __init__(self) -> None:
        context = zmq.Context.instance()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.kept: dict[int, bytes] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in list(self.kept) if s >= first):
                frames = [client, b"", b"", seq.to_bytes(8, "big"), self.kept[seq]]
                self.router.send_multipart(frames)
            end = ((1 << 64) - 1).to_bytes(8, "big")
            self.router.send_multipart([client, b"", b"", end, b""])

    def publish(self, seq: int, events: list[dict[str, Any]]) -> None:
        self.kept[seq] = self._encoder.encode([time.time(), events, None])
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.kept[seq]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def removed(hashes: list[bytes]) -> dict[str, Any]:
    """A ``BlockRemoved`` as vLLM encodes it."""
    published = [int.from_bytes(h[-8:], "big") for h in hashes]
    return {"type": "BlockRemoved", "block_hashes": published, "medium": "GPU"}


class BlockRemoved(SimpleNamespace):
    """Stands in for vLLM's event class of that name."""


def test_a_snapshot_restores_the_index_and_the_feed_resumes_through_replay() -> None:
    """RouteService.snapshot then restore in a new service: each replica whose entry did not
    change gets its blocks back, and its feed resumes after the snapshot's sequence number:
    the batches published while no service ran come through the replay endpoint, so the
    index ends as one that received every batch (checked against an index fed them all
    directly); a changed entry, or a snapshot that does not decode, restores nothing."""
    publisher = Publisher()
    prompt = list(range(200, 296))  # 6 blocks
    hashes = block_hashes(prompt)
    a = fleet_json(
        name="a",
        events=f"tcp://127.0.0.1:{publisher.port}",
        replay=f"tcp://127.0.0.1:{publisher.replay_port}",
    )["replicas"][0]
    b = fleet_json(name="b")["replicas"][0]
    fleet = load_fleet({"replicas": [a, b]})
    batches = [
        [stored(hashes[:3], prompt[:48])],
        [stored(hashes[3:5], prompt[48:80])],
        [removed(hashes[4:5])],
        [stored(hashes[4:6], prompt[64:96])],
    ]

    def follow(service: RouteService, seq: int, until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not until():
            assert time.monotonic() < deadline, "the batch never arrived"
            publisher.publish(seq, batches[seq])  # again, until the subscription is up
            service.poll(100)

    first = RouteService(fleet)
    try:
        follow(first, 0, lambda: first.index.held("a") == 3)
        event = BlockStored(block_hashes=hashes[:2], medium=None, group_idx=0)
        first.index.apply_events("b", [event])
        data = first.snapshot()
    finally:
        first.close()
    publisher.publish(1, batches[1])  # while no service runs
    publisher.publish(2, batches[2])
    second = RouteService(fleet)
    try:
        assert second.restore(data) == {"a": "restored 3 blocks", "b": "restored 2 blocks"}
        assert second.feeds["a"].last_seq == 0
        follow(second, 3, lambda: second.feeds["a"].last_seq == 3)
        feed = second.feeds["a"]
        assert (feed.replayed, feed.resyncs, feed.restarts) == (2, 0, 0)
        # an index that received every batch, applied in order
        reference = RoutingIndex()
        for name in ("a", "b"):
            reference.add_replica(name, fleet.replicas[0].prefix_hash_config)
        kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
        for batch in batches:
            for e in batch:
                found = kinds[e["type"]](block_hashes=e["block_hashes"], medium="GPU", group_idx=0)
                reference.apply_events("a", [found])
        reference.apply_events("b", [event])
        for tokens in (prompt, prompt[:50], prompt[:90]):
            assert second.index.score(tokens) == reference.score(tokens), tokens
        assert second.index.held("a") == reference.held("a") == 6
        assert second.index.score(prompt)["a"] == 80  # 5 of its 6 blocks: not the last token's
    finally:
        second.close()
        publisher.close()
    changed = RouteService(load_fleet({"replicas": [{**a, "hash_seed": "8"}, b]}))
    try:
        outcome = changed.restore(data)
        assert outcome["a"] == "its fleet entry changed since"
        assert changed.index.held("a") == 0
        with pytest.raises(ValueError, match=r"does not decode|not a kvblocks"):
            changed.restore(b"\x93junk")
    finally:
        changed.close()


def test_the_command_refuses_a_bad_fleet(tmp_path: Path) -> None:
    """(Its serving and stopping: tests/test_signals.py.)"""
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "kvblocks", "route", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "kvblocks: error: a fleet is" in done.stderr


def test_the_documented_fleet_file_loads() -> None:
    """docs/router.md's example fleet file is one load_fleet takes."""
    text = (Path(__file__).parent.parent / "docs" / "router.md").read_text()
    block = text.split("```json\n", 1)[1].split("```", 1)[0]
    fleet = load_fleet(json.loads(block))
    assert [r.name for r in fleet.replicas] == ["a", "b"]
    assert (
        fleet.replicas[0].prefix_hash_config.none_hash == BlockHasher("sha256", seed="0").none_hash
    )
