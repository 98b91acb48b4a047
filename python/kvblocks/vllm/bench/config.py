"""vLLM's configuration for the benchmark: the CPU platform, a tiny model, and the scheduler.

:class:`SchedulerSpec` names the knobs, :func:`make_vllm_config` turns it into a
``VllmConfig``, :func:`make_kv_cache_config` into the KV-cache layout, and
:func:`make_scheduler` into vLLM's own scheduler over both. This is what
``kvblocks bench --engine vllm`` needs and no more: no KV connector, no speculative decoding.
A subclass of :class:`SchedulerSpec` adds those by overriding its hook methods (the
repository's test driver, ``tests/vllm_driver``, does, with fake worker sides of vLLM's
connectors and a fake drafter; they are test doubles and do not ship).

vLLM picks its platform once, from ``VLLM_TARGET_DEVICE``, when ``vllm.config`` is first
imported. The benchmark wants the CPU platform (it runs only the scheduler, which never
touches a device, and the PyPI wheel is a CUDA build: without a GPU vLLM finds no platform and
a ``VllmConfig`` cannot infer a device), so nothing here imports vLLM at module level: each
function first calls :func:`select_cpu_platform`, which sets ``VLLM_TARGET_DEVICE=cpu`` unless
the caller has set it.
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench.fake_model import FakeModel
from kvblocks.vllm.bench.platform import MAX_MODEL_LEN, VOCAB_SIZE, select_cpu_platform

if TYPE_CHECKING:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

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


#: The KV-cache layouts the benchmark builds, by the model family they stand for: each a list
#: of groups ``(kind, size)`` with kind ``full``, ``mla``, ``sliding_window`` (size: the
#: window), ``chunked_local`` (size: the attention chunk) or ``mamba`` (size: the Mamba block
#: size; 0 for vLLM's default). The sizes are the families'; the tests also build
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
    """The knobs the benchmark (and the tests) turn; everything else is vLLM's default.

    The hook methods below add nothing here; a subclass overrides them to add a KV connector
    or speculative decoding (each says where :func:`make_vllm_config`,
    :func:`make_kv_cache_config` and :func:`~kvblocks.vllm.bench.timing.timed_run` call it)."""

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
    #: More ``SchedulerConfig`` fields (``policy``, ``long_prefill_token_threshold``, ...).
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: More ``VllmConfig`` fields.
    extra: dict[str, Any] = field(default_factory=dict)
    #: Mamba groups' ``prefill_checkpoint_alignment`` where their layers export prefill
    #: checkpoints (vLLM gives the spec one checkpoint block then): Qwen3.5's gated delta-net
    #: uses the Mamba block size, Mamba2 layers 1. ``None``: no checkpoints (Mamba1).
    mamba_checkpoint_alignment: int | None = None

    @property
    def has_kv_connector(self) -> bool:
        """Whether the configuration sets a KV connector (then ``EngineCore`` hashes every
        request's blocks, prefix caching or not)."""
        return False

    @property
    def config_async_scheduling(self) -> bool:
        """The ``async_scheduling`` flag of the ``SchedulerConfig``."""
        return self.async_scheduling

    def config_extras(self, model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
        """More ``VllmConfig`` fields, built for ``model`` (a KV connector's
        ``kv_transfer_config``, a ``speculative_config``)."""
        return {}

    def building_config(self) -> AbstractContextManager[None]:
        """What holds while the ``VllmConfig`` is built."""
        return nullcontext()

    def kv_cache_tensors(self, groups: list[KVCacheGroupSpec]) -> list[Any]:
        """The ``KVCacheConfig``'s tensors for ``groups`` (the scheduler never reads them)."""
        return []

    def adjust_kv_cache_config(self, config: KVCacheConfig, vllm_config: VllmConfig) -> None:
        """What vLLM's KV-cache planning changes in ``config`` for ``vllm_config``."""

    def fake_model(self, scheduler: Scheduler) -> FakeModel:
        """The fake model :func:`~kvblocks.vllm.bench.timing.timed_run` steps ``scheduler``
        with."""
        return FakeModel()


def make_vllm_config(model_dir: Path, spec: SchedulerSpec) -> VllmConfig:
    """The ``VllmConfig`` of ``spec`` for the model in ``model_dir``, on vLLM's CPU platform
    (:func:`select_cpu_platform`)."""
    select_cpu_platform()
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    async_flag = spec.config_async_scheduling
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
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    models = model_config(model_dir)
    if spec.max_model_len != models.max_model_len:
        models = copy.copy(models)  # the cached config is shared
        models.max_model_len = spec.max_model_len
    parallel_config = extra.pop("parallel_config", None) or ParallelConfig()
    extra.update(spec.config_extras(models, parallel_config))
    with spec.building_config():
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
    with ``vllm_config``, as vLLM's planning adjusts them for it
    (:meth:`SchedulerSpec.adjust_kv_cache_config`)."""
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
    config = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=spec.kv_cache_tensors(groups),
        kv_cache_groups=groups,
        prefix_cache_retention_interval=spec.retention_interval,
    )
    if vllm_config is not None:
        spec.adjust_kv_cache_config(config, vllm_config)
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
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

    # EngineCore records both on the config it gives the scheduler; a KV connector's scheduler
    # side reads them (vLLM 0.34's NIXL and Mooncake truncate a prefill's hashes by them).
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
