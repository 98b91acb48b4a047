"""kvblocks as the endpoint picker of the Gateway API Inference Extension (GIE): a gRPC server
for Envoy's ``ext_proc`` filter (``envoy.service.ext_proc.v3.ExternalProcessor``) that tells
Envoy which vLLM replica of a fleet (:mod:`kvblocks.router.fleet`) serves each request.

The Endpoint Picker Protocol, as this module speaks it:

- Envoy streams the request's headers, then its body (``BUFFERED``: one message holding all
  of it; ``FULL_DUPLEX_STREAMED``: chunks, which the picker holds and sends back unchanged
  once it has decided); a request without a body, or one whose body would come only after
  the headers are answered (``STREAMED``, ``NONE``), is decided on its headers, by load;
  once it has answered, the picker closes the stream (skip the response phases);
- the answer names the chosen replica as ``ip:port`` twice, in the request header
  ``x-gateway-destination-endpoint`` (a header mutation) and in the dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint`` (Envoy's ``ORIGINAL_DST`` cluster, or its
  override-host load balancing policy, sends the request there);
- a subset hint (filter metadata ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``: a list of ``ip:port``) limits the choice to those
  endpoints;
- no ready endpoint (none answers its ``/metrics``, or none in the subset): an immediate 503;
  every candidate's queue over the shedding limit: 429; a ``model`` no replica serves: 404
  with an OpenAI-style error body;
- ``grpc.health.v1`` answers for ``""``, ``liveness``, ``readiness`` and the ext_proc service.

How it chooses (:class:`Weights`): for each candidate, ``prefix * hit - queue * q / (q +
queue_half) - kv * kv_usage``, where ``hit`` is the fraction of the prompt's tokens the
replica has cached (:class:`kvblocks.router.scorer.RouteService`, exact), ``q`` the requests
waiting there (vLLM's ``vllm:num_requests_waiting``, scraped from the replica's ``/metrics``,
plus the picks sent there since that scrape) and ``kv_usage`` vLLM's
``vllm:kv_cache_usage_perc`` (0 to 1). A body it cannot turn into token ids (no tokenizer for
it, not JSON, too large) is routed on load alone, and counted.

Turning a body into token ids is the caller's (:data:`Tokenize`); the default,
:func:`token_ids_prompt`, reads ``/v1/completions`` bodies whose ``prompt`` is token ids;
:class:`kvblocks.router.openai.Tokenizers` renders text and chats as vLLM does (``--model
NAME=DIR``).

``python -m kvblocks.router.picker FLEET.json --grpc-port 9002 --metrics-port 9090`` serves
until SIGTERM or SIGINT. Needs ``pip install "kvblocks[gateway]"`` (grpcio,
grpcio-health-checking, xds-protos, prometheus_client). docs/router.md has the Envoy
configuration.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast
from urllib.parse import urlsplit

from kvblocks._signals import add_snapshot_arguments
from kvblocks.router.fleet import Fleet, FleetFile, ReplicaSpec, follow_fleet_file
from kvblocks.router.openai import Prompt
from kvblocks.router.scorer import (
    RouteService,
    SnapshotFile,
    report_restored,
)

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = [
    "DESTINATION",
    "Decision",
    "EndpointPicker",
    "LoadBoard",
    "Prompt",
    "ReplicaLoad",
    "RunningPicker",
    "Settings",
    "Tokenize",
    "Weights",
    "main",
    "parse_vllm_metrics",
    "serve",
    "token_ids_prompt",
]

#: The header and the ``envoy.lb`` metadata key naming the chosen endpoint.
DESTINATION = "x-gateway-destination-endpoint"
#: The dynamic metadata namespace the picker writes the choice in.
LB_NAMESPACE = "envoy.lb"
#: The filter metadata namespace and key of the subset hint.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: The gRPC health services the picker answers for (GIE's names; "" is the whole server).
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
#: The largest gRPC message the picker accepts: Envoy's own buffer limit
#: (``per_connection_buffer_limit_bytes``) is what bounds bodies; this only keeps a body that
#: passed it from failing the stream.
MAX_MESSAGE = 64 << 20

_log = logging.getLogger(__name__)

# ext_proc's ProcessingMode.BodySendMode values (envoy.extensions.filters.http.ext_proc.v3).
_NONE, _STREAMED, _BUFFERED, _BUFFERED_PARTIAL, _FULL_DUPLEX = 0, 1, 2, 3, 4


#: Turns a request (its path, without the query, and its JSON body) into a
#: :class:`~kvblocks.router.openai.Prompt`, or None where it cannot (the request is then routed
#: on load alone): :meth:`kvblocks.router.openai.Tokenizers.prompt_of` for text and chats.
Tokenize = Callable[[str, dict[str, Any]], Prompt | None]


def _is_token_ids(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(t) is int and t >= 0 for t in value)  # bool is no token id
    )


def token_ids_prompt(path: str, body: dict[str, Any]) -> Prompt | None:
    """The default :data:`Tokenize`: a ``/v1/completions`` body whose ``prompt`` is a list of
    token ids (or a list of such lists: the first, as the batch's first request), with its
    ``model`` and ``cache_salt``; None for anything else (text prompts, chat messages), which
    needs the model's tokenizer."""
    if path.rstrip("/") != "/v1/completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not _is_token_ids(prompt):
        return None
    model, salt = body.get("model"), body.get("cache_salt")
    return Prompt(
        model=model if isinstance(model, str) else None,
        token_ids=prompt,
        cache_salt=salt if isinstance(salt, str) and salt else None,
    )


@dataclass(frozen=True)
class Weights:
    """How a candidate's prefix hit and load blend into its score (the highest wins):
    ``prefix * hit_fraction - queue * q / (q + queue_half) - kv * kv_usage``, with ``q`` the
    requests waiting at the replica (plus picks since its last scrape). ``queue_half`` is the
    queue that costs half of ``queue``: the penalty grows fast for the first waiting
    requests and saturates below ``queue``.

    The defaults are provisional, chosen by reasoning, not benchmarked yet. ``queue`` is twice
    ``prefix`` so that a deep enough queue outweighs even a whole prompt cached: a replica
    holding the whole prompt keeps it against an idle one until about 8 requests wait there
    (``queue_half``); a quarter of the prompt cached loses to a queue of 2 or more; a full KV
    cache costs as much as a queue of about 3."""

    prefix: float = 1.0
    queue: float = 2.0
    kv: float = 0.5
    queue_half: float = 8.0

    def __post_init__(self) -> None:
        for name in ("prefix", "queue", "kv"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"weight {name} must be a finite number >= 0, got {value!r}")
        half = self.queue_half
        if not (isinstance(half, (int, float)) and math.isfinite(half) and half > 0):
            raise ValueError(f"queue_half must be a finite number > 0, got {half!r}")


@dataclass(frozen=True)
class Settings:
    """The picker's settings: the blend (:class:`Weights`); how often each replica's
    ``/metrics`` is scraped (a replica whose last good scrape is older than 3 intervals is no
    candidate until one succeeds again); the shedding limit (every candidate with more than
    ``shed_waiting`` waiting requests: 429; None: never shed); the most body bytes parsed
    (a larger body is routed on load alone); how many recent decisions are kept for
    inspection."""

    weights: Weights = field(default_factory=Weights)
    scrape_interval: float = 1.0
    shed_waiting: float | None = None
    max_body: int = 4 << 20
    decisions_kept: int = 1000
    grpc_workers: int = 64

    def __post_init__(self) -> None:
        interval = self.scrape_interval
        if not (isinstance(interval, (int, float)) and math.isfinite(interval) and interval > 0):
            raise ValueError(f"scrape_interval must be a number of seconds > 0, got {interval!r}")
        shed = self.shed_waiting
        if shed is not None and not (isinstance(shed, (int, float)) and shed >= 0):
            raise ValueError(f"shed_waiting must be a number >= 0 or None, got {shed!r}")
        for name in ("max_body", "decisions_kept", "grpc_workers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def stale_after(self) -> float:
        """Seconds after its last good scrape that a replica stops being a candidate."""
        return 3 * self.scrape_interval


def endpoint_of(url: str) -> str:
    """The ``ip:port`` (``[ip]:port`` for IPv6) Envoy connects to for a replica's URL; a host
    name is resolved once, here (Envoy's original-destination routing takes addresses)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in the replica url {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"bad port in the replica url {url!r}") from None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise ValueError(f"cannot resolve the replica url {url!r}: {error}") from None
        address = ipaddress.ip_address(found[0][4][0])
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


# -- replica load -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLoad:
    """What one scrape of a vLLM replica's ``/metrics`` said (summed over its engines; the KV
    cache usage averaged)."""

    running: float
    waiting: float
    kv_usage: float


#: vLLM's metric names (vllm/v1/metrics/loggers.py).
_RUNNING, _WAITING, _KV_USAGE = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def parse_vllm_metrics(text: str) -> ReplicaLoad:
    """A replica's load from its Prometheus text exposition (ValueError where it is not that
    text, or lacks one of the three metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {_RUNNING: [], _WAITING: [], _KV_USAGE: []}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name].append(float(sample.value))
    except Exception as error:  # the parser raises ValueError, and others on odd text
        raise ValueError(f"not Prometheus text: {error}") from None
    missing = [name for name, values in found.items() if not values]
    if missing:
        raise ValueError(f"no {', '.join(missing)} in the replica's metrics")
    if not all(math.isfinite(v) and v >= 0 for values in found.values() for v in values):
        raise ValueError("negative or non-finite vLLM metrics")
    kv = found[_KV_USAGE]
    return ReplicaLoad(
        running=sum(found[_RUNNING]),
        waiting=sum(found[_WAITING]),
        kv_usage=min(sum(kv) / len(kv), 1.0),
    )


