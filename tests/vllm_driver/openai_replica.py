"""A vLLM replica for the gateway tests and benchmark: vLLM's own V1 ``Scheduler`` (with
kvblocks' KV-cache manager unless ``--kvblocks off``) behind an OpenAI HTTP server, the fake
model in place of weights, KV events published by vLLM's own ``ZmqEventPublisher``.

``python -m tests.vllm_driver.openai_replica --port P --events-port E --replay-port R
[--layout NAME] [--num-blocks N] [--block-size 16] [--model-dir DIR] [--kvblocks on|off]``
serves on 127.0.0.1:

- ``POST /v1/completions``: ``prompt`` as token ids (a list of ints) or text (encoded by the
  model directory's tokenizer, as vLLM encodes a text prompt), ``max_tokens``; and
  ``POST /v1/chat/completions`` where the tokenizer has a chat template. Not streamed. The
  answer is OpenAI's, with ``usage.prompt_tokens_details.cached_tokens`` the prefix tokens
  the scheduler found cached for the request (vLLM's ``num_cached_tokens``), the replica's
  name in ``kvblocks_replica`` (and the ``x-kvblocks-replica`` header) with the sequence
  number of the last KV event batch published when the answer was sent (``events_seq``:
  a router that has applied it knows everything this request stored);
- ``GET /metrics``: vLLM's ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (labels ``engine`` and ``model_name``), read from the
  scheduler (requests received but not yet added count as waiting);
- ``POST /reset_prefix_cache`` (vLLM's, as its server has it in development mode; the
  ``AllBlocksCleared`` event published);
- ``GET /health``, ``GET /v1/models``, ``GET /get_server_info`` and ``GET /get_model_info``
  (what routers ask a vLLM worker at registration).

The engine is the scheduler stepped on one thread, as vLLM's engine core steps it: each step
adds whatever arrived, schedules a batch of every request it can, runs the fake model
(deterministic tokens, no device) and hands the outputs back. The events come out of the
scheduler itself (``KVEventsConfig(publisher="zmq")``, as ``--kv-events-config`` sets it),
with a replay endpoint. It prints one line, ``ready {...}`` (JSON: the engine's NONE_HASH in
hex, its KV-cache layout as :class:`kvblocks.router.ReplicaLayout` reads it, the manager's
module), once serving, and exits with status 0 on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODEL = "tiny"
#: The longest a request may wait for its answer.
REQUEST_TIMEOUT = 60.0


@dataclass
class Pending:
    """One request between the HTTP thread that received it and the step loop."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    output: list[int] = field(default_factory=list)
    cached: int = 0
    finish_reason: str | None = None
    error: str | None = None


