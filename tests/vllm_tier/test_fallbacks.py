"""Where kvblocks' KV-cache manager would not be exact, vLLM keeps its own, says why once,
and never raises during start-up."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

import kvblocks.vllm
from kvblocks.vllm import _state, kv_cache_manager, scheduler
from kvblocks.vllm.bench_driver import (
    MAX_MODEL_LEN,
    SchedulerSpec,
    block_hasher,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from tests.vllm_tier.simulation import run


class StockStandIn:
    """Recorded instead of building vLLM's manager (some fallback configurations cannot be
    built on the CPU at all)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def decide(
    model_dir: Path,
    config_change: Callable[[Any], None] | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    **manager_kwargs: Any,
) -> Any:
    """What the factory builds when a vLLM scheduler with this configuration asks."""
    spec = SchedulerSpec()
    vllm_config = make_vllm_config(model_dir, spec)
    if config_change is not None:
        config_change(vllm_config)
    kwargs: dict[str, Any] = {
        "kv_cache_config": kv_cache_config or make_kv_cache_config(spec),
        "max_model_len": MAX_MODEL_LEN,
        "scheduler_block_size": spec.block_size,
        "hash_block_size": spec.block_size,
        "enable_caching": True,
        "log_stats": True,
    }
    kwargs.update(manager_kwargs)
    kvblocks.vllm.install("all")
    _state.fallbacks.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "_vllm_manager_class", lambda: StockStandIn)
        with scheduler._asking(vllm_config):
            return scheduler.kv_cache_manager_factory(**kwargs)


def fell_back(manager: Any, reason: str) -> bool:
    return isinstance(manager, StockStandIn) and dict(_state.fallbacks) == {
        ("kv_cache_manager", reason): 1
    }


def setter(path: str, value: Any) -> Callable[[Any], None]:
    """Sets a (possibly nested) config attribute without pydantic's validation, on copies of
    the nested configs (the model config is shared between tests)."""

    def change(config: Any) -> None:
        *parents, name = path.split(".")
        target = config
        for parent in parents:
            child = copy.copy(getattr(target, parent))
            object.__setattr__(target, parent, child)
            target = child
        object.__setattr__(target, name, value)

    return change


def kv_cache_config(*specs: Any) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def sliding(block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )


def test_supported_configuration_gets_kvblocks(model_dir: Path) -> None:
    assert isinstance(decide(model_dir), KVCacheManager)
    assert dict(_state.fallbacks) == {}


CONFIG_CASES = {
    "kv_connector": setter("kv_transfer_config", object()),
    "ec_connector": setter("ec_transfer_config", object()),
    "speculative": setter("speculative_config", SimpleNamespace(method="draft_model")),
    "context_parallel": setter("parallel_config.prefill_context_parallel_size", 2),
    "metrics_collector": setter("observability_config.kv_cache_metrics", True),
    "hash_algo": setter("cache_config.prefix_caching_hash_algo", "md5"),
    "hash_block_size": setter("cache_config.prefix_match_unit", 32),
    "scheduler_cls": setter("scheduler_config.scheduler_cls", "my.Scheduler"),
    "encoder_decoder": setter("model_config.is_encoder_decoder", True),
}


@pytest.mark.parametrize("reason", list(CONFIG_CASES))
def test_engine_configuration_falls_back(model_dir: Path, reason: str) -> None:
    assert fell_back(decide(model_dir, CONFIG_CASES[reason]), reason)


def test_aux_output_falls_back(model_dir: Path) -> None:
    aux = setter("aux_output_config", SimpleNamespace(enabled=True))
    assert fell_back(decide(model_dir, aux), "aux_output")


MANAGER_CASES: dict[str, dict[str, Any]] = {
    "hash_block_size": {"hash_block_size": 8},
    "context_parallel": {"dcp_world_size": 2},
    "metrics_collector": {"metrics_collector": object()},
    "manager_argument": {"an_argument_from_a_later_vllm": True},
    # vLLM's own manager raises for these; kvblocks steps aside so that it does.
    "vllm_rejects": {"use_eagle": True, "num_prefill_lookahead": 32},
}


@pytest.mark.parametrize("reason", list(MANAGER_CASES))
def test_manager_arguments_fall_back(model_dir: Path, reason: str) -> None:
    assert fell_back(decide(model_dir, **MANAGER_CASES[reason]), reason)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_eagle": True},
        {"num_hash_lookahead_tokens": 1},
        {"num_prefill_lookahead": 2},
        {"use_eagle": True, "num_prefill_lookahead": 3, "num_hash_lookahead_tokens": 2},
    ],
)
def test_speculative_arguments_run_on_kvblocks(model_dir: Path, kwargs: dict[str, Any]) -> None:
    manager = decide(model_dir, **kwargs)
    assert isinstance(manager, KVCacheManager)
    assert dict(_state.fallbacks) == {}


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle", "eagle3", "mtp"])
def test_speculative_methods_run_on_kvblocks(model_dir: Path, method: str) -> None:
    spec_config = setter("speculative_config", SimpleNamespace(method=method))
    assert isinstance(decide(model_dir, spec_config), KVCacheManager)


def mla(block_size: int = 16) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)


def chunked(block_size: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        attention_chunk_size=64,
    )


