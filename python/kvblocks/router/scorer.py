"""``kvblocks route``: a small HTTP service that answers best-replica queries for a fleet of
vLLM replicas (:mod:`kvblocks.router.fleet`) from a live
:class:`kvblocks.router.index.RoutingIndex`, for those without a router of their own (a
router that takes a Python scorer passes ``RoutingIndex.score`` instead).

Endpoints (JSON in, JSON out):

- ``POST /score`` with ``{"prompt_token_ids": [...]}`` and optionally ``cache_salt``,
  ``lora_name`` with ``lora_path`` (vLLM's ``LoRARequest`` fields, which vLLM hashes) and
  ``medium`` (``"GPU"``, or ``"CPU"`` for the offloading tier): ``{"scores": {name: tokens
  or null}, "best": name or null, "url": the best replica's url or null}``; with
  ``"return_block_hashes": true`` also ``block_hashes``, the prompt's block hashes (hex) as
  the best replica's engine computes them, for the router to forward with the request
  (vLLM 0.34's ``EngineCoreRequest.block_hashes``);
- ``GET /replicas``: per replica its url, blocks held and feed state (last sequence number,
  batches replayed, resyncs, restarts, malformed messages), and the index's counts;
- ``GET /health``: ``{"status": "ok"}``.

Bad requests get a 400 with ``{"error": ...}``; the service goes on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvblocks.router.feeds import ReplicaFeed
from kvblocks.router.fleet import Fleet, ReplicaSpec
from kvblocks.router.index import GPU, RoutingIndex

__all__ = ["RouteService", "Running", "serve"]

#: The most bytes a request body may have (a 2,000-token prompt is about 12 kB of JSON).
MAX_BODY = 16 << 20
#: What a snapshot of the service's index says it is (:meth:`RouteService.snapshot`).
SNAPSHOT_FORMAT = "kvblocks-router-snapshot/1"


def _identity(spec: ReplicaSpec) -> str:
    """What must not change for a replica's saved blocks to be its blocks: its engine's
    hashing, its layout and its event stream."""
    config = sorted(vars(spec.prefix_hash_config).items())
    return repr((config, spec.layout, spec.events))


class RouteService:
    """The index, one feed per replica with an event endpoint, and the answers the HTTP
    endpoints give. :meth:`poll` applies what the feeds received; :meth:`score` and
    :meth:`replicas` answer (all under one lock, so that an answer never sees half a
    batch). :meth:`reload` changes the fleet at run time."""

    def __init__(self, fleet: Fleet) -> None:
        self.index = RoutingIndex()
        self.urls: dict[str, str | None] = {}
        self.feeds: dict[str, ReplicaFeed] = {}
        self.specs: dict[str, ReplicaSpec] = {}
        #: Fleet changes applied (each: the replicas added, removed and changed), and the
        #: last one that failed, if any.
        self.reloads: list[dict[str, list[str]]] = []
        self.reload_error: str | None = None
        self._lock = threading.Lock()
        self._pending: Fleet | None = None
        # One poller over every feed's socket: poll() waits on all of them at once.
        self._poller: Any = None
        self._by_socket: dict[Any, ReplicaFeed] = {}
        try:
            self._change_fleet(fleet)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()

    def reload(self, fleet: Fleet) -> None:
        """Makes ``fleet`` the fleet, at the next :meth:`poll` (the thread that polls the
        feeds owns their sockets): a replica no longer in it is forgotten and its feed
        stopped; a new one is registered and followed; one whose entry changed is
        registered again (its blocks forgotten; its feed starts over, through the replay
        endpoint where the replica keeps its batches); the others go on untouched."""
        with self._lock:
            self._pending = fleet

    def _reload_now(self) -> None:
        with self._lock:
            fleet, self._pending = self._pending, None
            if fleet is None:
                return
            try:
                self.reloads.append(self._change_fleet(fleet))
                self.reload_error = None
            except Exception as error:  # an endpoint zmq refuses, ...: the rest goes on
                self.reload_error = f"{type(error).__name__}: {error}"

    def _change_fleet(self, fleet: Fleet) -> dict[str, list[str]]:
        wanted = {spec.name: spec for spec in fleet.replicas}
        removed = [name for name in self.specs if name not in wanted]
        changed = [n for n in self.specs if n in wanted and wanted[n] != self.specs[n]]
        added = [name for name in wanted if name not in self.specs]
        for name in removed + changed:
            self._remove(name)
        for name in changed + added:
            self._add(wanted[name])
        return {"added": added, "removed": removed, "changed": changed}

    def _add(self, spec: ReplicaSpec) -> None:
        """Registers and follows one replica, or (raising) leaves it out altogether."""
        self.index.add_replica(spec.name, spec.prefix_hash_config, spec.layout)
        feed = None
        if spec.events is not None:
            try:
                feed = ReplicaFeed(self.index, spec.name, spec.events, replay_endpoint=spec.replay)
            except BaseException:
                self.index.remove_replica(spec.name)
                raise
        self.specs[spec.name] = spec
        self.urls[spec.name] = spec.url
        if feed is None:
            return
        self.feeds[spec.name] = feed
        import zmq

        if self._poller is None:
            self._poller = zmq.Poller()
        self._poller.register(feed.socket, zmq.POLLIN)
        self._by_socket[feed.socket] = feed

    def _remove(self, name: str) -> None:
        feed = self.feeds.pop(name, None)
        if feed is not None:
            self._poller.unregister(feed.socket)
            del self._by_socket[feed.socket]
            feed.close()
        self.index.remove_replica(name)
        del self.specs[name], self.urls[name]

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies a :meth:`reload` asked for, then waits up to ``timeout_ms`` for any feed
        to receive a batch (without the lock, so that queries go on meanwhile) and applies
        what the ready feeds received; returns how many batches."""
        self._reload_now()
        if not self._by_socket:
            return 0
        applied = 0
        for socket, _ in self._poller.poll(timeout_ms):
            with self._lock:
                feed = self._by_socket.get(socket)
                if feed is not None:
                    applied += feed.poll(0)
        return applied

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The index's blocks per replica, with each feed's last sequence number (msgpack):
        what :meth:`restore` takes back in a new process, so that a restart loses nothing
        the replicas' replay endpoints still hold."""
        import msgspec

        with self._lock:
            replicas = {
                name: {
                    "entry": _identity(spec),
                    "last_seq": None if name not in self.feeds else self.feeds[name].last_seq,
                    "blocks": {m: list(kc) for m, kc in self.index.replica_blocks(name).items()},
                }
                for name, spec in self.specs.items()
            }
            state = {"format": SNAPSHOT_FORMAT, "media": self.index.media, "replicas": replicas}
        return msgspec.msgpack.encode(state)

    def restore(self, data: bytes) -> dict[str, str]:
        """Takes back a :meth:`snapshot` before the feeds have applied anything: each replica
        of the fleet with the same entry (hashing, layout, event endpoint) gets its blocks,
        and its feed resumes after the snapshot's sequence number (the gap since is asked of
        the replica's replay endpoint; where the replay no longer holds it, or the replica
        restarted meanwhile, the feed clears it as it would any gap). Returns, per replica of
        the fleet, ``restored N blocks`` or why not. A snapshot that does not decode is a
        ValueError, changing nothing."""
        import msgspec

        try:
            state = msgspec.msgpack.decode(data)
            if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
                raise ValueError(f"not a {SNAPSHOT_FORMAT} snapshot")
            media, saved = state["media"], state["replicas"]
        except (msgspec.DecodeError, KeyError, TypeError) as error:
            raise ValueError(f"the snapshot does not decode: {error}") from None
        outcome: dict[str, str] = {}
        with self._lock:
            for name, spec in self.specs.items():
                entry = saved.get(name)
                feed = self.feeds.get(name)
                if entry is None:
                    outcome[name] = "not in the snapshot"
                elif entry.get("entry") != _identity(spec):
                    outcome[name] = "its fleet entry changed since"
                elif feed is not None and feed.last_seq is not None:
                    outcome[name] = "its feed has applied batches already"
                else:
                    try:
                        blocks = {m: (bytes(k), bytes(c)) for m, (k, c) in entry["blocks"].items()}
                        n = self.index.restore_replica(name, blocks, media)
                    except (ValueError, TypeError, KeyError) as error:
                        outcome[name] = f"not restored: {error}"
                        continue
                    if feed is not None:
                        feed.last_seq = entry.get("last_seq")
                    outcome[name] = f"restored {n} blocks"
        return outcome

    def save_snapshot(self, path: str | Path) -> None:
        """:meth:`snapshot` written to ``path`` whole (a temporary file renamed over it)."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(self.snapshot())
        os.replace(temporary, path)

    def score(self, body: Any) -> dict[str, Any]:
        """The answer to ``POST /score`` (ValueError or TypeError for a bad body)."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        fields = {
            "prompt_token_ids",
            "cache_salt",
            "lora_name",
            "lora_path",
            "medium",
            "return_block_hashes",
        }
        unknown = set(body) - fields
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        prompt = body.get("prompt_token_ids")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {salt!r}")
        lora = None
        if body.get("lora_name") is not None or body.get("lora_path") is not None:
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not isinstance(path, str):
                raise ValueError("lora_name and lora_path are strings, given together")
            lora = SimpleNamespace(lora_name=name, lora_path=path)
        medium = body.get("medium", GPU)
        if not isinstance(medium, str):
            raise ValueError(f"medium must be a string, got {medium!r}")
        with self._lock:
            route = self.index.route(prompt, lora_request=lora, cache_salt=salt, medium=medium)
        name = route.replica
        answer: dict[str, Any] = {
            "scores": route.scores,
            "best": name,
            "url": self.urls.get(name) if name else None,
        }
        if body.get("return_block_hashes"):
            hashes = route.block_hashes
            answer["block_hashes"] = None if hashes is None else [h.hex() for h in hashes]
        return answer

    def replicas(self) -> dict[str, Any]:
        """The answer to ``GET /replicas``."""
        with self._lock:
            out: dict[str, Any] = {}
            for name in self.index.replicas:
                feed = self.feeds.get(name)
                out[name] = {
                    "url": self.urls.get(name),
                    "blocks_held": self.index.held(name),
                    "feed": None
                    if feed is None
                    else {
                        "last_seq": feed.last_seq,
                        "replayed": feed.replayed,
                        "resyncs": feed.resyncs,
                        "restarts": feed.restarts,
                        "malformed": feed.malformed,
                    },
                }
            return {"replicas": out, "counts": self.index.counts()}