class _CountingPublisher:
    """vLLM's publisher, counting the batches it publishes (the last one's sequence number is
    ``count - 1``: ``ZmqEventPublisher`` numbers them from 0)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.count = 0
        self._lock = threading.Lock()

    def publish(self, batch: Any) -> None:
        self.inner.publish(batch)
        with self._lock:
            self.count += 1

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Engine:
    """The scheduler, stepped on a thread of its own."""

    def __init__(self, args: argparse.Namespace) -> None:
        import kvblocks.vllm

        if args.kvblocks == "on":
            kvblocks.vllm.install("all")
        from vllm.config import KVEventsConfig
        from vllm.v1.core import kv_cache_utils

        from kvblocks.router import ReplicaLayout
        from tests.vllm_driver import SchedulerSpec, block_hasher, make_scheduler

        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            # vLLM binds a wildcard endpoint (it connects to a named host instead)
            endpoint=f"tcp://*:{args.events_port}",
            replay_endpoint=f"tcp://*:{args.replay_port}",
            buffer_steps=10_000,
        )
        layout: Any = args.layout
        if layout.startswith("["):
            layout = [tuple(group) for group in json.loads(layout)]
        spec = SchedulerSpec(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            layout=layout,
            hash_algo="sha256",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            extra={"kv_events_config": events},
        )
        self.scheduler = make_scheduler(Path(args.model_dir), spec)
        publisher = self.scheduler.kv_event_publisher
        assert type(publisher).__name__ == "ZmqEventPublisher", type(publisher)
        self.publisher = _CountingPublisher(publisher)
        self.scheduler.kv_event_publisher = self.publisher
        self.hasher = block_hasher("sha256", args.block_size)
        self.none_hash = bytes(kv_cache_utils.NONE_HASH).hex()
        self.manager = type(self.scheduler.kv_cache_manager).__module__
        self.layout = dataclasses.asdict(
            ReplicaLayout.from_kv_cache_config(self.scheduler.kv_cache_manager.kv_cache_config)
        )
        self.model = spec.fake_model(self.scheduler)
        self._lock = threading.Condition()
        self._arrived: list[Pending] = []
        self._live: dict[str, Pending] = {}
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(10)
        self.publisher.shutdown()

    def submit(self, pending: Pending) -> None:
        with self._lock:
            self._arrived.append(pending)
            self._lock.notify_all()

    def load(self) -> tuple[int, int, float]:
        """Running, waiting (received requests not yet added included) and KV usage."""
        with self._lock:
            scheduler = self.scheduler
            waiting = len(scheduler.waiting) + len(self._arrived)
            return len(scheduler.running), waiting, float(scheduler.kv_cache_manager.usage)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache()`` between steps, its ``AllBlocksCleared`` published
        (False where requests are running: vLLM refuses then)."""
        from vllm.distributed.kv_events import KVEventBatch

        with self._lock:
            if not self.scheduler.reset_prefix_cache():
                return False
            events = self.scheduler.kv_cache_manager.take_events()
            if events:
                self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            return True

    @property
    def events_seq(self) -> int:
        return self.publisher.count - 1

    def _loop(self) -> None:
        from tests.vllm_driver import make_request

        scheduler = self.scheduler
        while True:
            with self._lock:
                while not self._stop and not self._arrived and not scheduler.has_requests():
                    self._lock.wait(0.5)
                if self._stop:
                    break
                for pending in self._arrived:
                    try:
                        request = make_request(
                            pending.request_id,
                            pending.prompt,
                            self.hasher,
                            max_tokens=pending.max_tokens,
                        )
                        scheduler.add_request(request)
                    except Exception as error:  # a request vLLM refuses: answered, not fatal
                        pending.error = f"{type(error).__name__}: {error}"
                        pending.done.set()
                        continue
                    self._live[pending.request_id] = pending
                self._arrived.clear()
                out = scheduler.schedule()
                result = self.model.execute(scheduler, out)
                outputs = scheduler.update_from_output(out, result)
                self.steps += 1
            for engine_outputs in outputs.values():
                for output in engine_outputs.outputs:
                    pending = self._live.get(output.request_id)
                    if pending is None:
                        continue
                    pending.output.extend(output.new_token_ids)
                    stats = getattr(output, "prefill_stats", None)
                    if stats is not None:  # with the request's first output
                        pending.cached = stats.num_cached_tokens
                    if output.finish_reason is not None:
                        pending.finish_reason = str(output.finish_reason)
                        del self._live[output.request_id]
                        pending.done.set()


class Tokenizer:
    """The model directory's tokenizer (transformers), or None where it has none."""

    def __init__(self, model_dir: Path) -> None:
        self.inner: Any = None
        if (model_dir / "tokenizer.json").exists() or (
            model_dir / "tokenizer_config.json"
        ).exists():
            from transformers import AutoTokenizer

            self.inner = AutoTokenizer.from_pretrained(str(model_dir))
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.inner(text).input_ids)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        with self._lock:
            ids = self.inner.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def decode(self, ids: list[int]) -> str:
        vocab = len(self.inner)
        with self._lock:
            return str(self.inner.decode([i % vocab for i in ids]))


class BadRequest(ValueError):
    pass


