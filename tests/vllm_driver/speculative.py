"""Speculative decoding for the driver: :class:`Speculation` (what a ``SchedulerSpec`` asks
for) and vLLM's own ``SpeculativeConfig`` for it, built offline.

Every method is vLLM's real ``SpeculativeConfig``, so that the properties the scheduler and
the KV-cache manager read (``VllmConfig.num_lookahead_tokens``,
``num_prefill_lookahead_tokens``, ``num_hash_lookahead_tokens``, ``use_eagle_block_drop()``,
``max_num_new_slots_for_drafting``, ...) are vLLM's code, not a copy:

- ``ngram`` and ``ngram_gpu`` need nothing but the target model's config;
- ``eagle``, ``eagle3``, ``mtp``, ``draft_model``, ``dflash`` and ``dspark`` need a draft
  model: a tiny ``config.json`` written to a temporary directory (EAGLE and EAGLE-3: a
  one-layer Llama head; MTP: a DeepSeek-V3 config whose ``num_nextn_predict_layers`` is the
  number of MTP modules, which vLLM turns into its ``deepseek_mtp`` draft; a separate draft
  model: a tiny Llama like the target; DFlash: a one-layer Qwen3 ``DFlashDraftModel``;
  DSpark: a one-layer ``Qwen3DSparkModel``, whose ``sample_from_anchor`` says whether it
  drafts fill-in style). No weights are read. vLLM inspects each draft architecture once, in
  a subprocess (some seconds), and caches the result under ``VLLM_CACHE_ROOT``;
- ``suffix``: vLLM's config refuses to build unless the ``arctic_inference`` package can be
  imported (its only use is the worker's proposer, which the driver does not run), so the
  driver answers that one check "yes" while the config is built
  (:func:`_arctic_inference_check_passes`); every field and property is vLLM's;
- ``dspark`` runs only on vLLM's V2 model runner (vLLM 0.33's ``VllmConfig`` refuses it on
  the V1 runner, the one the CPU gets): :func:`v2_model_runner` selects V2 the way a user
  does, ``VLLM_USE_V2_MODEL_RUNNER=1``, for as long as the config and the scheduler are built
  and run (the scheduler reads the choice at start-up). :data:`V2_ONLY` names such methods.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: The methods the driver builds (those kvblocks' guard allows).
METHODS = (
    "ngram",
    "ngram_gpu",
    "suffix",
    "eagle",
    "eagle3",
    "mtp",
    "draft_model",
    "dflash",
    "dspark",
)
#: Methods whose drafter has its own forward pass and a draft model (a ``config.json``):
#: they propose k drafts for every request, and reserve lookahead slots.
DRAFT_MODEL_METHODS = frozenset({"eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark"})
#: Methods vLLM 0.33 runs only on its V2 model runner (:func:`v2_model_runner`).
V2_ONLY = frozenset({"dspark"})


def _release() -> tuple[int, ...]:
    """The installed vLLM's major and minor version."""
    from kvblocks.vllm.versions import installed_vllm_version

    version = installed_vllm_version() or "0.0"
    return tuple(int(part) for part in version.split(".")[:2])


#: Whether the installed vLLM drafts a separate draft model in parallel (PARD,
#: ``parallel_drafting`` with ``draft_model``): 0.33 does; 0.34 dropped it (the flag is
#: deprecated there, and refused for any method but DFlash and DSpark).
HAS_PARD = _release() < (0, 34)
#: Whether the installed vLLM still has its V1 model runner beside the V2 one (0.33: the
#: scheduler's ``use_v2_model_runner`` says which runs); 0.34 has only the V2 runner.
HAS_V1_MODEL_RUNNER = _release() < (0, 34)


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as a ``SchedulerSpec`` asks for it: the method, the draft length
    ``k`` and the flags of vLLM's ``SpeculativeConfig`` that reach the KV-cache manager."""

    method: str
    num_speculative_tokens: int = 3
    #: EAGLE/MTP: use the EAGLE last-block drop instead of lookahead block hashes.
    disable_lookahead_block_hashes: bool = False
    #: EAGLE/MTP: neither (vLLM's experimental ``disable_eagle_block_drop``).
    disable_eagle_block_drop: bool = False
    #: MTP: the draft's ``num_nextn_predict_layers`` (default: ``num_speculative_tokens``,
    #: so that k > 1 is multi-module MTP and ``num_prefill_lookahead`` is k).
    mtp_modules: int | None = None
    #: Which KV-cache groups hold the draft model's layers (vLLM flags them
    #: ``is_eagle_group`` when the method needs the EAGLE block drop). ``None``: the first
    #: full-attention or MLA group, where an EAGLE head or MTP module's attention lands.
    draft_groups: tuple[int, ...] | None = None
    #: A separate draft model: vLLM's ``parallel_drafting`` (PARD: k new query slots a
    #: request instead of one, ``max_num_new_slots_for_drafting``).
    parallel_drafting: bool = False
    #: DSpark: a fill-in draft (``sample_from_anchor: false`` in its config): a bonus query
    #: and one per draft, so k + 1 lookahead slots as DFlash, instead of k.
    fill_in: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; expected one of {METHODS}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.mtp_modules is not None and (self.method != "mtp" or self.mtp_modules < 1):
            raise ValueError("mtp_modules is a positive count, for method 'mtp' only")
        if self.parallel_drafting and self.method != "draft_model":
            raise ValueError("parallel_drafting is for method 'draft_model' only")
        if self.parallel_drafting and not HAS_PARD:
            raise ValueError("this vLLM has no parallel drafting for 'draft_model' (PARD)")
        if self.fill_in and self.method != "dspark":
            raise ValueError("fill_in is for method 'dspark' only")

    @property
    def drafts_every_step(self) -> bool:
        """Drafters with their own forward pass (EAGLE-style, a draft model, DFlash, DSpark)
        propose k tokens for every request; n-gram and suffix decoding propose up to k, or
        none when nothing matches."""
        return self.method in DRAFT_MODEL_METHODS


