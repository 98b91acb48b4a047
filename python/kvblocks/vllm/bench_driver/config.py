"""vLLM's configuration for the driver: the CPU platform, a tiny model, and the scheduler.

Every vLLM configuration the driver (and the vLLM test tier) builds comes from here:
:class:`SchedulerSpec` names the knobs, :func:`make_vllm_config` turns it into a
``VllmConfig``, :func:`make_kv_cache_config` into the KV-cache layout, and
:func:`make_scheduler` into vLLM's own scheduler over both. Speculative decoding
(:class:`~kvblocks.vllm.bench_driver.speculative.Speculation`) is vLLM's own
``SpeculativeConfig``, built in :mod:`~kvblocks.vllm.bench_driver.speculative`.

vLLM picks its platform once, from ``VLLM_TARGET_DEVICE``, when ``vllm.config`` is first
imported. The driver wants the CPU platform (it runs only the scheduler, which never touches a
device, and the PyPI wheel is a CUDA build: without a GPU vLLM finds no platform and a
``VllmConfig`` cannot infer a device), so nothing here imports vLLM at module level: each
function first calls :func:`select_cpu_platform`, which sets ``VLLM_TARGET_DEVICE=cpu`` unless
the caller has set it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench_driver.speculative import (
    Speculation,
    mark_draft_groups,
    speculative_config,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig

VOCAB_SIZE = 32000
MAX_MODEL_LEN = 8192

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@functools.cache
def select_cpu_platform() -> None:
    """Sets ``VLLM_TARGET_DEVICE=cpu`` for this process unless it is set already, before the
    driver's first import of vLLM (see the module's docstring). Raises RuntimeError where
    vLLM was imported earlier and found no platform: then no ``VllmConfig`` can be built, and
    the fix is to set ``VLLM_TARGET_DEVICE=cpu`` before anything imports vLLM."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():  # not cached: a later call checks again
        raise RuntimeError(
            "vLLM was imported before VLLM_TARGET_DEVICE=cpu was set and found no device; "
            "set VLLM_TARGET_DEVICE=cpu before anything imports vllm"
        )