class SnapshotFile:
    """A service's snapshot kept in a file: :meth:`restore` at start where the file exists,
    :meth:`due` every ``interval`` seconds while serving, and :meth:`save` at the end. A file
    that cannot be read or written is reported (:attr:`error`), never fatal: the service then
    starts empty, or goes on without the snapshot."""

    def __init__(self, service: RouteService, path: str | Path, interval: float = 60.0) -> None:
        self.service, self.path, self.interval = service, Path(path), interval
        self.error: str | None = None
        self._saved = time.monotonic()

    def restore(self) -> dict[str, str]:
        """:meth:`RouteService.restore` from the file (nothing where there is none)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as error:
            self.error = f"cannot read {self.path}: {error}"
            return {}
        try:
            return self.service.restore(data)
        except ValueError as error:
            self.error = f"{self.path} not restored: {error}"
            return {}

    def due(self) -> None:
        """Saves when ``interval`` seconds passed since the last save."""
        if time.monotonic() - self._saved >= self.interval:
            self.save()

    def save(self) -> None:
        self._saved = time.monotonic()
        try:
            self.service.save_snapshot(self.path)
            self.error = None
        except OSError as error:
            self.error = f"cannot write {self.path}: {error}"


def report_restored(restored: dict[str, str], snapshots: SnapshotFile | None, command: str) -> None:
    """What a command's snapshot restored, one line per replica, on stderr."""
    if snapshots is None:
        return
    if snapshots.error is not None:
        print(f"{command}: {snapshots.error}; starting empty", file=sys.stderr)
    for name, outcome in restored.items():
        print(f"{command}: snapshot {snapshots.path}: {name}: {outcome}", file=sys.stderr)