def _eagle_head(architecture: str, vocab_size: int, max_len: int) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }


def _deepseek_mtp(modules: int, vocab_size: int, max_len: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": modules,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_len,
        "torch_dtype": "float32",
    }


def _qwen3_draft(architecture: str, vocab_size: int, max_len: int) -> dict[str, Any]:
    """A one-layer Qwen3 draft of DFlash's kind (DSpark's builds on it): it reads the
    target's layer 0 and marks the tokens it fills in with token 0."""
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "dflash_config": {"target_layer_ids": [0], "mask_token_id": 0},
    }


@functools.cache
def draft_model_dir(
    method: str, modules: int, vocab_size: int, max_len: int, fill_in: bool = False
) -> Path:
    """A process-wide temporary directory holding the draft model's ``config.json`` for an
    EAGLE, EAGLE-3, MTP (``modules`` MTP layers), separate draft model, DFlash or DSpark
    (``fill_in``: not sampling from the anchor) config."""
    if method == "eagle":
        config = _eagle_head("EagleLlamaForCausalLM", vocab_size, max_len)
    elif method == "eagle3":
        config = _eagle_head("Eagle3LlamaForCausalLM", vocab_size, max_len)
    elif method == "mtp":
        config = _deepseek_mtp(modules, vocab_size, max_len)
    elif method == "draft_model":
        config = {**_eagle_head("LlamaForCausalLM", vocab_size, max_len), "num_hidden_layers": 2}
    elif method == "dflash":
        config = _qwen3_draft("DFlashDraftModel", vocab_size, max_len)
    elif method == "dspark":
        config = {
            **_qwen3_draft("Qwen3DSparkModel", vocab_size, max_len),
            "sample_from_anchor": not fill_in,
        }
    else:
        raise ValueError(f"method {method!r} has no draft model")
    path = Path(tempfile.mkdtemp(prefix=f"kvblocks-{method}-draft-"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@contextmanager
def v2_model_runner(speculation: Speculation | None) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER=1`` while the block runs, for a method only vLLM's V2 model
    runner runs (:data:`V2_ONLY`; vLLM reads the variable each time it decides, when the
    ``VllmConfig`` is validated and when the scheduler starts); nothing for another."""
    if speculation is None or speculation.method not in V2_ONLY:
        yield
        return
    import os

    name = "VLLM_USE_V2_MODEL_RUNNER"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@contextmanager
def _arctic_inference_check_passes() -> Iterator[None]:
    """vLLM 0.33's suffix-decoding config checks that ``arctic_inference`` can be imported;
    the scheduler never imports it (the worker's proposer does), so the check is answered yes
    while the config is built. (vLLM 0.34 has no such check.)"""
    from vllm.config import speculative

    if not hasattr(speculative, "has_arctic_inference"):
        yield
        return
    original = speculative.has_arctic_inference
    speculative.has_arctic_inference = lambda: True
    try:
        yield
    finally:
        speculative.has_arctic_inference = original


def speculative_config(
    speculation: Speculation, target: ModelConfig, parallel: ParallelConfig
) -> SpeculativeConfig:
    """vLLM's ``SpeculativeConfig`` for ``speculation`` on the ``target`` model."""
    from vllm.config import SpeculativeConfig

    kwargs: dict[str, Any] = {
        "method": speculation.method,
        "num_speculative_tokens": speculation.num_speculative_tokens,
        "target_model_config": target,
        "target_parallel_config": parallel,
        "disable_lookahead_block_hashes": speculation.disable_lookahead_block_hashes,
        "disable_eagle_block_drop": speculation.disable_eagle_block_drop,
    }
    if speculation.parallel_drafting:
        kwargs["parallel_drafting"] = True
    if speculation.method in DRAFT_MODEL_METHODS:
        modules = speculation.mtp_modules or speculation.num_speculative_tokens
        draft = draft_model_dir(
            speculation.method,
            modules,
            target.get_vocab_size(),
            target.max_model_len,
            speculation.fill_in,
        )
        kwargs["model"] = str(draft)
    if speculation.method == "suffix":
        with _arctic_inference_check_passes():
            return SpeculativeConfig(**kwargs)
    return SpeculativeConfig(**kwargs)


def mark_draft_groups(
    kv_cache_config: KVCacheConfig, vllm_config: VllmConfig, draft_groups: tuple[int, ...] | None
) -> None:
    """What vLLM's KV-cache planning does to the groups for speculative decoding: every
    sliding-window spec retains ``num_prefill_lookahead_tokens - 1`` extra tokens (multi-module
    MTP), and where the method needs the EAGLE block drop the groups holding draft layers
    are flagged ``is_eagle_group`` (``draft_groups``, or the first full-attention/MLA group)."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    groups = kv_cache_config.kv_cache_groups
    for group in groups:
        if isinstance(group.kv_cache_spec, SlidingWindowSpec):
            group.kv_cache_spec = replace(group.kv_cache_spec, extra_retained_tokens=extra)
    config = vllm_config.speculative_config
    if config is None or not config.use_eagle_block_drop():
        return
    if draft_groups is None:
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        draft_groups = tuple(full[:1])
    for i, group in enumerate(groups):
        group.is_eagle_group = i in draft_groups
        if group.is_eagle_group:
            group.layer_names = [*group.layer_names, f"draft.{i}"]