SUPPORTED_LAYOUTS = {
    "sliding window alone": lambda: kv_cache_config(sliding()),
    "full + sliding window": lambda: kv_cache_config(full(), sliding()),
    "two full groups": lambda: kv_cache_config(full(), full()),
    "MLA": lambda: kv_cache_config(mla()),
    "chunked local + full": lambda: kv_cache_config(chunked(), full()),
}


@pytest.mark.parametrize("layout", list(SUPPORTED_LAYOUTS))
def test_implemented_layouts_run_on_kvblocks(model_dir: Path, layout: str) -> None:
    manager = decide(model_dir, kv_cache_config=SUPPORTED_LAYOUTS[layout]())
    assert isinstance(manager, KVCacheManager)
    assert dict(_state.fallbacks) == {}


class LaterSlidingWindowSpec(SlidingWindowSpec):
    """A spec subclass vLLM might add: not on the allowlist, whatever it inherits."""


def test_kv_cache_layouts_fall_back(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mixed = kv_cache_config(full(16), sliding(32))
    assert fell_back(decide(model_dir, kv_cache_config=mixed), "hash_block_size")
    subclass = LaterSlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )
    assert fell_back(decide(model_dir, kv_cache_config=kv_cache_config(subclass)), "kv_cache_spec")
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    assert fell_back(decide(model_dir, kv_cache_config=kv_cache_config(cross)), "kv_cache_spec")
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sink_len=4
    )
    assert fell_back(decide(model_dir, kv_cache_config=kv_cache_config(sink)), "kv_cache_spec")
    eagle_chunked = kv_cache_config(chunked(), full())
    assert fell_back(
        decide(model_dir, kv_cache_config=eagle_chunked, use_eagle=True), "kv_cache_spec"
    )
    host = kv_cache_config(full())
    host.kv_cache_groups[0].host_resident = True
    assert fell_back(decide(model_dir, kv_cache_config=host), "kv_cache_group_role")
    # vLLM refuses a retention interval that cannot apply (no sliding window here).
    retained = kv_cache_config(full())
    retained.prefix_cache_retention_interval = 16
    assert fell_back(decide(model_dir, kv_cache_config=retained), "vllm_rejects")
    empty = kv_cache_config()
    assert fell_back(decide(model_dir, kv_cache_config=empty), "kv_cache_groups")
    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))
    assert fell_back(decide(model_dir), "zeroing")


def guard_error_text() -> str:
    """status()'s text of the manager's guard-error fallback (with the error)."""
    (text,) = kvblocks.vllm.status().fallbacks
    assert text.startswith(f"kv_cache_manager: {_state.Reason.GUARD_ERROR.text} (")
    return text


def test_unreadable_configuration_never_raises(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _state._logged.clear()
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        assert fell_back(decide(model_dir, setter("parallel_config", None)), "guard_error")
    error = "AttributeError: 'NoneType' object has no attribute"
    assert error in guard_error_text()
    (line,) = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert error in line.getMessage()


def test_unreadable_manager_arguments_never_raise(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(kwargs: dict[str, Any]) -> None:
        raise KeyError("kv_cache_groups")

    monkeypatch.setattr(kv_cache_manager, "unsupported_manager_arguments", broken)
    assert fell_back(decide(model_dir), "guard_error")
    assert "(KeyError: 'kv_cache_groups')" in guard_error_text()


def test_real_scheduler_with_an_rswa_spec_runs_on_vllm(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """End to end: vLLM builds its own manager, logs one line, and schedules normally."""
    rswa = RSWASpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, rswa_window=32)
    kvblocks.vllm.install("all")
    _state.fallbacks.clear()
    _state._logged.clear()  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        sched = make_scheduler(model_dir, SchedulerSpec(), kv_cache_config=kv_cache_config(rswa))
    assert type(sched.kv_cache_manager) is VllmKVCacheManager
    assert dict(_state.fallbacks) == {("kv_cache_manager", "kv_cache_spec"): 1}
    assert sum("kv_cache_manager falls back" in r.getMessage() for r in caplog.records) == 1
    hasher = block_hasher("sha256", 16)
    records = run(sched, [(0, make_request("a", list(range(100)), hasher, max_tokens=4))])
    assert records[0][0][0] == [("a", 100)]


def test_explicit_scheduler_class_asks_even_when_off(model_dir: Path) -> None:
    kvblocks.vllm.install("off")
    spec = SchedulerSpec(scheduler={"scheduler_cls": "kvblocks.vllm.Scheduler"})
    for cls in (kvblocks.vllm.Scheduler, kvblocks.vllm.AsyncScheduler):
        sched = make_scheduler(model_dir, spec, scheduler_cls=cls)
        assert type(sched.kv_cache_manager) is KVCacheManager
    # Without asking, a plain vLLM scheduler still gets vLLM's manager.
    plain = make_scheduler(model_dir, SchedulerSpec())
    assert type(plain.kv_cache_manager) is VllmKVCacheManager


def test_hasher_mode_leaves_the_manager_alone(model_dir: Path) -> None:
    kvblocks.vllm.install("hasher")
    sched = make_scheduler(model_dir, SchedulerSpec())
    assert type(sched.kv_cache_manager) is VllmKVCacheManager
    assert "kv_cache_manager" not in kvblocks.vllm.status().active


def test_an_error_building_kvblocks_manager_falls_back(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(scheduler, "KVCacheManager", broken)
    assert fell_back(decide(model_dir), "guard_error")
    assert "(RuntimeError: simulated bug)" in guard_error_text()
