"""The plugin inside vLLM's real ``EngineCore``, as vLLM loads it, with the plugin on and off.

Each run is a fresh process (this file, run as a script) that builds
``vllm.v1.engine.core.EngineCore`` on the CPU with a fake executor: ``EngineCore.__init__``
loads the general plugins itself (``KVBLOCKS_VLLM`` decides what kvblocks installs), sizes the
KV cache from the executor's one full-attention layer, builds the scheduler (and through it
the KV-cache manager) and the request block hasher. Requests go in as the engine client sends
them (``InputProcessor.process_inputs`` -> ``EngineCore.preprocess_add_request`` ->
``add_request``) and ``step()`` runs until all finish. Every scheduler output, engine output
and statistic must be the same with kvblocks as with vLLM alone. The model has one
full-attention layer, or (layout ``gpt-oss``) a full-attention and a sliding-window layer,
which vLLM's planner puts in two KV-cache groups.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor import Executor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from kvblocks.vllm.bench_driver import VOCAB_SIZE, model_output, sampled_token, write_model_dir

BLOCK_SIZE = 16
NUM_BLOCKS = 64  # small enough that the workload below preempts
MAX_MODEL_LEN = (NUM_BLOCKS - 1) * BLOCK_SIZE  # what 64 blocks (one is the null block) serve
#: The pool per layout: the window group needs blocks of its own (vLLM's planner requires
#: room for one request of MAX_MODEL_LEN in every group), and the pool stays small enough
#: to preempt.
POOL = {"llama": NUM_BLOCKS, "gpt-oss": NUM_BLOCKS + 22}
LAYER = "model.layers.{}.self_attn.attn"
WINDOW = 64  # the sliding window of the gpt-oss-like layout's second layer
PREFIX_CACHE_FIELDS = (
    "reset",
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FakeExecutor(Executor):
    """An executor without workers: the layout's layers, no-op KV-cache set-up, and a
    model that samples one token for every request whose prefill is done this step (known
    from the scheduler output alone, as a model runner knows it). It keeps every scheduler
    output it is given, as plain values."""

    def _init_executor(self) -> None:
        self.steps: list[dict[str, Any]] = []
        # request id -> [prompt tokens, tokens sampled so far]
        self._lengths: dict[str, list[int]] = {}
        self._pending: ModelRunnerOutput | None = None

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        raise NotImplementedError(f"the fake executor has no workers (collective_rpc {method!r})")

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    @property
    def supported_tasks(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("generate",)

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        common = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 16}
        specs: dict[str, KVCacheSpec] = {
            LAYER.format(0): FullAttentionSpec(**common, dtype=torch.float32)
        }
        if os.environ.get("KVBLOCKS_TEST_LAYOUT") == "gpt-oss":
            specs[LAYER.format(1)] = SlidingWindowSpec(
                **common, dtype=torch.float32, sliding_window=WINDOW
            )
        return [specs]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBNHC"]]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        return [1 << 30]  # num_gpu_blocks_override caps the pool at NUM_BLOCKS

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        self.num_blocks = [c.num_blocks for c in kv_cache_configs]

    def compile_or_warm_up_model(self) -> None:
        pass

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Any:
        out = scheduler_output
        self.steps.append(snapshot(out))
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for r in out.scheduled_new_reqs:
            assert r.prompt_token_ids is not None
            self._lengths.setdefault(r.req_id, [len(r.prompt_token_ids), 0])
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            length = self._lengths[req_id]
            if computed[req_id] + out.num_scheduled_tokens[req_id] < sum(length):
                sampled.append([])  # a prefill chunk: nothing sampled
            else:
                sampled.append([sampled_token(req_id, length[1])])
                length[1] += 1
        for req_id in out.finished_req_ids:
            self._lengths.pop(req_id, None)
        result: ModelRunnerOutput | None = None
        if out.total_num_scheduled_tokens == 0:
            result = EMPTY_MODEL_RUNNER_OUTPUT
        else:  # as vLLM's model runner: execute_model returns None, sample_tokens samples
            self._pending = model_output(req_ids, sampled)
        return _done(result) if non_block else result

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> Any:
        result, self._pending = self._pending, None
        return _done(result) if non_block else result


def snapshot(out: SchedulerOutput) -> dict[str, Any]:
    """What one scheduler step decided, as JSON values."""
    cached = out.scheduled_cached_reqs
    return {
        "num_scheduled_tokens": sorted(out.num_scheduled_tokens.items()),
        "new": [
            [r.req_id, [list(b) for b in r.block_ids], r.num_computed_tokens]
            for r in out.scheduled_new_reqs
        ],
        "cached": [
            [r, None if b is None else [list(g) for g in b], c, o]
            for r, b, c, o in zip(
                cached.req_ids,
                cached.new_block_ids,
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ],
        "resumed": sorted(cached.resumed_req_ids),
        "finished": sorted(out.finished_req_ids),
        "preempted": sorted(out.preempted_req_ids or ()),
        "num_common_prefix_blocks": list(out.num_common_prefix_blocks),
    }


def workload(seed: int = 3) -> list[tuple[int, str, list[int], int]]:
    """20 requests on 3 shared prefixes: (arrival step, id, prompt, max tokens)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(40, 130))] for _ in "abc"]
    requests = []
    for i in range(20):
        prompt = rng.choice(prefixes) + [
            rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 60))
        ]
        requests.append((rng.randrange(0, 12), f"req-{i}", prompt, rng.randrange(4, 48)))
    return sorted(requests, key=lambda r: r[0])


