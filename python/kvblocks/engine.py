"""``kvblocks.LLM``: generation end to end on the torch runtime, with kvblocks' block manager
(Rust or the pure-Python twin) doing the bookkeeping. Shaped like vLLM's ``LLM.generate``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvblocks
import kvblocks.reference
from kvblocks.model import LlamaConfig, LlamaForCausalLM, load_pretrained
from kvblocks.runtime import ModelRunner
from kvblocks.scheduler import Scheduler, Sequence


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    #: Sample ``i`` of a request uses the seed ``seed + i`` (``None``: the engine's generator).
    seed: int | None = None
    n: int = 1
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.n < 1:
            raise ValueError("max_tokens and n must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int


@dataclass
class EngineStats:
    steps: int = 0
    #: Scheduling, hashing and block management (everything kvblocks does).
    bookkeeping_s: float = 0.0
    #: The forward passes and sampling.
    model_s: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    generated_tokens: int = 0

    @property
    def bookkeeping_share(self) -> float:
        total = self.bookkeeping_s + self.model_s
        return self.bookkeeping_s / total if total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    samples: list[Sequence] = field(default_factory=list)


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; an unknown or absent device is a ``ValueError``."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"not a torch device: {device!r}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return parsed


class LLM:
    def __init__(
        self,
        model: str | Path | LlamaForCausalLM | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        backend: str = "rust",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        hash_algo: str = "sha256_cbor",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        seed: int = 0,
    ) -> None:
        if backend not in ("rust", "python"):
            raise ValueError(f"backend must be 'rust' or 'python', got {backend!r}")
        device = parse_device(device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if model is None:
            self.model = LlamaForCausalLM.random(
                LlamaConfig(), seed=seed, dtype=dtype, device=device
            )
        elif isinstance(model, LlamaForCausalLM):
            model_device = next(model.parameters()).device
            if model_device.type != device.type or (
                device.index is not None and model_device != device
            ):
                raise ValueError(f"the model is on {model_device}, the engine on {device}")
            self.model = model
        else:
            self.model = load_pretrained(model, dtype=dtype, device=device)
        num_blocks = num_blocks or 4096
        module: Any = kvblocks if backend == "rust" else kvblocks.reference
        self.manager = module.BlockManager(
            num_blocks,
            block_size,
            enable_caching=enable_prefix_caching,
            hash_algo=hash_algo,
            hash_seed="kvblocks-engine",
        )
        self.runner = ModelRunner(self.model, num_blocks, block_size, device=device, dtype=dtype)
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self.stats = EngineStats()
        self._generator = torch.Generator().manual_seed(seed)
        self._counter = 0

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> int:
        if params.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    def generate(
        self,
        prompt_token_ids: list[list[int]] | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt; ``progress(finished, total)`` is called after each step."""
        params = sampling_params or SamplingParams()
        nested = bool(prompt_token_ids) and isinstance(prompt_token_ids[0], list)
        raw = prompt_token_ids if nested else [prompt_token_ids]
        prompts = [[int(t) for t in p] for p in raw]  # type: ignore[union-attr, arg-type]
        vocab = self.model.config.vocab_size
        for prompt in prompts:
            if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompts must be non-empty token ids in [0, {vocab})")
        requests: list[_Request] = []
        generators: dict[int, torch.Generator] = {}
        owner: dict[int, _Request] = {}
        start = time.perf_counter()
        for prompt in prompts:
            request = _Request(f"req-{self._counter}", params)
            self._counter += 1
            seq = Sequence(request.request_id, prompt, params.max_tokens, params.eos_token_id)
            self.scheduler.add(seq)
            request.samples.append(seq)
            owner[id(seq)] = request
            requests.append(request)
        self.stats.bookkeeping_s += time.perf_counter() - start

        while self.scheduler.has_unfinished():
            t0 = time.perf_counter()
            out = self.scheduler.schedule()
            t1 = time.perf_counter()
            if out is None:
                raise RuntimeError("the pool cannot hold a single request: raise num_blocks")
            logits = self.runner.execute(out.step, out.input_ids)
            fork_s = 0.0
            for row, seq in enumerate(out.sequences):
                if seq.num_computed_tokens < seq.num_tokens:
                    continue  # a prefill chunk: no token yet
                request = owner[id(seq)]
                branch = [seq]
                if len(request.samples) < params.n and seq is request.samples[0]:
                    f0 = time.perf_counter()
                    for i in range(1, params.n):  # parallel sampling shares the prompt's blocks
                        child = Sequence(
                            f"{request.request_id}-{i}",
                            seq.prompt_token_ids,
                            params.max_tokens,
                            params.eos_token_id,
                            num_computed_tokens=seq.num_computed_tokens,
                            num_cached_tokens=seq.num_cached_tokens,
                            sample_index=i,
                        )
                        child.handle = self.manager.fork(seq.handle, child.request_id)
                        self.scheduler.running.append(child)
                        request.samples.append(child)
                        owner[id(child)] = request
                        branch.append(child)
                    fork_s += time.perf_counter() - f0
                for s in branch:
                    if id(s) not in generators:
                        generators[id(s)] = (
                            torch.Generator().manual_seed(params.seed + s.sample_index)
                            if params.seed is not None
                            else self._generator
                        )
                    token = self._sample(logits[row], params, generators[id(s)])
                    s.output_token_ids.append(token)
                    s.pending_token = token
                    self.stats.generated_tokens += 1
                    if params.eos_token_id is not None and token == params.eos_token_id:
                        self.scheduler.finish(s, "stop")
                    elif len(s.output_token_ids) >= s.max_tokens:
                        self.scheduler.finish(s, "length")
            t3 = time.perf_counter()
            if progress is not None:
                finished = sum(all(x.finish_reason for x in r.samples) for r in requests)
                progress(finished, len(requests))
            self.stats.steps += 1
            self.stats.bookkeeping_s += (t1 - t0) + fork_s
            self.stats.model_s += (t3 - t1) - fork_s

        snapshot = self.manager.make_prefix_cache_stats()
        if snapshot is not None:
            self.stats.prefix_queries += snapshot.queries + snapshot.preempted_queries
            self.stats.prefix_hits += snapshot.hits + snapshot.preempted_hits
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return [
            RequestOutput(
                request_id=r.request_id,
                prompt_token_ids=r.samples[0].prompt_token_ids,
                outputs=[
                    CompletionOutput(s.sample_index, s.output_token_ids, s.finish_reason)
                    for s in r.samples
                ],
                num_cached_tokens=r.samples[0].num_cached_tokens or 0,
            )
            for r in requests
        ]
