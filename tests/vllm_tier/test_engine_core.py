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
which vLLM's planner puts in two KV-cache groups, or (layout ``qwen3.5``) a full-attention
layer and three Mamba (linear-attention) layers of the same page size, four groups, run as
vLLM runs such a model without prefix caching (Mamba blocks of ``max_model_len`` tokens, the
attention blocks to zero in every scheduler output), or (layout ``qwen3.5-align``) with it
(vLLM's "align" mode: Mamba blocks of the attention block size, prefill checkpoints as
Qwen3.5's gated delta-net layers export them). The ``llama-offloading`` run adds vLLM's CPU
offloading (``--kv-offloading-size``), ``qwen3.5-align-offloading`` the same to the Mamba
layout with prefix caching (its Mamba states offloaded too); ``llama-nixl`` and
``llama-nixl-push`` add NIXL's connector in pull and push mode (one engine in both roles: a
third of the requests are a prefill node's, a third a decode node's whose prompt KV a fake
remote node provides), the worker side faked by the bench driver's
(``tests.vllm_driver.nixl``).

With speculative decoding (``KVBLOCKS_TEST_SPECULATION``: ``ngram``, or ``eagle`` with a tiny
offline draft config and vLLM's default lookahead block hashes) the fake executor does what
vLLM's model runner does for it: it verifies the step's scheduled drafts (a fixed
pseudo-random run of them is right, the bench driver's :class:`Drafter`), returns the accepted
ones and one bonus token, proposes the next drafts for the batch and hands them over when
``EngineCore.post_step`` asks (``take_draft_token_ids``). EAGLE's draft layer is in the
executor's KV-cache specs (``is_draft``), so vLLM's planner flags its group
(``is_eagle_group``) as for a real EAGLE head.
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
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor import Executor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from tests.fresh_process import CHECKOUT
from tests.vllm_driver import (
    VOCAB_SIZE,
    Drafter,
    Speculation,
    model_output,
    sampled_token,
    write_model_dir,
)
from tests.vllm_driver.config import scheduler_only_cpu_platform
from tests.vllm_driver.speculative import speculative_config

BLOCK_SIZE = 16
NUM_BLOCKS = 64  # small enough that the workload below preempts
MAX_MODEL_LEN = (NUM_BLOCKS - 1) * BLOCK_SIZE  # what 64 blocks (one is the null block) serve
#: The pool per layout: the window group needs blocks of its own (vLLM's planner requires
#: room for one request of MAX_MODEL_LEN in every group), and the pool stays small enough
#: to preempt.
POOL = {
    "llama": NUM_BLOCKS,
    "gpt-oss": NUM_BLOCKS + 22,
    "qwen3.5": NUM_BLOCKS + 24,
    "qwen3.5-align": NUM_BLOCKS + 24,
    "qwen3.5-align-offloading": NUM_BLOCKS + 24,
    "llama-offloading": NUM_BLOCKS,
    "llama-nixl": NUM_BLOCKS,
    "llama-nixl-push": NUM_BLOCKS,
}
#: NIXL's transfer mode of each NIXL layout.
NIXL = {"llama-nixl": "pull", "llama-nixl-push": "push"}
#: The layouts with vLLM's CPU offloading, and those whose Mamba groups cache states.
OFFLOADING = ("llama-offloading", "qwen3.5-align-offloading")
ALIGN = ("qwen3.5-align", "qwen3.5-align-offloading")
#: NIXL's side-channel port per run (the "off" and "all" processes run at the same time, and
#: each engine's connector listens on its port; the port is in the kv_transfer_params a
#: finished prefill returns, recorded as PORT).
NIXL_PORTS = {"off": "5611", "all": "5612"}
PORT = "<side-channel port>"
#: ``--kv-offloading-size`` of the ``llama-offloading`` run, in GiB: about 60 blocks of the
#: one layer (8 KiB each) on the CPU.
KV_OFFLOADING_GIB = 0.0005
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
NUM_DRAFTS = 3  # num_speculative_tokens


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FakeExecutor(Executor):
    """An executor without workers: the layout's layers, no-op KV-cache set-up, and a
    model that samples one token for every request whose prefill is done this step (known
    from the scheduler output alone, as a model runner knows it), with speculative decoding
    also the drafts it accepts, and then proposes the next ones. It keeps every scheduler
    output it is given, as plain values."""

    def _init_executor(self) -> None:
        self.steps: list[dict[str, Any]] = []
        # request id -> [prompt tokens, tokens sampled so far]
        self._lengths: dict[str, list[int]] = {}
        self._pending: ModelRunnerOutput | None = None
        # What the model runner does for vLLM's CPU offloading (a fake worker side that
        # completes every transfer at once), set by drive_engine once the scheduler exists.
        self.connector_worker: Any = None
        config = self.speculative_config
        self.drafter = None
        if config is not None:  # synchronous scheduling: drafts go to the engine core
            self.drafter = Drafter(NUM_DRAFTS, every_step=config.use_eagle(), in_worker=False)

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

    def get_kv_connector_handshake_metadata(self) -> list[Any]:
        """The OffloadingConnector's workers have no handshake (vLLM's return None)."""
        return [None]

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
        layout = os.environ.get("KVBLOCKS_TEST_LAYOUT")
        if layout == "gpt-oss":
            specs[LAYER.format(1)] = SlidingWindowSpec(
                **common, dtype=torch.float32, sliding_window=WINDOW
            )
        elif layout == "qwen3.5":
            for i in (1, 2, 3):  # one state of the attention layer's page size (4 KiB)
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    block_size=MAX_MODEL_LEN,
                    shapes=((1024,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="none",
                )
        elif layout in ALIGN:
            for i in (1, 2, 3):  # as a gated delta-net layer's spec with prefix caching
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    block_size=BLOCK_SIZE,
                    shapes=((1024,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                    num_prefill_checkpoint_blocks=1,
                    prefill_checkpoint_alignment=BLOCK_SIZE,
                )
        if self.speculative_config is not None and self.speculative_config.use_eagle():
            # The EAGLE head's attention layer, numbered after the target's (2) layers.
            specs[LAYER.format(2)] = FullAttentionSpec(**common, dtype=torch.float32, is_draft=True)
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
                continue
            tokens = [sampled_token(req_id, length[1])]
            if self.drafter is not None:  # the rejection sampler: right drafts, then a bonus
                scheduled = out.scheduled_spec_decode_tokens.get(req_id, [])
                for draft in self.drafter.to_verify(req_id, scheduled):
                    if draft != tokens[-1]:
                        break
                    tokens.append(sampled_token(req_id, length[1] + len(tokens)))
            length[1] += len(tokens)
            sampled.append(tokens)
        if self.drafter is not None and req_ids:
            self._propose(out, req_ids, sampled)
        for req_id in out.finished_req_ids:
            self._lengths.pop(req_id, None)
        result: ModelRunnerOutput | None = None
        connector_output = None
        if self.connector_worker is not None:
            connector_output = self.connector_worker.step(out)
        if out.total_num_scheduled_tokens == 0 and connector_output is None:
            result = EMPTY_MODEL_RUNNER_OUTPUT
        elif out.total_num_scheduled_tokens == 0:
            result = model_output([], [], connector_output)
        else:  # as vLLM's model runner: execute_model returns None, sample_tokens samples
            self._pending = model_output(req_ids, sampled, connector_output)
        return _done(result) if non_block else result

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> Any:
        result, self._pending = self._pending, None
        return _done(result) if non_block else result

    def _propose(self, out: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The drafts after a step, for every request of the batch, from its number of
        sampled tokens (``None`` where it sampled nothing: n-gram proposes none, EAGLE's
        are dropped by the scheduler)."""
        assert self.drafter is not None
        # Proposing k drafts every step is right only without vLLM's dynamic draft length
        # and without draft skipping (which only its V2 model runner does; on the CPU
        # platform vLLM picks V1).
        assert out.num_spec_tokens_to_schedule == NUM_DRAFTS
        assert not out.skip_drafts
        counts = [self._lengths[r][1] if s else None for r, s in zip(req_ids, sampled, strict=True)]
        self.drafter.propose(dict(zip(req_ids, counts, strict=True)))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The batch's drafts, which ``EngineCore.post_step`` hands the scheduler."""
        return None if self.drafter is None else self.drafter.take_draft_token_ids()


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
        "resumed": sorted(getattr(cached, "resumed_req_ids", ())),  # (none in vLLM 0.34)
        "finished": sorted(out.finished_req_ids),
        "preempted": sorted(out.preempted_req_ids or ()),
        "num_common_prefix_blocks": list(getattr(out, "num_common_prefix_blocks", ())),
        "new_block_ids_to_zero": out.new_block_ids_to_zero,
        "connector_jobs": connector_jobs(out),
        "spec_decode_tokens": sorted(
            [r, list(t)] for r, t in out.scheduled_spec_decode_tokens.items()
        ),
    }


def connector_jobs(out: SchedulerOutput) -> Any:
    """The KV connector's decisions of the step (JSON values): the OffloadingConnector's load,
    store and flush jobs, or NIXL's transfers, hand-overs and registrations."""
    if out.kv_connector_metadata is None:
        return None
    from tests.vllm_driver.connectors import connector_decisions

    return json.loads(json.dumps(connector_decisions(out), default=lambda v: v.hex()))


def as_dict(value: Any) -> dict[str, Any] | None:
    return None if value is None else asdict(value)


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


def nixl_role(request_id: str) -> int:
    """In the NIXL runs, 0: a prefill node's request, 1: a decode node's, 2: a plain one."""
    return int(request_id.rsplit("-", 1)[1]) % 3


def nixl_params(request_id: str, prompt: list[int]) -> dict[str, Any] | None:
    """NIXL's kv_transfer_params of a request in the NIXL runs (:func:`nixl_role`)."""
    from tests.vllm_driver import nixl

    role = nixl_role(request_id)
    if role == 0:
        return nixl.prefill_params()
    if role == 1:
        return nixl.decode_params(request_id, -(-len(prompt) // BLOCK_SIZE))
    return None


def recorded_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """A finished request's kv_transfer_params as recorded (the port is the run's own)."""
    if params is None:
        return None
    assert params.get("remote_port") == int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "0"))
    return {**params, "remote_port": PORT}


def drive_engine(model_dir: Path) -> dict[str, Any]:
    """Builds an EngineCore with the fake executor, runs :func:`workload` through it."""
    import vllm.plugins
    from vllm.v1.engine.input_processor import InputProcessor

    import kvblocks.vllm

    if os.environ.get("KVBLOCKS_TEST_FAULT") == "hasher":
        # A bug in kvblocks' part of the hasher factory, which EngineCore.__init__ calls.
        from kvblocks.vllm import block_hasher

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated bug in kvblocks' hasher")

        block_hasher._SeededHasher = broken  # type: ignore[assignment,misc]
    from tests.vllm_driver.porting import open_guard_if_asked

    open_guard_if_asked()  # test only: KVBLOCKS_PORTING_OPEN=1 (docs/porting.md)
    before = [vllm.plugins.plugins_loaded, str(kvblocks.vllm.status().mode)]
    write_model_dir(model_dir)
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )
    parallel_config = ParallelConfig()
    method = os.environ.get("KVBLOCKS_TEST_SPECULATION")
    speculation = None
    if method:
        speculation = speculative_config(
            Speculation(method, NUM_DRAFTS), model_config, parallel_config
        )
    layout = os.environ.get("KVBLOCKS_TEST_LAYOUT", "llama")
    transfer = None
    if layout in OFFLOADING:
        # --kv-offloading-size, with the driver's spec (vLLM's CPU tier, a fake worker side).
        from tests.vllm_driver.offloading import SPEC_MODULE, SPEC_NAME

        extra = {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE}
        transfer = KVTransferConfig(kv_connector_extra_config=extra)
    elif layout in NIXL:
        from tests.vllm_driver import nixl

        transfer = nixl.kv_transfer_config(NIXL[layout])
    # vLLM 0.34's CPU platform refuses x86 without Triton: told it is there while this
    # configuration is checked (test only: the driver's flag; no model runner runs here).
    with scheduler_only_cpu_platform():
        vllm_config = VllmConfig(
            model_config=model_config,
            kv_transfer_config=transfer,
            parallel_config=parallel_config,
            speculative_config=speculation,
            # speculating: each request's accepted and proposed drafts per step, in its final output
            observability_config=ObservabilityConfig(
                per_request_spec_decode_metrics="detailed" if method else "none"
            ),
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
                enable_prefix_caching=layout != "qwen3.5",
                # What vLLM's config sets for a model with Mamba layers and prefix caching.
                mamba_cache_mode="align" if layout in ALIGN else "none",
                num_gpu_blocks_override=POOL[layout],
                kv_offloading_size=KV_OFFLOADING_GIB if layout in OFFLOADING else None,
            ),
        )
    engine = EngineCore(vllm_config, executor_class=FakeExecutor, log_stats=True)
    executor = engine.model_executor
    assert isinstance(executor, FakeExecutor)
    scheduler = engine.scheduler
    assert isinstance(scheduler, Scheduler)
    if layout in NIXL:
        from tests.vllm_driver.nixl import FakeNixlWorker

        executor.connector_worker = FakeNixlWorker()
    elif transfer is not None:
        from tests.vllm_driver.offloading import ConnectorWorker

        executor.connector_worker = ConnectorWorker(scheduler)
    input_processor = InputProcessor(vllm_config)
    supported_tasks = engine.get_supported_tasks()

    fault = os.environ.get("KVBLOCKS_TEST_FAULT")
    faulted = None
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
            transfer_params = nixl_params(request_id, prompt) if layout in NIXL else None
            if transfer_params is not None and transfer_params["do_remote_decode"]:
                max_tokens = 1  # a prefill node's request, as a router sends it
            extra_args = {"kv_transfer_params": transfer_params} if transfer_params else None
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
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
        if not pending and not scheduler.has_requests():
            break
        if fault == "manager" and step == FAULT_STEP:
            # Test only (a test-faults build): the running request with the most tokens
            # still to sample gets an unsound allocation in this step's schedule().
            victim = max(scheduler.running, key=lambda r: r.max_tokens - r.num_output_tokens)
            scheduler.kv_cache_manager._core._plant_fault(victim.request_id)
            faulted = victim.request_id
        engine_outputs, executed = engine.step()
        engine.post_step(executed)
        step_outputs = []
        for client, eco in sorted(engine_outputs.items()):
            for o in eco.outputs:
                prefill = as_dict(o.prefill_stats)
                step_outputs.append(
                    {
                        "client": client,
                        "request_id": o.request_id,
                        "new_token_ids": list(o.new_token_ids),
                        "finish_reason": str(o.finish_reason),
                        "stop_reason": o.stop_reason,
                        "prefill_stats": prefill,
                        "spec_decode_metrics": as_dict(o.spec_decode_metrics),
                        "kv_transfer_params": recorded_params(o.kv_transfer_params),
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
                        "spec_decoding": as_dict(s.spec_decoding_stats),
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
        "scheduler": type(scheduler).__module__ + "." + type(scheduler).__name__,
        "manager": type(scheduler.kv_cache_manager).__module__,
        "hasher": getattr(engine.request_block_hasher, "__module__", None),
        "status": str(kvblocks.vllm.status()),
        "contained_errors": kvblocks.vllm.status().contained_errors,
        "faulted": faulted,
        # What external routers read of the groups (EngineCore's own method).
        "group_metadata": engine.get_kv_cache_group_metadata(),
        "speculation": {
            "hash_lookahead": scheduler.num_hash_lookahead_tokens,
            "block_drop": scheduler.kv_cache_manager.use_eagle,
            "eagle_groups": [g.is_eagle_group for g in scheduler.kv_cache_config.kv_cache_groups],
        },
        "run": run,
    }
    engine.shutdown()
    return result


def run_engine(
    mode: str, tmp_path: Path, layout: str, speculation: str, fault: str = ""
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "KVBLOCKS_VLLM")}
    env.update(
        KVBLOCKS_VLLM=mode,
        KVBLOCKS_TEST_FAULT=fault,
        VLLM_TARGET_DEVICE="cpu",
        PYTHONHASHSEED="0",  # one NONE_HASH for both runs: their block hashes compare
        KVBLOCKS_TEST_LAYOUT=layout,
        KVBLOCKS_TEST_SPECULATION=speculation,
        VLLM_NIXL_SIDE_CHANNEL_PORT=NIXL_PORTS[mode],
        # The checkout, for the test driver (tests.vllm_driver).
        PYTHONPATH=os.pathsep.join(p for p in (CHECKOUT, os.environ.get("PYTHONPATH")) if p),
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


def check_speculated(run: dict[str, Any], *, eagle: bool) -> None:
    """The run verified drafts, accepting some and rejecting others, as the scheduler
    scheduled them: EAGLE k drafts for every decode step (no request nears the length
    limit), n-gram 0 to k."""
    scheduled = [len(d) for step in run["scheduler_outputs"] for _, d in step["spec_decode_tokens"]]
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for stats in run["scheduler_stats"]:
        for key in totals:
            totals[key] += (stats["spec_decoding"] or {}).get(key, 0)
    assert totals["num_drafts"] == len(scheduled) > 0
    assert totals["num_draft_tokens"] == sum(scheduled)
    assert 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"]
    assert set(scheduled) == ({NUM_DRAFTS} if eagle else set(range(1, NUM_DRAFTS + 1)))
    # Some steps gave a request more than one token: accepted drafts and the bonus.
    assert any(len(o["new_token_ids"]) > 1 for step in run["engine_outputs"] for o in step)
    # Each request's final output sums up its own verify steps.
    metrics = [o["spec_decode_metrics"] for step in run["engine_outputs"] for o in step]
    finals = [m for m in metrics if m is not None]
    assert len(finals) == len(run["tokens"])
    assert sum(sum(m["per_step_drafted"]) for m in finals) == totals["num_draft_tokens"]
    assert sum(sum(m["per_step_accepted"]) for m in finals) == totals["num_accepted_tokens"]


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


#: What vLLM sets up for each speculation: how many tokens after a block its hash covers, and
#: the manager's EAGLE block drop (EAGLE's lookahead block hashes, vLLM's default, replace it;
#: the draft's group is still flagged).
SPECULATION_SETUP = {
    "": {"hash_lookahead": 0, "block_drop": False},
    "ngram": {"hash_lookahead": 0, "block_drop": False},
    "eagle": {"hash_lookahead": 1, "block_drop": False},
}


def engine_results(processes: dict[str, subprocess.Popen[str]], tmp_path: Path) -> tuple[Any, Any]:
    """Waits for the engine processes ("off" and "all"), each of which must succeed, and
    returns what each wrote."""
    results = {}
    for mode, process in processes.items():
        log, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"KVBLOCKS_VLLM={mode}:\n{log[-4000:]}"
        results[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    return results["off"], results["all"]


@pytest.mark.parametrize(
    ("layout", "speculation"),
    [
        pytest.param("llama", "", id="llama"),
        pytest.param("gpt-oss", "", id="gpt-oss"),
        pytest.param("gpt-oss", "ngram", id="gpt-oss-ngram"),
        pytest.param("llama", "eagle", id="llama-eagle"),
        pytest.param("qwen3.5", "", id="qwen3.5"),
        pytest.param("qwen3.5-align", "", id="qwen3.5-prefix-caching"),
        pytest.param("llama-offloading", "", id="llama-kv-offloading"),
        pytest.param("qwen3.5-align-offloading", "", id="qwen3.5-prefix-caching-kv-offloading"),
        pytest.param("llama-nixl", "", id="llama-nixl"),
        pytest.param("llama-nixl-push", "", id="llama-nixl-push"),
    ],
)
def test_engine_core_identical_with_plugin(tmp_path: Path, layout: str, speculation: str) -> None:
    processes = {mode: run_engine(mode, tmp_path, layout, speculation) for mode in ("off", "all")}
    off, on = engine_results(processes, tmp_path)

    # Nothing was installed before EngineCore loaded the plugins itself.
    assert off["before_engine"] == on["before_engine"] == [False, "off"]
    assert off["scheduler"] == on["scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert off["manager"] == "vllm.v1.core.kv_cache_manager"
    assert "mode=off" in off["status"]
    assert "nothing active" in off["status"]
    assert on["manager"] == "kvblocks.vllm.kv_cache_manager"
    assert "mode=all" in on["status"]
    assert "fallback" not in on["status"]
    mamba = layout == "qwen3.5"
    offloading = layout in OFFLOADING
    num_groups = 4 if layout.startswith("qwen3.5") else {"gpt-oss": 2}.get(layout, 1)
    stock, ours = off["run"], on["run"]
    if mamba:  # no prefix caching: EngineCore builds no request block hasher
        assert off["hasher"] is on["hasher"] is None
        described = (
            "4 groups (full_attention, mamba, mamba, mamba), 16/1008/1008/1008-token blocks, "
            "prefix caching off"
        )
        assert f"kv_cache_manager on {described}" in on["status"]
        assert stock["prefix_cache_totals"]["queries"] == 0
        assert not any(stock["block_hashes"].values())
        zeroed = [
            b for step in stock["scheduler_outputs"] for b in step["new_block_ids_to_zero"] or ()
        ]
        assert zeroed, "vLLM zeroes fresh attention blocks for a model with Mamba layers"
    else:
        assert off["hasher"] == "vllm.v1.core.kv_cache_utils"
        assert on["hasher"] == "kvblocks.vllm.block_hasher"
        groups = {
            "gpt-oss": "2 groups (full_attention, sliding_window), ",
        }.get(layout, "4 groups (full_attention, mamba, mamba, mamba), " if layout in ALIGN else "")
        connector = {
            **dict.fromkeys(OFFLOADING, ", OffloadingConnector"),
            "llama-nixl": ", NixlConnector",
            "llama-nixl-push": ", NixlPushConnector",
        }.get(layout, "")
        described = f"{groups}16-token blocks, prefix caching on{connector}"
        assert f"kv_cache_manager on {described}" in on["status"]
        lookahead = SPECULATION_SETUP[speculation]["hash_lookahead"]
        hasher = (
            f"hasher on sha256, {lookahead} lookahead tokens" if lookahead else "hasher on sha256"
        )
        assert on["status"].endswith(hasher)
        assert stock["prefix_cache_totals"]["hits"] > 0
        assert all(stock["block_hashes"].values())
        zeroing = any(step["new_block_ids_to_zero"] for step in stock["scheduler_outputs"])
        assert zeroing == (layout in ALIGN)
    assert off["group_metadata"] == on["group_metadata"]
    sizes = [m["block_size"] for m in on["group_metadata"]]
    assert sizes == (
        [16, MAX_MODEL_LEN, MAX_MODEL_LEN, MAX_MODEL_LEN] if mamba else [16] * num_groups
    )
    eagle_groups = [speculation == "eagle"] + [False] * (num_groups - 1)
    setup = {**SPECULATION_SETUP[speculation], "eagle_groups": eagle_groups}
    assert off["speculation"] == on["speculation"] == setup

    assert stock["num_blocks"] == [POOL[layout]]
    groups_per_step = {len(new[1]) for step in stock["scheduler_outputs"] for new in step["new"]}
    assert groups_per_step == {num_groups}
    assert len(stock["tokens"]) == 20
    assert set(stock["finish_reasons"].values()) == {"length"}
    # (NIXL's prefill requests sample one token and its decode requests none of their
    # prompt, so that run's pool does not fill; test_nixl.py preempts with NIXL.)
    preempted = any(step["preempted"] for step in stock["scheduler_outputs"])
    assert preempted == (layout not in NIXL)
    jobs = [step["connector_jobs"] for step in stock["scheduler_outputs"]]
    handed = [o["kv_transfer_params"] for step in stock["engine_outputs"] for o in step]
    if offloading:  # blocks went to the CPU tier, and some came back
        assert all(j is not None for j in jobs)
        assert any(stores for _loads, stores, _flushed in jobs)
        assert any(loads for loads, _stores, _flushed in jobs)
        if layout in ALIGN:  # Mamba states among them: per job, the blocks of each group
            assert any(job[2][1][1] for _loads, stores, _flushed in jobs for job in stores)
    elif layout in NIXL:  # remote KV arrived for decode requests; prefills handed theirs on
        assert all(j is not None for j in jobs)
        transfers = [t for recv, _send, _other in jobs for t in recv]
        assert any(any(blocks) for _rid, blocks, _cached, _awaiting in transfers)
        assert any(send for _recv, send, _other in jobs)
        finished = [p for p in handed if p is not None]
        assert {p["transfer_mode"] for p in finished} == {NIXL[layout]}
        assert any(p["remote_block_ids"] for p in finished)
        if NIXL[layout] == "push":
            assert any(other[2] for _recv, _send, other in jobs), "registrations"
    else:
        assert not any(jobs)
        assert not any(handed)
    max_tokens = {request_id: n for _, request_id, _, n in workload()}
    if layout in NIXL:  # a prefill node's requests (every third) sample one token
        max_tokens.update({r: 1 for r in max_tokens if nixl_role(r) == 0})
    for request_id, tokens in stock["tokens"].items():  # drafts never change what is sampled
        assert tokens == [sampled_token(request_id, i) for i in range(max_tokens[request_id])]
    if speculation:
        check_speculated(stock, eagle=speculation == "eagle")
    else:
        assert not any(step["spec_decode_tokens"] for step in stock["scheduler_outputs"])
    assert stock == ours, "vLLM alone != with kvblocks at " + first_difference(stock, ours)


def test_engine_core_starts_when_kvblocks_hasher_breaks(tmp_path: Path) -> None:
    """An unexpected error in kvblocks' part of the hasher factory during EngineCore.__init__:
    the engine starts and runs on vLLM's hasher (identical hashes), kvblocks' manager still
    runs, and status() names the fallback with the error."""
    processes = {
        "off": run_engine("off", tmp_path, "llama", ""),
        "all": run_engine("all", tmp_path, "llama", "", fault="hasher"),
    }
    off, on = engine_results(processes, tmp_path)
    assert on["hasher"] == off["hasher"] == "vllm.v1.core.kv_cache_utils"
    assert on["manager"] == "kvblocks.vllm.kv_cache_manager"
    assert "hasher on" not in on["status"]
    assert "fallback x1: hasher: " in on["status"]
    assert "(RuntimeError: simulated bug in kvblocks' hasher)" in on["status"]
    assert off["run"] == on["run"], "vLLM alone != with kvblocks at " + first_difference(
        off["run"], on["run"]
    )


#: The step at whose schedule() the manager fault is planted (requests are decoding then).
FAULT_STEP = 14


@pytest.mark.parametrize("layout", ["llama", "qwen3.5-align"])
def test_an_unsound_allocation_costs_one_request(tmp_path: Path, layout: str) -> None:
    """kvblocks' check finds a request's allocation unsound mid-run (a fault planted by the
    test-only hook of a ``test-faults`` build: a block of the request's own table freed
    before the check). Inside the real EngineCore, the engine goes on: that request is
    finished with vLLM's ``FinishReason.ERROR`` (a retryable ``RequestError``) at the end of
    the step, and every other request samples exactly what it samples with vLLM alone;
    ``status()`` counts one contained error; the process exits cleanly."""
    processes = {
        "off": run_engine("off", tmp_path, layout, ""),
        "all": run_engine("all", tmp_path, layout, "", fault="manager"),
    }
    off, on = engine_results(processes, tmp_path)
    assert on["manager"] == "kvblocks.vllm.kv_cache_manager"
    victim = on["faulted"]
    assert victim is not None
    assert on["contained_errors"] == 1
    assert "finished with an error by kvblocks' check (its bug): 1" in on["status"]
    stock_run, our_run = off["run"], on["run"]
    assert our_run["finish_reasons"][victim] == "error"
    assert stock_run["finish_reasons"][victim] == "length"
    # It stopped early, after what it had sampled (at most one token after the fault).
    stock_tokens, our_tokens = stock_run["tokens"][victim], our_run["tokens"][victim]
    assert len(our_tokens) < len(stock_tokens)
    assert our_tokens == stock_tokens[: len(our_tokens)]
    others = set(stock_run["tokens"]) - {victim}
    assert len(others) == 19
    for request_id in others:
        assert our_run["tokens"][request_id] == stock_run["tokens"][request_id], request_id
        assert our_run["finish_reasons"][request_id] == stock_run["finish_reasons"][request_id]
    # Up to the faulted step, the two runs scheduled alike.
    assert our_run["scheduler_outputs"][:FAULT_STEP] == stock_run["scheduler_outputs"][:FAULT_STEP]


if __name__ == "__main__":
    result = drive_engine(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(result))