def drive_engine(model_dir: Path) -> dict[str, Any]:
    """Builds an EngineCore with the fake executor, runs :func:`workload` through it."""
    import vllm.plugins
    from vllm.v1.engine.input_processor import InputProcessor

    import kvblocks.vllm

    before = [vllm.plugins.plugins_loaded, str(kvblocks.vllm.status().mode)]
    write_model_dir(model_dir)
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            num_gpu_blocks_override=POOL[os.environ.get("KVBLOCKS_TEST_LAYOUT", "llama")],
        ),
    )
    engine = EngineCore(vllm_config, executor_class=FakeExecutor, log_stats=True)
    executor = engine.model_executor
    assert isinstance(executor, FakeExecutor)
    input_processor = InputProcessor(vllm_config)
    supported_tasks = engine.get_supported_tasks()

    pending = workload()
    requests = []
    outputs: list[list[Any]] = []
    stats: list[Any] = []
    totals = dict.fromkeys(PREFIX_CACHE_FIELDS[1:], 0)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for step in range(2000):
        while pending and pending[0][0] <= step:
            _, request_id, prompt, max_tokens = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            core_request = input_processor.process_inputs(
                request_id,
                tokens_input(prompt),
                params,
                supported_tasks,
                arrival_time=1_000_000.0 + step,
            )
            request, wave = engine.preprocess_add_request(core_request)
            engine.add_request(request, wave)
            requests.append(request)
        if not pending and not engine.scheduler.has_requests():
            break
        engine_outputs, executed = engine.step()
        engine.post_step(executed)
        step_outputs = []
        for client, eco in sorted(engine_outputs.items()):
            for o in eco.outputs:
                prefill = None if o.prefill_stats is None else asdict(o.prefill_stats)
                step_outputs.append(
                    {
                        "client": client,
                        "request_id": o.request_id,
                        "new_token_ids": list(o.new_token_ids),
                        "finish_reason": str(o.finish_reason),
                        "stop_reason": o.stop_reason,
                        "prefill_stats": prefill,
                    }
                )
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finish[o.request_id] = str(o.finish_reason)
            s = eco.scheduler_stats
            if s is not None:
                p = s.prefix_cache_stats
                prefix_cache = {key: getattr(p, key) for key in PREFIX_CACHE_FIELDS}
                stats.append(
                    {
                        "step": step,
                        "running": s.num_running_reqs,
                        "waiting": s.num_waiting_reqs,
                        "skipped_waiting": s.num_skipped_waiting_reqs,
                        "kv_cache_usage": round(s.kv_cache_usage, 12),
                        "prefix_cache": prefix_cache,
                    }
                )
                for key in totals:
                    totals[key] += getattr(p, key)
        outputs.append(step_outputs)
    else:
        raise AssertionError("the engine did not finish the workload")
    run = {
        "num_blocks": executor.num_blocks,
        "scheduler_outputs": executor.steps,
        "engine_outputs": outputs,
        "scheduler_stats": stats,
        "prefix_cache_totals": totals,
        "tokens": tokens,
        "finish_reasons": finish,
        "block_hashes": {r.request_id: [bytes(h).hex() for h in r.block_hashes] for r in requests},
    }
    result = {
        "before_engine": before,
        "scheduler": type(engine.scheduler).__module__ + "." + type(engine.scheduler).__name__,
        "manager": type(engine.scheduler.kv_cache_manager).__module__,
        "hasher": getattr(engine.request_block_hasher, "__module__", None),
        "status": str(kvblocks.vllm.status()),
        "run": run,
    }
    engine.shutdown()
    return result