def _handler(service: RouteService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvblocks-route"

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/replicas":
                self._send(200, service.replicas())
            else:
                self._send(404, {"error": f"no such endpoint: GET {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/score":
                self._send(404, {"error": f"no such endpoint: POST {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= MAX_BODY:
                    raise ValueError(f"a body of 1 to {MAX_BODY} bytes is needed, got {length}")
                answer = service.score(json.loads(self.rfile.read(length)))
            except (ValueError, TypeError, OverflowError) as error:
                self._send(400, {"error": str(error)})
                return
            self._send(200, answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per query would drown a router's log

    return Handler


@dataclass(frozen=True)
class Running:
    """A service :func:`serve` started: its state, its HTTP server, and what its snapshot
    restored (per replica, as :meth:`RouteService.restore` says) or why it could not."""

    service: RouteService
    server: ThreadingHTTPServer
    restored: dict[str, str]
    snapshot: SnapshotFile | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"


@contextmanager
def serve(
    fleet: Fleet,
    host: str = "127.0.0.1",
    port: int = 8100,
    *,
    snapshot: str | Path | None = None,
    snapshot_interval: float = 60.0,
) -> Iterator[Running]:
    """Runs the service in background threads (HTTP, and the feeds' polling) until the
    ``with`` block ends (``port=0``: a free port, in ``Running.url``). With ``snapshot``,
    the index starts from that file where it exists and is saved there every
    ``snapshot_interval`` seconds and when the block ends (:class:`SnapshotFile`)."""
    service = RouteService(fleet)
    snapshots = None if snapshot is None else SnapshotFile(service, snapshot, snapshot_interval)
    restored = {} if snapshots is None else snapshots.restore()
    try:
        server = ThreadingHTTPServer((host, port), _handler(service))
    except BaseException:
        service.close()
        raise
    server.daemon_threads = True
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            if not service.feeds:
                service.poll(0)  # a reload asked for
                stop.wait(0.2)
            else:
                service.poll(50)
            if snapshots is not None:
                snapshots.due()

    threads = [
        threading.Thread(target=server.serve_forever, name="kvblocks-route-http", daemon=True),
        threading.Thread(target=follow, name="kvblocks-route-feeds", daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        yield Running(service, server, restored, snapshots)
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        for thread in threads:
            thread.join(5)
        if snapshots is not None:
            snapshots.save()
        service.close()