@dataclass
class _Slot:
    load: ReplicaLoad | None = None
    scraped_at: float | None = None  # time.monotonic() of the last good scrape
    inflight: int = 0  # picks since that scrape
    scrapes: int = 0
    failures: int = 0
    last_error: str | None = None


class LoadBoard:
    """Each replica's load, scraped from its ``/metrics`` every ``interval`` seconds on a
    thread of its own (a slow replica delays no other), with the picks sent to it since its
    last scrape (:meth:`picked`), so that a burst between two scrapes spreads out."""

    def __init__(self, urls: Mapping[str, str], interval: float, stale_after: float) -> None:
        self.urls = dict(urls)
        self.interval, self.stale_after = interval, stale_after
        self._slots = {name: _Slot() for name in self.urls}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first_round = {name: threading.Event() for name in self.urls}
        self._threads: list[threading.Thread] = []
        self._started = False

    def start(self) -> None:
        self._started = True
        for name, url in self.urls.items():
            self._start(name, url)

    def _start(self, name: str, url: str) -> None:
        thread = threading.Thread(
            target=self._follow, args=(name, url), name=f"kvblocks-picker-scrape-{name}"
        )
        thread.daemon = True
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)

    def set_urls(self, urls: Mapping[str, str]) -> None:
        """The fleet changed: a replica gone is no longer scraped (nor a candidate), a new
        one (or one whose url changed) starts unscraped, so not a candidate until its first
        good scrape; the others keep their load."""
        with self._lock:
            fresh = {name: url for name, url in urls.items() if self.urls.get(name) != url}
            for name in set(self.urls) - set(urls):
                del self._slots[name], self._first_round[name]
            for name in fresh:
                self._slots[name] = _Slot()
                self._first_round[name] = threading.Event()
            self.urls = dict(urls)
        if self._started:
            for name, url in fresh.items():
                self._start(name, url)

    def wait_first_round(self, timeout: float) -> bool:
        """Waits until every replica has been scraped once (well or not); whether it was."""
        deadline = time.monotonic() + timeout
        with self._lock:
            events = list(self._first_round.values())
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.interval + 5)

    def scrape(self, name: str) -> None:
        """Scrapes one replica now (the threads call it every interval)."""
        url = self.urls.get(name)
        if url is None:
            return  # no longer in the fleet
        url = url.rstrip("/") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=max(self.interval, 0.05)) as response:
                load = parse_vllm_metrics(response.read(4 << 20).decode("utf-8", "replace"))
        except Exception as error:  # OSError, HTTPError, ValueError: this scrape failed
            with self._lock:
                failed = self._slots.get(name)
                if failed is not None:
                    failed.failures += 1
                    failed.last_error = f"{type(error).__name__}: {error}"
            return
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                return
            slot.load, slot.scraped_at, slot.inflight = load, time.monotonic(), 0
            slot.scrapes += 1
            slot.last_error = None

    def _follow(self, name: str, url: str) -> None:
        while not self._stop.is_set() and self.urls.get(name) == url:
            started = time.monotonic()
            self.scrape(name)
            with self._lock:
                first = self._first_round.get(name)
            if first is not None:
                first.set()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def picked(self, name: str) -> None:
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None:
                slot.inflight += 1

    def ready(self, now: float | None = None) -> dict[str, tuple[ReplicaLoad, int]]:
        """The replicas whose last good scrape is recent enough, with that load and the picks
        since."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {
                name: (slot.load, slot.inflight)
                for name, slot in self._slots.items()
                if slot.load is not None
                and slot.scraped_at is not None
                and now - slot.scraped_at <= self.stale_after
            }

    def state(self) -> dict[str, dict[str, Any]]:
        """Per replica: its last load, the seconds since it was scraped well, the picks since,
        whether it is a candidate, its scrape counts and last error."""
        now = time.monotonic()
        ready = self.ready(now)
        with self._lock:
            return {
                name: {
                    "load": slot.load,
                    "age": None if slot.scraped_at is None else now - slot.scraped_at,
                    "inflight": slot.inflight,
                    "ready": name in ready,
                    "scrapes": slot.scrapes,
                    "failures": slot.failures,
                    "last_error": slot.last_error,
                }
                for name, slot in self._slots.items()
            }


# -- decisions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One request's outcome: ``routed`` (to ``replica`` at ``endpoint``), or an immediate
    answer with ``status`` (``unknown_model`` 404, ``no_endpoint`` 503, ``shed`` 429;
    ``error`` 500: the picker itself failed).
    ``unscored`` says why the prefix did not count (``no_body``, ``too_large``,
    ``bad_json``, ``untokenizable``, ``tokenizer_error``, ``unscorable``), None where it did;
    ``scores`` holds each candidate's blended score."""

    outcome: str
    status: int | None
    replica: str | None = None
    endpoint: str | None = None
    request_id: str | None = None
    path: str = ""
    model: str | None = None
    prompt_tokens: int = 0
    hit_tokens: int | None = None
    unscored: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    message: str = ""