def _handler(
    engine: Engine, tokenizer: Tokenizer, name: str, args: argparse.Namespace
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes: without TCP_NODELAY a kept-alive client's
        # delayed ACK holds the body back 40 ms (what a router's pooled connection would see).
        disable_nagle_algorithm = True

        def _send(self, status: int, body: Any, kind: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-kvblocks-replica", name)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            kind = "BadRequestError" if status == 400 else "NotFoundError"
            error = {"message": message, "type": kind, "param": None, "code": status}
            self._send(status, {"error": error, "kvblocks_replica": {"name": name}})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                running, waiting, usage = engine.load()
                labels = f'{{engine="0",model_name="{MODEL}"}}'
                lines = [
                    "# HELP vllm:num_requests_running Number of requests in model execution.",
                    "# TYPE vllm:num_requests_running gauge",
                    f"vllm:num_requests_running{labels} {float(running)}",
                    "# HELP vllm:num_requests_waiting Number of requests waiting.",
                    "# TYPE vllm:num_requests_waiting gauge",
                    f"vllm:num_requests_waiting{labels} {float(waiting)}",
                    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent.",
                    "# TYPE vllm:kv_cache_usage_perc gauge",
                    f"vllm:kv_cache_usage_perc{labels} {usage}",
                ]
                self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")
            elif path in ("/health", "/ping"):
                self._send(200, b"", "text/plain")
            elif path == "/v1/models":
                card = {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL}
                self._send(200, {"object": "list", "data": [card]})
            elif path in ("/get_server_info", "/get_model_info"):
                self._send(
                    200,
                    {
                        "model_path": str(args.model_dir),
                        "served_model_name": MODEL,
                        "kv_block_size": args.block_size,
                        "block_size": args.block_size,
                        "instance_id": name,
                    },
                )
            else:
                print(f"openai_replica {name}: GET {self.path}: 404", file=sys.stderr)
                self._error(404, f"no {path}")

        def _read_json(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length)
            try:
                body = json.loads(data)
            except ValueError:
                raise BadRequest("the body is not JSON") from None
            if not isinstance(body, dict):
                raise BadRequest("the body is not a JSON object")
            return body

        def _prompt(self, path: str, body: dict[str, Any]) -> list[int]:
            if path == "/v1/completions":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                    if len(prompt) != 1:
                        raise BadRequest("one prompt per request here")
                    prompt = prompt[0]
                if isinstance(prompt, list):
                    if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
                        raise BadRequest("prompt must be token ids or text")
                    return list(prompt)
                if isinstance(prompt, str) and prompt:
                    if tokenizer.inner is None:
                        raise BadRequest("text prompts need a tokenizer in the model dir")
                    return tokenizer.encode(prompt)
                raise BadRequest("prompt must be token ids or text")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            if tokenizer.inner is None or not getattr(tokenizer.inner, "chat_template", None):
                raise BadRequest("chat completions need a chat template in the model dir")
            return tokenizer.chat(messages)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/reset_prefix_cache":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                done = engine.reset_prefix_cache()
                self._send(200 if done else 409, {"reset": done, "events_seq": engine.events_seq})
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._error(404, f"no {path}")
                return
            try:
                body = self._read_json()
                model = body.get("model", MODEL)
                if model != MODEL:
                    self._error(404, f"The model `{model}` does not exist.")
                    return
                prompt = self._prompt(path, body)
                max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
                if type(max_tokens) is not int or max_tokens < 1:
                    raise BadRequest("max_tokens must be a positive int")
                if len(prompt) + max_tokens > engine.scheduler.max_model_len:
                    raise BadRequest("the prompt and max_tokens exceed the model length")
            except BadRequest as error:
                self._error(400, str(error))
                return
            prefix = "cmpl" if path == "/v1/completions" else "chatcmpl"
            pending = Pending(f"{prefix}-{uuid.uuid4().hex}", prompt, max_tokens)
            engine.submit(pending)
            if not pending.done.wait(REQUEST_TIMEOUT):
                self._error(500, "the engine did not finish the request in time")
                return
            if pending.error is not None:
                self._error(400, pending.error)
                return
            text = tokenizer.decode(pending.output) if tokenizer.inner is not None else ""
            if path == "/v1/completions":
                choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
                kind = "text_completion"
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}}
                kind = "chat.completion"
            choice["finish_reason"] = pending.finish_reason or "length"
            choice["token_ids"] = pending.output
            answer = {
                "id": pending.request_id,
                "object": kind,
                "created": int(time.time()),
                "model": MODEL,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(pending.output),
                    "total_tokens": len(prompt) + len(pending.output),
                    "prompt_tokens_details": {"cached_tokens": pending.cached},
                },
                "kvblocks_replica": {"name": name, "events_seq": engine.events_seq},
            }
            self._send(200, answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.vllm_driver.openai_replica")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    p.add_argument("--layout", default="llama", help="a layout name, or JSON [[kind, size]]")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--model-dir", default=None, help="default: the driver's tiny model")
    p.add_argument("--kvblocks", choices=("on", "off"), default="on")
    p.add_argument("--name", default=None, help="the replica's name (default: its port)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from kvblocks._signals import StopSignals

    stop = StopSignals()
    args = _parser().parse_args(argv)
    from tests.vllm_driver import tiny_model_dir

    args.model_dir = Path(args.model_dir) if args.model_dir else tiny_model_dir()
    name = args.name or f"replica-{args.port}"
    engine = Engine(args)
    tokenizer = Tokenizer(args.model_dir)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(engine, tokenizer, name, args))
    server.daemon_threads = True
    serving = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    engine.start()
    serving.start()
    hello = {"name": name, "none_hash": engine.none_hash, "layout": engine.layout}
    hello["manager"] = engine.manager
    print(f"ready {json.dumps(hello)}", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