@contextmanager
def _scheduler_only_cpu_platform() -> Iterator[None]:
    """TEST AND BENCHMARK ONLY: while the driver's ``VllmConfig`` is built, vLLM 0.34's CPU
    platform check is told Triton is there, so that it does not refuse x86 without Triton
    ("vLLM on x86 CPUs requires Triton (triton-cpu)"; PyPI has no triton-cpu, and PyPI's
    triton finds no active driver without a GPU). Its model runner needs Triton's CPU backend;
    the driver runs no model runner (vLLM's scheduler and a fake model). Only the platform's
    check sees the flag, and only while it runs: a module vLLM imports meanwhile reads the
    real value. kvblocks itself never sets it (a user's vLLM is left as vLLM decides)."""
    try:
        import vllm.triton_utils
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # a vLLM without them has no such check
        yield
        return
    check = CpuPlatform.__dict__.get("check_and_update_config")
    if not isinstance(check, classmethod):
        yield
        return

    def told_triton_is_there(cls: Any, vllm_config: Any) -> None:
        has_triton = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            check.__func__(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = has_triton

    CpuPlatform.check_and_update_config = classmethod(told_triton_is_there)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = check


def write_model_dir(path: Path) -> Path:
    """Writes the tiny model's ``config.json`` into ``path`` (a directory) and returns it."""
    (path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    return path


@functools.cache
def tiny_model_dir() -> Path:
    """A process-wide temporary directory holding the tiny model's config."""
    return write_model_dir(Path(tempfile.mkdtemp(prefix="kvblocks-tiny-")))


@functools.cache
def model_config(model_dir: Path) -> ModelConfig:
    """One ``ModelConfig`` per directory (building one inspects the architecture: slow)."""
    select_cpu_platform()
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )


#: The KV-cache layouts the driver builds, by the model family they stand for: each a list
#: of groups ``(kind, size)`` with kind ``full``, ``mla``, ``sliding_window`` (size: the
#: window), ``chunked_local`` (size: the attention chunk) or ``mamba`` (size: the Mamba block
#: size; 0 for vLLM's default). The sizes are the families'; the driver's tests also build
#: small ones (:func:`layout_groups`).
LAYOUTS: dict[str, list[tuple[str, int]]] = {
    # Llama 3, Qwen 2.5/3 dense, Mistral 7B without a window: one full-attention group.
    "llama": [("full", 0)],
    # gpt-oss: full attention and a 128-token sliding window, one group each.
    "gpt-oss": [("full", 0), ("sliding_window", 128)],
    # Gemma 3: five sliding-window (1024) layers to one full-attention layer, one group each.
    "gemma3": [("sliding_window", 1024)] * 5 + [("full", 0)],
    # Llama 4: chunked local attention (8192) and full attention.
    "llama4": [("chunked_local", 8192), ("full", 0)],
    # DeepSeek V3/R1, Kimi K2: one MLA group (vLLM's FullAttentionManager manages it).
    "mla": [("mla", 0)],
    # Qwen3.5 / Qwen3-Next: three gated delta-net (linear attention) layers to one
    # full-attention layer; vLLM groups layers of one kind by the count of the rarer kind.
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
    # Jamba, Nemotron-H: one attention layer to seven Mamba layers.
    "jamba": [("full", 0)] + [("mamba", 0)] * 7,
}


@dataclass
class SchedulerSpec:
    """The knobs the tests turn; everything else is vLLM's default."""

    block_size: int = 16
    num_blocks: int = 512
    #: A :data:`LAYOUTS` name, or explicit ``(kind, size)`` groups.
    layout: str | list[tuple[str, int]] = "llama"
    #: vLLM's ``prefix_cache_retention_interval`` (its default is 0: sliding-window groups
    #: keep only the windows a replay can use).
    retention_interval: int | None = 0
    hash_algo: str = "sha256"
    enable_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = False
    watermark: float = 0.0
    kv_events: bool = False
    max_model_len: int = MAX_MODEL_LEN
    #: Speculative decoding (vLLM's ``SpeculativeConfig`` for it), or none.
    speculative: Speculation | None = None
    #: More ``SchedulerConfig`` fields (``policy``, ``long_prefill_token_threshold``, ...).
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: More ``VllmConfig`` fields.
    extra: dict[str, Any] = field(default_factory=dict)
    #: vLLM's native CPU offloading (the ``OffloadingConnector`` as ``--kv-offloading-size``
    #: sets it up, :mod:`~kvblocks.vllm.bench_driver.offloading`): the CPU tier's size in
    #: chunks, each ``blocks_per_chunk`` GPU blocks (1 unless ``kv_offloading_config`` says
    #: otherwise); 0 turns it off. Requests need block hashes even without prefix caching
    #: (``EngineCore`` hashes them for a KV connector too).
    kv_offloading: int = 0
    #: More ``kv_connector_extra_config`` for offloading (``eviction_policy``,
    #: ``offload_prompt_only``, ``blocks_per_chunk``, ``self_describing_kv_events``, ...).
    kv_offloading_config: dict[str, Any] = field(default_factory=dict)
    #: Mamba groups' ``prefill_checkpoint_alignment`` where their layers export prefill
    #: checkpoints (vLLM gives the spec one checkpoint block then): Qwen3.5's gated delta-net
    #: uses the Mamba block size, Mamba2 layers 1. ``None``: no checkpoints (Mamba1).
    mamba_checkpoint_alignment: int | None = None
    #: vLLM's ``NixlConnector`` in both roles (disaggregated prefill and decode,
    #: :mod:`~kvblocks.vllm.bench_driver.nixl`); requests say which role theirs is. With
    #: ``kv_offloading`` too, vLLM's ``MultiConnector`` runs both
    #: (:mod:`~kvblocks.vllm.bench_driver.multi`).
    nixl: bool = False
    #: NIXL's transfer mode: "pull" (the decode node reads, ``NixlConnector``) or "push" (the
    #: prefill node writes, ``NixlPushConnector``).
    nixl_transfer_mode: str = "pull"
    #: NIXL alone: every how many completed loads the fake worker side fails one (0: none),
    #: and vLLM's ``kv_load_failure_policy`` then ("fail", vLLM's default, or "recompute").
    nixl_failed_loads: int = 0
    kv_load_failure_policy: str = "fail"
    #: vLLM's ``MooncakeConnector`` in both roles (disaggregated prefill and decode,
    #: :mod:`~kvblocks.vllm.bench_driver.mooncake`); requests say which role theirs is.
    mooncake: bool = False
    #: vLLM's ``DecodeBenchConnector`` (:mod:`~kvblocks.vllm.bench_driver.decode_bench`): every
    #: prompt but its last token arrives as filled KV; "startup" with vLLM's ``startup_fill``.
    decode_bench: str = ""

    @property
    def has_kv_connector(self) -> bool:
        """Whether the configuration sets a KV connector (then ``EngineCore`` hashes every
        request's blocks, prefix caching or not)."""
        return bool(self.kv_offloading or self.nixl or self.decode_bench or self.mooncake)

    def __post_init__(self) -> None:
        if self.kv_offloading < 0:
            raise ValueError(f"kv_offloading must be >= 0 chunks, not {self.kv_offloading}")
        if self.decode_bench not in ("", "per request", "startup"):
            raise ValueError(
                f"decode_bench is '', 'per request' or 'startup', not {self.decode_bench!r}"
            )
        alone = [bool(self.decode_bench), self.mooncake, bool(self.nixl or self.kv_offloading)]
        if sum(alone) > 1:
            raise ValueError(
                "one KV connector at a time (NIXL with CPU offloading is one, vLLM's "
                "MultiConnector): decode_bench, mooncake, or nixl / kv_offloading"
            )
        if self.nixl_transfer_mode not in ("pull", "push"):
            raise ValueError(
                f"nixl_transfer_mode is 'pull' or 'push', not {self.nixl_transfer_mode!r}"
            )
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(
                "kv_load_failure_policy is 'fail' or 'recompute', not "
                f"{self.kv_load_failure_policy!r}"
            )
        if self.nixl_failed_loads < 0 or (
            self.nixl_failed_loads and (not self.nixl or self.kv_offloading)
        ):
            raise ValueError(
                "nixl_failed_loads is a count >= 0 of loads, for NIXL alone, not "
                f"{self.nixl_failed_loads} (nixl={self.nixl}, kv_offloading={self.kv_offloading})"
            )
        if self.async_scheduling and self.speculative and self.speculative.method == "suffix":
            # V2 does not run suffix decoding, and V1 refuses it with async scheduling.
            raise ValueError("vLLM has no model runner for suffix decoding under async scheduling")


def make_vllm_config(model_dir: Path, spec: SchedulerSpec) -> VllmConfig:
    """The ``VllmConfig`` of ``spec`` for the model in ``model_dir``, on vLLM's CPU platform
    (:func:`select_cpu_platform`)."""
    select_cpu_platform()
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    speculation = spec.speculative
    # vLLM's CPU platform turns async scheduling off in the config anyway (the driver's
    # scheduler class is what makes it async); asking for it would only run the check of
    # the V1 model runner, the one the CPU gets, which refuses n-gram drafting under async
    # scheduling (the V2 runner, the GPU default, runs it).
    async_flag = spec.async_scheduling and not (speculation and speculation.method == "ngram")
    scheduler_config = SchedulerConfig(
        # vLLM needs a token budget of at least one token per sequence.
        max_num_seqs=min(spec.max_num_seqs, spec.max_num_batched_tokens),
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=async_flag,
        watermark=spec.watermark,
        **spec.scheduler,
    )
    cache_config = CacheConfig(
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_caching,
        prefix_caching_hash_algo=spec.hash_algo,
    )
    cache_config.num_gpu_blocks = spec.num_blocks
    if any(kind == "mamba" for kind, _ in layout_groups(spec.layout)):
        # What vLLM's config does for models with Mamba layers (MambaModelConfig): prefix
        # caching caches Mamba states in "align" mode, else none.
        cache_config.mamba_cache_mode = "align" if spec.enable_caching else "none"
    extra = dict(spec.extra)
    if spec.kv_offloading and spec.nixl:
        from kvblocks.vllm.bench_driver import multi

        extra["kv_transfer_config"] = multi.kv_transfer_config(spec, make_kv_cache_config(spec))
    elif spec.kv_offloading:
        from kvblocks.vllm.bench_driver.offloading import kv_transfer_config

        extra["kv_transfer_config"] = kv_transfer_config(spec, make_kv_cache_config(spec))
    elif spec.nixl:
        from kvblocks.vllm.bench_driver import nixl

        extra["kv_transfer_config"] = nixl.kv_transfer_config(
            spec.nixl_transfer_mode, spec.nixl_failed_loads, spec.kv_load_failure_policy
        )
    elif spec.mooncake:
        from kvblocks.vllm.bench_driver import mooncake

        extra["kv_transfer_config"] = mooncake.kv_transfer_config()
    elif spec.decode_bench:
        from kvblocks.vllm.bench_driver import decode_bench

        startup = spec.decode_bench == "startup"
        extra["kv_transfer_config"] = decode_bench.kv_transfer_config(startup)
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    models = model_config(model_dir)
    if spec.max_model_len != models.max_model_len:
        models = copy.copy(models)  # the cached config is shared
        models.max_model_len = spec.max_model_len
    parallel_config = extra.pop("parallel_config", None) or ParallelConfig()
    if speculation is not None:
        extra["speculative_config"] = speculative_config(speculation, models, parallel_config)
    with _scheduler_only_cpu_platform():
        config = VllmConfig(
            model_config=models,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            **extra,
        )
    if spec.has_kv_connector and async_flag:
        # Back on after the CPU platform turned it off: with a KV connector the scheduler
        # defers freeing blocks while a later step may still write them (defer_block_free),
        # as it does under async scheduling on a GPU.
        config.scheduler_config.async_scheduling = True
    return config


def layout_groups(layout: str | list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The groups of a layout: a :data:`LAYOUTS` name, or the groups themselves."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        return LAYOUTS[layout]
    return list(layout)


def make_kv_cache_config(
    spec: SchedulerSpec, vllm_config: VllmConfig | None = None
) -> KVCacheConfig:
    """``spec.layout``'s KV-cache groups over one pool of ``spec.num_blocks`` blocks, each
    group's spec as vLLM builds it for that kind (tiny head sizes: nothing is allocated);
    with ``vllm_config``, as vLLM's planning adjusts them for its speculative decoding
    (:func:`~kvblocks.vllm.bench_driver.speculative.mark_draft_groups`)."""
    select_cpu_platform()
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    common = {"block_size": spec.block_size, "num_kv_heads": 1, "head_size": 1}
    groups = []
    num_speculative = vllm_config.num_speculative_tokens if vllm_config is not None else 0
    for i, (kind, size) in enumerate(layout_groups(spec.layout)):
        if kind == "full":
            group_spec: Any = FullAttentionSpec(**common, dtype=torch.float32)
        elif kind == "mla":
            group_spec = MLAAttentionSpec(**common, dtype=torch.float32)
        elif kind == "sliding_window":
            group_spec = SlidingWindowSpec(**common, dtype=torch.float32, sliding_window=size)
        elif kind == "chunked_local":
            group_spec = ChunkedLocalAttentionSpec(
                **common, dtype=torch.float32, attention_chunk_size=size
            )
        elif kind == "mamba":
            group_spec = MambaSpec(
                # vLLM's default: the attention block size in "align" mode, else the model
                # length (one block holds a request's running state).
                block_size=size or (spec.block_size if spec.enable_caching else spec.max_model_len),
                shapes=((1,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align" if spec.enable_caching else "none",
                num_speculative_blocks=num_speculative,
                num_prefill_checkpoint_blocks=int(spec.mamba_checkpoint_alignment is not None),
                prefill_checkpoint_alignment=spec.mamba_checkpoint_alignment,
            )
        else:
            raise ValueError(f"unknown KV-cache group kind {kind!r}")
        groups.append(KVCacheGroupSpec([f"layer.{i}"], group_spec))
    tensors = []
    if spec.kv_offloading:
        # The connector sizes the CPU tier's chunks from them (vLLM's planning always
        # describes them; the scheduler and its KV-cache manager never read them).
        from kvblocks.vllm.bench_driver.offloading import kv_cache_tensors

        tensors = kv_cache_tensors(groups, spec.num_blocks)
    config = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=spec.retention_interval,
    )
    if vllm_config is not None and vllm_config.speculative_config is not None:
        draft_groups = spec.speculative.draft_groups if spec.speculative else None
        mark_draft_groups(config, vllm_config, draft_groups)
    return config


def make_scheduler(
    model_dir: Path,
    spec: SchedulerSpec,
    *,
    scheduler_cls: type[Scheduler] | None = None,
    kv_cache_config: KVCacheConfig | None = None,
) -> Scheduler:
    """vLLM's scheduler (``AsyncScheduler`` under async scheduling, or ``scheduler_cls``) for
    ``spec``, on :func:`make_kv_cache_config`'s layout or ``kv_cache_config``."""
    vllm_config = make_vllm_config(model_dir, spec)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if scheduler_cls is None:
        scheduler_cls = Scheduler
        if spec.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            scheduler_cls = AsyncScheduler
    kv_cache_config = kv_cache_config or make_kv_cache_config(spec, vllm_config)
    block_size = hash_block_size = spec.block_size
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if len(kv_cache_config.kv_cache_groups) == 1 and sizes != {spec.block_size}:
        # A Mamba-only model: vLLM's block size is the Mamba group's.
        (block_size,) = (hash_block_size,) = sizes
    elif len(sizes) > 1:
        # Groups of several block sizes (Mamba): the sizes EngineCore gives the scheduler.
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