def run_engine(mode: str, tmp_path: Path, layout: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "KVBLOCKS_VLLM")}
    env.update(
        KVBLOCKS_VLLM=mode,
        VLLM_TARGET_DEVICE="cpu",
        PYTHONHASHSEED="0",  # one NONE_HASH for both runs: their block hashes compare
        KVBLOCKS_TEST_LAYOUT=layout,
    )
    model_dir = tmp_path / mode
    model_dir.mkdir()
    return subprocess.Popen(
        [sys.executable, __file__, str(model_dir), str(tmp_path / f"{mode}.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def first_difference(a: Any, b: Any) -> str:
    """Where two recorded values first differ, e.g. ``[12]['new'][0]``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if a.get(key) != b.get(key):
                return f"[{key!r}]" + first_difference(a.get(key), b.get(key))
    elif isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"[{i}]" + first_difference(x, y)
        if len(a) != len(b):
            return f" (lengths {len(a)} != {len(b)})"
    return f": {a!r} != {b!r}"


@pytest.mark.parametrize("layout", ["llama", "gpt-oss"])
def test_engine_core_identical_with_plugin(tmp_path: Path, layout: str) -> None:
    processes = {mode: run_engine(mode, tmp_path, layout) for mode in ("off", "all")}
    results = {}
    for mode, process in processes.items():
        log, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"KVBLOCKS_VLLM={mode}:\n{log[-4000:]}"
        results[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    off, on = results["off"], results["all"]

    # Nothing was installed before EngineCore loaded the plugins itself.
    assert off["before_engine"] == on["before_engine"] == [False, "off"]
    assert off["scheduler"] == on["scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert off["manager"] == "vllm.v1.core.kv_cache_manager"
    assert off["hasher"] == "vllm.v1.core.kv_cache_utils"
    assert "mode=off" in off["status"]
    assert "nothing active" in off["status"]
    assert on["manager"] == "kvblocks.vllm.kv_cache_manager"
    assert on["hasher"] == "kvblocks.vllm.block_hasher"
    assert "mode=all" in on["status"]
    groups = "2 groups (full_attention, sliding_window), " if layout == "gpt-oss" else ""
    assert f"kv_cache_manager on {groups}16-token blocks, prefix caching on" in on["status"]
    assert "hasher on sha256" in on["status"]
    assert "fallback" not in on["status"]

    stock, ours = off["run"], on["run"]
    assert stock["num_blocks"] == [POOL[layout]]
    groups_per_step = {len(new[1]) for step in stock["scheduler_outputs"] for new in step["new"]}
    assert groups_per_step == {2 if layout == "gpt-oss" else 1}
    assert len(stock["tokens"]) == 20
    assert set(stock["finish_reasons"].values()) == {"length"}
    assert stock["prefix_cache_totals"]["hits"] > 0
    assert any(step["preempted"] for step in stock["scheduler_outputs"])
    assert all(stock["block_hashes"].values())
    assert stock == ours, "vLLM alone != with kvblocks at " + first_difference(stock, ours)


if __name__ == "__main__":
    result = drive_engine(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(result))
