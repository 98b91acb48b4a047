"""``kvblocks.LLM``: generation end to end on the torch runtime, with kvblocks' block manager
(Rust or the pure-Python reference) doing the bookkeeping. Shaped like vLLM's ``LLM.generate``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import kvblocks._core as _core
import kvblocks.reference as reference
from kvblocks.model import LlamaConfig, LlamaForCausalLM, load_pretrained
from kvblocks.prompts import Prompts, checked_prompts
from kvblocks.runtime import ModelRunner
from kvblocks.scheduler import Scheduler, SchedulerOutput, Sequence
from kvblocks.step import BlockManagerProtocol


class PoolTooSmall(RuntimeError):
    """The KV-cache pool cannot hold a single request (raise ``num_blocks``)."""


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
        for name in ("max_tokens", "n", "seed", "eos_token_id"):
            value = getattr(self, name)
            optional = name in ("seed", "eos_token_id")
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (
                optional and value is None
            ):
                kind = "an int or None" if optional else "an int"
                raise TypeError(f"{name} must be {kind}, not {type(value).__name__}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, not {type(value).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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

    def output(self) -> RequestOutput:
        first = self.samples[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(s.sample_index, s.output_token_ids, s.finish_reason)
                for s in self.samples
            ],
            num_cached_tokens=first.num_cached_tokens or 0,
        )


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
        if num_blocks is None:
            num_blocks = 4096
        module: Any = _core if backend == "rust" else reference
        self.manager: BlockManagerProtocol = module.BlockManager(
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
        self._generators: dict[int, torch.Generator] = {}
        self._owner: dict[int, _Request] = {}
        self._counter = 0
        self._bookkeeping_in_sampling = 0.0

    def _sample_one(
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
        prompt_token_ids: Prompts,
        sampling_params: SamplingParams | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt (one prompt of token ids, or a list of them: lists, tuples or
        1-D integer numpy arrays); ``progress(finished, total)`` is called after each step.
        Anything but integer token ids in the vocabulary raises ``TypeError`` or
        ``ValueError`` naming the prompt and the position, before anything is scheduled."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                "sampling_params must be a SamplingParams (e.g. SamplingParams(max_tokens=3)), "
                f"not {type(sampling_params).__name__}"
            )
        params = sampling_params or SamplingParams()
        # Engine input, neither bookkeeping nor model time.
        prompts = checked_prompts(prompt_token_ids, self.model.config.vocab_size)
        try:
            requests = self._add_requests(prompts, params)
            while self.scheduler.has_unfinished():
                self._step()
                if progress is not None:
                    finished = sum(all(s.finish_reason for s in r.samples) for r in requests)
                    progress(finished, len(requests))
        finally:
            # Keyed by id(): an id is reused once its sequence is gone.
            self._owner.clear()
            self._generators.clear()
        snapshot = self.manager.make_prefix_cache_stats()
        if snapshot is not None:
            self.stats.prefix_queries += snapshot.queries + snapshot.preempted_queries
            self.stats.prefix_hits += snapshot.hits + snapshot.preempted_hits
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return [r.output() for r in requests]

    def _add_requests(self, prompts: list[list[int]], params: SamplingParams) -> list[_Request]:
        """Adds one sequence per prompt to the scheduler (timed as bookkeeping)."""
        start = time.perf_counter()
        requests = []
        for prompt in prompts:
            request = _Request(f"req-{self._counter}", params)
            self._counter += 1
            seq = Sequence(request.request_id, prompt, params.max_tokens, params.eos_token_id)
            self.scheduler.add(seq)
            request.samples.append(seq)
            self._owner[id(seq)] = request
            requests.append(request)
        self.stats.bookkeeping_s += time.perf_counter() - start
        return requests

    def _step(self) -> None:
        """One engine step: schedule (bookkeeping), run the model, sample (with forks and
        finishing, which are bookkeeping again)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out is None:
            shortest = min(s.num_tokens for s in self.scheduler.waiting)
            needs = -(-shortest // self.manager.block_size)
            raise PoolTooSmall(
                f"the pool cannot hold a single request: raise num_blocks (num_blocks "
                f"{self.manager.num_blocks}, of which block 0 is the null block; the shortest "
                f"waiting request needs {needs} blocks)"
            )
        logits = self.runner.execute(out.step)
        self._bookkeeping_in_sampling = 0.0
        self.scheduler.update(self._sample(out, logits))
        t2 = time.perf_counter()
        self.stats.steps += 1
        self.stats.bookkeeping_s += (t1 - t0) + self._bookkeeping_in_sampling
        self.stats.model_s += (t2 - t1) - self._bookkeeping_in_sampling

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> npt.NDArray[np.int64]:
        """Samples a token for every row that reached the end of its sequence (``-1`` for
        prefill chunks), forks parallel samples at their first token, finishes sequences."""
        seq_lens = out.step.seq_lens.tolist()
        sampled = np.full(len(out.sequences), -1, dtype=np.int64)
        greedy: list[int] | None = None
        for row, seq in enumerate(out.sequences):
            if seq_lens[row] < seq.num_tokens:
                continue  # a prefill chunk: no token yet
            request = self._owner[id(seq)]
            params = request.params
            if params.temperature == 0:
                if greedy is None:
                    greedy = logits.argmax(dim=-1).tolist()
                token = greedy[row]
            else:
                token = self._sample_one(logits[row], params, self._generator_of(seq, params))
            sampled[row] = token
            if len(request.samples) < params.n and seq is request.samples[0]:
                greedy_token = token if params.temperature == 0 else None
                self._fork_samples(request, seq, logits[row], greedy_token)
            self._append(seq, token)
        return sampled

    def _fork_samples(
        self, request: _Request, seq: Sequence, logits: torch.Tensor, greedy_token: int | None
    ) -> None:
        """At its first token, a request with ``n > 1`` forks its other samples; they share
        the prompt's blocks and sample their own first token from the same logits (greedy:
        the same token)."""
        params = request.params
        for i in range(1, params.n):
            child = Sequence(
                f"{request.request_id}-{i}",
                seq.prompt_token_ids,
                params.max_tokens,
                params.eos_token_id,
                num_cached_tokens=seq.num_cached_tokens,
                sample_index=i,
            )
            request.samples.append(child)
            self._owner[id(child)] = request
            if greedy_token is not None:
                token = greedy_token
            else:
                token = self._sample_one(logits, params, self._generator_of(child, params))
            f0 = time.perf_counter()
            self.scheduler.fork(seq, child, token)
            self._bookkeeping_in_sampling += time.perf_counter() - f0
            self._append(child, token)

    def _append(self, seq: Sequence, token: int) -> None:
        """Records a sampled token and finishes the sequence at EOS or its length limit."""
        seq.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        reason = None
        if seq.eos_token_id is not None and token == seq.eos_token_id:
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            f0 = time.perf_counter()
            self.scheduler.finish(seq, reason)
            self._bookkeeping_in_sampling += time.perf_counter() - f0

    def _generator_of(self, seq: Sequence, params: SamplingParams) -> torch.Generator:
        """Sample ``i`` with a seed draws from its own generator (``seed + i``)."""
        if params.seed is None:
            return self._generator
        generator = self._generators.get(id(seq))
        if generator is None:
            generator = torch.Generator().manual_seed(params.seed + seq.sample_index)
            self._generators[id(seq)] = generator
        return generator