#: The OpenAI-style error type and code of each immediate answer.
_ERRORS = {
    "unknown_model": (404, "NotFoundError", "model_not_found"),
    "no_endpoint": (503, "ServiceUnavailableError", "no_ready_endpoint"),
    "shed": (429, "RateLimitError", "overloaded"),
    "error": (500, "InternalServerError", "picker_error"),
}


class EndpointPicker:
    """The decisions, transport aside: :meth:`decide` takes a request's path, body and subset
    hint and answers a :class:`Decision`; the gRPC side (:func:`serve`) carries them to and
    from Envoy. Keeps the last ``settings.decisions_kept`` decisions (``decisions``) and its
    Prometheus metrics in ``registry``."""

    def __init__(
        self,
        fleet: Fleet,
        service: RouteService,
        *,
        tokenize: Tokenize = token_ids_prompt,
        settings: Settings | None = None,
        board: LoadBoard | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.service = service
        self.tokenize = tokenize
        self._set_fleet(fleet)
        self.board = board or LoadBoard(
            self._urls, self.settings.scrape_interval, self.settings.stale_after
        )
        self.decisions: collections.deque[Decision] = collections.deque(
            maxlen=self.settings.decisions_kept
        )
        self.feed_batch_at: dict[str, float] = {}
        self._metrics()

    def _set_fleet(self, fleet: Fleet) -> None:
        """The fleet's replicas, endpoints and order, each replaced whole (a decision in
        flight reads either the old or the new). A ValueError, changing nothing, where a
        replica has no url or one that names no endpoint."""
        endpoints: dict[str, str] = {}
        for spec in fleet.replicas:
            if spec.url is None:
                raise ValueError(f"replica {spec.name!r} has no url: the picker routes to urls")
            endpoints[spec.name] = endpoint_of(spec.url)
        self._urls = {spec.name: spec.url for spec in fleet.replicas if spec.url is not None}
        self.replicas: dict[str, ReplicaSpec] = {spec.name: spec for spec in fleet.replicas}
        self.endpoints = endpoints
        self._order = {name: i for i, name in enumerate(self.replicas)}

    def reload(self, fleet: Fleet) -> None:
        """Makes ``fleet`` the picker's fleet: its replicas, their endpoints and load
        scrapes, and (through :meth:`RouteService.reload`) the index and the KV event feeds.
        A ValueError, changing nothing, where the fleet cannot be routed to."""
        self._set_fleet(fleet)
        self.board.set_urls(self._urls)
        self.service.reload(fleet)

    def _metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self._decided = Counter(
            "kvblocks_picker_decisions", "Decisions by outcome.", ["outcome"], registry=r
        )
        self._picks = Counter(
            "kvblocks_picker_picks", "Requests routed to each replica.", ["replica"], registry=r
        )
        self._hit_tokens = Counter(
            "kvblocks_picker_predicted_hit_tokens",
            "Prompt tokens predicted cached at the chosen replica.",
            registry=r,
        )
        self._prompt_tokens = Counter(
            "kvblocks_picker_prompt_tokens", "Prompt tokens of the routed requests.", registry=r
        )
        self._tokenize_seconds = Histogram(
            "kvblocks_picker_tokenize_seconds",
            "Seconds spent turning a body into token ids.",
            buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self._unscored = Counter(
            "kvblocks_picker_unscored_bodies",
            "Requests routed on load alone, by why their prefix could not be scored.",
            ["reason"],
            registry=r,
        )
        r.register(cast("Collector", _StateCollector(self)))

    # -- the decision --------------------------------------------------------------------

    def _read_body(
        self, body: bytes | None, too_large: bool
    ) -> tuple[dict[str, Any] | None, str | None]:
        if too_large or (body is not None and len(body) > self.settings.max_body):
            return None, "too_large"
        if not body:
            return None, "no_body"
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, deep nesting
            return None, "bad_json"
        if not isinstance(fields, dict):
            return None, "bad_json"
        return fields, None

    def decide(
        self,
        path: str,
        body: bytes | None,
        *,
        subset: Sequence[str] | None = None,
        request_id: str | None = None,
        too_large: bool = False,
    ) -> Decision:
        """Where the request goes (see the module's documentation). ``subset``: the hint's
        endpoints (None: no hint); ``too_large``: the body was cut short. Never raises for
        what a client sends."""
        path = path.split("?", 1)[0]
        fields, unscored = self._read_body(body, too_large)
        prompt: Prompt | None = None
        if fields is not None:
            started = time.perf_counter()
            try:
                prompt = self.tokenize(path, fields)
            except Exception:  # a tokenizer's failure is the request's, not the picker's
                unscored = "tokenizer_error"
            self._tokenize_seconds.observe(time.perf_counter() - started)
            if prompt is None and unscored is None:
                unscored = "untokenizable"
        # The name the request gives (a served model or a LoRA adapter), as vLLM checks it.
        model = fields.get("model") if fields is not None else None
        if not isinstance(model, str) or not model:
            model = prompt.model if prompt is not None and prompt.model else None
        common: dict[str, Any] = {"request_id": request_id, "path": path, "model": model}

        served = [
            name
            for name, spec in self.replicas.items()
            if model is None or spec.models is None or model in spec.models
        ]
        if not served:
            return self._refuse("unknown_model", f"The model `{model}` does not exist.", common)
        if subset is not None:
            allowed = set(subset)
            served = [name for name in served if self.endpoints[name] in allowed]
        ready = self.board.ready()
        candidates = [name for name in served if name in ready]
        if not candidates:
            why = "no ready endpoint" + (" in the subset hint" if subset is not None else "")
            return self._refuse("no_endpoint", f"{why} for this request", common)
        queues = {name: ready[name][0].waiting + ready[name][1] for name in candidates}
        shed = self.settings.shed_waiting
        if shed is not None and all(q > shed for q in queues.values()):
            return self._refuse(
                "shed", f"every replica has more than {shed:g} requests waiting", common
            )

        hits: dict[str, int | None] = {}
        tokens = 0
        if prompt is not None:
            tokens = len(prompt.token_ids)
            lora_path = prompt.lora_path
            if prompt.lora_name is not None and lora_path is None:
                unscored = "unscorable"  # vLLM hashes the adapter's path too
            else:
                query: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
                if prompt.cache_salt is not None:
                    query["cache_salt"] = prompt.cache_salt
                if prompt.lora_name is not None:
                    query["lora_name"], query["lora_path"] = prompt.lora_name, lora_path
                try:
                    hits = self.service.score(query)["scores"]
                except (ValueError, TypeError, OverflowError):  # token ids out of range, ...
                    unscored = "unscorable"
        w = self.settings.weights
        scores: dict[str, float] = {}
        for name in candidates:
            load, _ = ready[name]
            hit = hits.get(name) or 0
            q = queues[name]
            scores[name] = (
                w.prefix * (hit / tokens if tokens else 0.0)
                - w.queue * q / (q + w.queue_half)
                - w.kv * load.kv_usage
            )
        # Ties: the shorter queue, then the fleet's order.
        best = max(candidates, key=lambda n: (scores[n], -queues[n], -self._order[n]))
        self.board.picked(best)
        hit_tokens = hits.get(best) if prompt is not None and unscored is None else None
        decision = Decision(
            outcome="routed",
            status=None,
            replica=best,
            endpoint=self.endpoints[best],
            prompt_tokens=tokens,
            hit_tokens=hit_tokens,
            unscored=unscored,
            scores=scores,
            **common,
        )
        self._decided.labels("routed").inc()
        self._picks.labels(best).inc()
        if unscored is not None:
            self._unscored.labels(unscored).inc()
        else:
            self._prompt_tokens.inc(tokens)
            self._hit_tokens.inc(hit_tokens or 0)
        self.decisions.append(decision)
        return decision

    def count_error(self, decision: Decision) -> None:
        """Counts and keeps a decision that failed (``error``: an immediate 500)."""
        self._decided.labels(decision.outcome).inc()
        self.decisions.append(decision)

    def _refuse(self, outcome: str, message: str, common: dict[str, Any]) -> Decision:
        status = _ERRORS[outcome][0]
        decision = Decision(outcome=outcome, status=status, message=message, **common)
        self._decided.labels(outcome).inc()
        self.decisions.append(decision)
        return decision

    # -- what the gRPC side answers --------------------------------------------------------

    def error_body(self, decision: Decision) -> bytes:
        """The immediate answer's body: an OpenAI-style ``{"error": {...}}``."""
        _, kind, code = _ERRORS[decision.outcome]
        param = "model" if decision.outcome == "unknown_model" else None
        error = {"message": decision.message, "type": kind, "param": param, "code": code}
        return json.dumps({"error": error}).encode()


class _StateCollector:
    """The picker's gauges read at scrape time: each replica's load and candidacy, and each
    KV event feed's progress."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvblocks_picker_{name}", doc, labels=["replica"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvblocks_picker_{name}", doc, labels=["replica"])

        ready = gauge("replica_ready", "1 if the replica is a candidate (fresh load).")
        waiting = gauge("replica_waiting", "Requests waiting at the replica (last scrape).")
        running = gauge("replica_running", "Requests running at the replica (last scrape).")
        kv = gauge("replica_kv_usage", "The replica's KV cache usage, 0 to 1 (last scrape).")
        inflight = gauge("replica_inflight_picks", "Picks sent to it since its last scrape.")
        age = gauge("replica_scrape_age_seconds", "Seconds since its last good scrape.")
        failures = counter("replica_scrape_failures", "Scrapes of its /metrics that failed.")
        for name, state in self.picker.board.state().items():
            ready.add_metric([name], 1.0 if state["ready"] else 0.0)
            inflight.add_metric([name], state["inflight"])
            failures.add_metric([name], state["failures"])
            if state["load"] is not None:
                waiting.add_metric([name], state["load"].waiting)
                running.add_metric([name], state["load"].running)
                kv.add_metric([name], state["load"].kv_usage)
            if state["age"] is not None:
                age.add_metric([name], state["age"])
        yield from (ready, waiting, running, kv, inflight, age, failures)

        feeds = dict(self.picker.service.feeds)  # a reload may change it meanwhile
        batches = counter("feed_batches", "KV event batches applied.")
        resyncs = counter("feed_resyncs", "Feed gaps replay could not fill (replica cleared).")
        restarts = counter("feed_restarts", "Replica restarts seen on the feed.")
        malformed = counter("feed_malformed", "Malformed feed messages and batches.")
        replayed = counter("feed_replayed", "Batches recovered through the replay endpoint.")
        last_seq = gauge("feed_last_seq", "Sequence number of the last batch applied.")
        lag = gauge("feed_last_batch_age_seconds", "Seconds since the feed applied a batch.")
        now = time.monotonic()
        for name, feed in feeds.items():
            batches.add_metric([name], feed.batches)
            resyncs.add_metric([name], feed.resyncs)
            restarts.add_metric([name], feed.restarts)
            malformed.add_metric([name], feed.malformed)
            replayed.add_metric([name], feed.replayed)
            if feed.last_seq is not None:
                last_seq.add_metric([name], feed.last_seq)
            at = self.picker.feed_batch_at.get(name)
            if at is not None:
                lag.add_metric([name], now - at)
        yield from (batches, resyncs, restarts, malformed, replayed, last_seq, lag)


# -- the ext_proc stream ----------------------------------------------------------------------


def _header_values(headers: Any) -> dict[str, str]:
    """An ext_proc ``HeaderMap`` as a dict (Envoy sends ``raw_value`` bytes; older ones
    ``value``)."""
    out: dict[str, str] = {}
    for header in headers.headers:
        raw = header.raw_value
        out[header.key.lower()] = raw.decode("utf-8", "replace") if raw else header.value
    return out


def _subset_hint(request: Any) -> list[str] | None:
    """The subset hint's endpoints, or None where the request carries none."""
    if not request.HasField("metadata_context"):
        return None
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value]
    if kind == "string_value":  # tolerated: "ip:port,ip:port"
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


class _Stream:
    """One HTTP request's ext_proc stream: collects the headers and body, asks the picker,
    answers in the form the body mode needs."""

    def __init__(self, picker: EndpointPicker, protos: Any) -> None:
        self.picker, self.pb = picker, protos
        self.mode = _BUFFERED  # what an Envoy that does not say (no protocol_config) uses
        self.path = ""
        self.request_id: str | None = None
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False

    def on(self, request: Any) -> list[Any]:
        """The responses to one ProcessingRequest (``done`` set once the picker answered)."""
        pb = self.pb.ext_proc
        if request.HasField("protocol_config"):
            self.mode = request.protocol_config.request_body_mode
        hint = _subset_hint(request)
        if hint is not None:
            self.subset = hint
        which = request.WhichOneof("request")
        if which == "request_headers":
            headers = _header_values(request.request_headers.headers)
            self.path = headers.get(":path", "")
            self.request_id = headers.get("x-request-id")
            if request.request_headers.end_of_stream or self.mode in (_NONE, _STREAMED):
                # No body will come (or it would come after the headers are answered, when
                # they can no longer change): decided on the headers.
                return self._answer("headers", None)
            if self.mode == _FULL_DUPLEX:
                return []  # answered once the body is in
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if which == "request_body":
            chunk = request.request_body
            self.size += len(chunk.body)
            if self.mode == _FULL_DUPLEX or self.size <= self.picker.settings.max_body:
                self.chunks.append(chunk.body)  # full duplex sends every byte back
            if chunk.end_of_stream or self.mode in (_BUFFERED, _BUFFERED_PARTIAL):
                # A buffered body comes in one message (not marked as the end where trailers
                # follow): decided on it.
                return self._answer("body", b"".join(self.chunks))
            if self.mode == _FULL_DUPLEX:
                return []
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        if which == "request_trailers":
            return self._answer("trailers", b"".join(self.chunks))
        # A phase the picker does not process (response headers, body, trailers): passed on.
        empty = {
            "response_headers": pb.HeadersResponse,
            "response_body": pb.BodyResponse,
            "response_trailers": pb.TrailersResponse,
        }.get(which or "")
        return [] if empty is None else [pb.ProcessingResponse(**{which: empty()})]

    def _answer(self, phase: str, body: bytes | None) -> list[Any]:
        pb = self.pb.ext_proc
        self.done = True
        decision = self.picker.decide(
            self.path,
            body,
            subset=self.subset,
            request_id=self.request_id,
            too_large=self.size > self.picker.settings.max_body,
        )
        if decision.status is not None:
            return [self._immediate(decision)]
        assert decision.endpoint is not None
        option = self.pb.base.HeaderValueOption(
            header=self.pb.base.HeaderValue(key=DESTINATION, raw_value=decision.endpoint.encode()),
            append_action=self.pb.base.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[option]))
        metadata = self.pb.struct.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: decision.endpoint}})
        if self.mode == _FULL_DUPLEX and phase != "headers":
            # The headers are answered now, then the body held so far goes back unchanged.
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                ),
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(
                        response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(
                                streamed_response=pb.StreamedBodyResponse(
                                    body=body or b"", end_of_stream=phase == "body"
                                )
                            )
                        )
                    )
                ),
            ]
            if phase == "trailers":
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
            return out
        if phase == "headers":
            response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
        elif phase == "body":
            response = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        else:  # trailers, the headers long gone: the metadata alone can carry the choice
            response = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        response.dynamic_metadata.CopyFrom(metadata)
        return [response]

    def failed(self) -> Any:
        """The answer when deciding raised: an immediate 500, counted."""
        self.done = True
        decision = Decision(
            outcome="error",
            status=500,
            request_id=self.request_id,
            path=self.path,
            message="the endpoint picker failed on this request",
        )
        self.picker.count_error(decision)
        return self._immediate(decision)

    def _immediate(self, decision: Decision) -> Any:
        pb = self.pb.ext_proc
        content_type = self.pb.base.HeaderValueOption(
            header=self.pb.base.HeaderValue(key="content-type", raw_value=b"application/json"),
            append_action=self.pb.base.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        return pb.ProcessingResponse(
            immediate_response=pb.ImmediateResponse(
                status=self.pb.http_status.HttpStatus(code=decision.status),
                headers=pb.HeaderMutation(set_headers=[content_type]),
                body=self.picker.error_body(decision),
                details=f"kvblocks_picker_{decision.outcome}",
            )
        )


@dataclass(frozen=True)
class _Protos:
    ext_proc: Any
    base: Any
    struct: Any
    http_status: Any


def _protos() -> _Protos:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from envoy.type.v3 import http_status_pb2
    from google.protobuf import struct_pb2

    return _Protos(external_processor_pb2, base_pb2, struct_pb2, http_status_pb2)


class _ExternalProcessor:
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one stream per HTTP request, closed by
    the picker once it has answered (Envoy then processes the rest of the request without
    it: the filter's response phases are expected to be skipped)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.protos = _protos()

    def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        stream = _Stream(self.picker, self.protos)
        for request in requests:
            try:
                responses = stream.on(request)
            except Exception:  # a bug (or a plugged-in tokenizer's odd answer): a clear 500
                _log.exception("kvblocks picker: the decision failed")
                yield stream.failed()
                return
            yield from responses
            if stream.done:
                return


# -- serving ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningPicker:
    """A picker :func:`serve` started: its decisions, the route service (its index) and the
    addresses it serves on."""

    picker: EndpointPicker
    service: RouteService
    grpc_address: str
    metrics_address: str | None
    #: What the snapshot restored, per replica (empty without one).
    restored: dict[str, str] = field(default_factory=dict)
    snapshot: SnapshotFile | None = None


@contextmanager
def serve(
    fleet: Fleet,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 9002,
    metrics_port: int | None = 9090,
    tokenize: Tokenize = token_ids_prompt,
    settings: Settings | None = None,
    snapshot: str | Path | None = None,
    snapshot_interval: float = 60.0,
) -> Iterator[RunningPicker]:
    """Runs the picker until the ``with`` block ends: the gRPC server (ext_proc and health),
    the replicas' load scrapes, the KV event feeds' polling and the metrics HTTP server
    (``metrics_port=None``: none). Port 0: a free one (in the addresses). The first round of
    scrapes is waited for (one interval at most) before readiness is reported. With
    ``snapshot``, the index starts from that file and is saved there, as for
    :func:`kvblocks.router.scorer.serve`."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prometheus_client import start_http_server

    settings = settings or Settings()
    service = RouteService(fleet)
    snapshots = None if snapshot is None else SnapshotFile(service, snapshot, snapshot_interval)
    restored = {} if snapshots is None else snapshots.restore()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    server: Any = None
    metrics_server: Any = None
    picker: EndpointPicker | None = None
    try:
        picker = EndpointPicker(fleet, service, tokenize=tokenize, settings=settings)
        picker.board.start()

        def follow() -> None:
            assert picker is not None
            seen: dict[str, int] = {}
            while not stop.is_set():
                if not service.feeds:
                    service.poll(0)  # a reload asked for
                    stop.wait(0.2)
                    continue
                if service.poll(50):
                    now = time.monotonic()
                    for name, feed in list(service.feeds.items()):
                        if feed.batches != seen.get(name):
                            seen[name] = feed.batches
                            picker.feed_batch_at[name] = now
                if snapshots is not None:
                    snapshots.due()

        feeds = threading.Thread(target=follow, name="kvblocks-picker-feeds", daemon=True)
        feeds.start()
        threads.append(feeds)

        server = grpc.server(
            ThreadPoolExecutor(settings.grpc_workers, thread_name_prefix="kvblocks-picker"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
            ],
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            _ExternalProcessor(picker), server
        )
        checker = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        checker.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        for name in ("", "readiness", HEALTH_SERVICES[3]):
            checker.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        bound = server.add_insecure_port(_join(host, grpc_port))
        if not bound:
            raise OSError(f"cannot listen on {_join(host, grpc_port)} for gRPC")
        server.start()
        metrics_address = None
        if metrics_port is not None:
            metrics_server, _ = start_http_server(metrics_port, host, registry=picker.registry)
            metrics_address = _join(host, metrics_server.server_address[1])
        picker.board.wait_first_round(settings.scrape_interval + 1)
        for name in HEALTH_SERVICES:
            checker.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = _join(host, bound)
        yield RunningPicker(picker, service, address, metrics_address, restored, snapshots)
    finally:
        stop.set()
        if server is not None:
            server.stop(grace=1).wait(5)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        if picker is not None:
            picker.board.close()
        for thread in threads:
            thread.join(5)
        if snapshots is not None:
            snapshots.save()
        service.close()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the command ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvblocks.router.picker",
        description="kvblocks as the Gateway API Inference Extension's endpoint picker "
        "(Envoy ext_proc over gRPC) for a fleet of vLLM replicas.",
    )
    p.add_argument("fleet", help="the fleet's JSON file (see kvblocks.router.fleet)")
    add_snapshot_arguments(p)
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a served model and its directory, whose tokenizer renders text and chats as "
        "vLLM does (repeatable; without any, only token-id prompts are scored)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=MODEL=PATH",
        help="a LoRA adapter, its base model's served name and the path its replicas load",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (0: any)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (0: any)")
    defaults, weights = Settings(), Weights()
    p.add_argument("--scrape-interval", type=float, default=defaults.scrape_interval)
    p.add_argument("--shed-waiting", type=float, default=None, help="429 above this queue")
    p.add_argument("--max-body", type=int, default=defaults.max_body)
    p.add_argument("--w-prefix", type=float, default=weights.prefix)
    p.add_argument("--w-queue", type=float, default=weights.queue)
    p.add_argument("--w-kv", type=float, default=weights.kv)
    p.add_argument("--queue-half", type=float, default=weights.queue_half)
    return p


def _tokenizer(models: Sequence[str], loras: Sequence[str]) -> Tokenize:
    """The picker's tokenizer from ``--model NAME=DIR`` and ``--lora NAME=MODEL=PATH``:
    :class:`kvblocks.router.openai.Tokenizers` (transformers needed), or the token-id prompt
    reader without models. A ValueError names a malformed option."""
    if not models:
        return token_ids_prompt
    from kvblocks.router.openai import Tokenizers

    served: dict[str, str] = {}
    for option in models:
        name, sep, path = option.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--model takes NAME=DIR, got {option!r}")
        served[name] = path
    adapters: dict[str, str | tuple[str, str]] = {}
    for option in loras:
        parts = option.split("=", 2)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"--lora takes NAME=MODEL=PATH, got {option!r}")
        adapters[parts[0]] = (parts[1], parts[2])
    return Tokenizers(served, adapters).prompt_of


def main(argv: Sequence[str] | None = None) -> int:
    """Serves until SIGTERM or SIGINT (status 0; ``kvblocks._signals``); prints ``listening
    grpc=HOST:PORT metrics=HOST:PORT`` once serving. Status 2 for a bad fleet or setting."""
    from kvblocks._signals import ReloadSignal, StopSignals

    stop = StopSignals()
    hup = ReloadSignal()
    args = _parser().parse_args(argv)
    try:
        fleet_file = FleetFile(args.fleet)
        fleet = fleet_file.load()
        tokenize = _tokenizer(args.model, args.lora)
        settings = Settings(
            weights=Weights(args.w_prefix, args.w_queue, args.w_kv, args.queue_half),
            scrape_interval=args.scrape_interval,
            shed_waiting=args.shed_waiting,
            max_body=args.max_body,
        )
    except (OSError, ValueError, ImportError) as error:  # ImportError: no transformers
        print(f"kvblocks picker: {error}", file=sys.stderr)
        return 2
    if stop.received is not None:  # stopped while starting: nothing to serve
        stop.wait()
        return 0
    try:
        with serve(
            fleet,
            host=args.host,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            settings=settings,
            tokenize=tokenize,
            snapshot=args.snapshot,
            snapshot_interval=args.snapshot_interval,
        ) as running:
            report_restored(running.restored, running.snapshot, "kvblocks picker")
            print(f"listening grpc={running.grpc_address} metrics={running.metrics_address}")
            sys.stdout.flush()
            follow_fleet_file(fleet_file, stop, hup, running.picker.reload, "kvblocks picker")
    except ImportError as error:  # grpcio, xds-protos, ... missing
        from kvblocks._install import install_hint

        print(f"kvblocks picker: {error}; {install_hint('gateway')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:
        print(f"kvblocks picker: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
