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
    KVCacheGroupRole,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

import kvblocks.vllm
from kvblocks.vllm import _state, kv_cache_manager, scheduler
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from tests.vllm_driver import (
    MAX_MODEL_LEN,
    SchedulerSpec,
    block_hasher,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tests.vllm_tier.simulation import run


class StockStandIn:
    """Recorded instead of building vLLM's manager (some fallback configurations cannot be
    built on the CPU at all): the factory's call of vLLM's class, with its arguments."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def decide(
    model_dir: Path,
    config_change: Callable[[Any], None] | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    **manager_kwargs: Any,
) -> Any:
    """What the factory builds when a vLLM scheduler with this configuration asks. Where it
    falls back, it must have called vLLM's class with the scheduler's arguments unchanged."""
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
            manager = scheduler.kv_cache_manager_factory(**kwargs)
    if isinstance(manager, StockStandIn):
        assert manager.kwargs == kwargs, "vLLM's manager must get the scheduler's arguments"
    return manager


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


#: case -> (the reason it falls back for, the change to the engine's VllmConfig)
CONFIG_CASES: dict[str, tuple[str, Callable[[Any], None]]] = {
    "kv_connector": ("kv_connector", setter("kv_transfer_config", object())),
    "ec_connector": ("ec_connector", setter("ec_transfer_config", object())),
    "speculative": (
        "speculative",
        setter("speculative_config", SimpleNamespace(method="extract_hidden_states")),
    ),
    # vLLM 0.34's registered speculator: a built-in base method, its own name apart.
    "custom_speculator": (
        "speculative",
        setter("speculative_config", SimpleNamespace(method="eagle", custom_method="my_drafter")),
    ),
    "prefill_context_parallel": (
        "context_parallel",
        setter("parallel_config.prefill_context_parallel_size", 2),
    ),
    "decode_context_parallel": (
        "context_parallel",
        setter("parallel_config.decode_context_parallel_size", 2),
    ),
    "metrics_collector": (
        "metrics_collector",
        setter("observability_config.kv_cache_metrics", True),
    ),
    "hash_algo": ("hash_algo", setter("cache_config.prefix_caching_hash_algo", "md5")),
    "prefix_match_unit": ("hash_block_size", setter("cache_config.prefix_match_unit", 32)),
    "hisparse_config": (
        "kv_cache_group_role",
        setter("attention_config.hisparse_config", object()),
    ),
    "scheduler_cls": ("scheduler_cls", setter("scheduler_config.scheduler_cls", "my.Scheduler")),
    "encoder_decoder": ("encoder_decoder", setter("model_config.is_encoder_decoder", True)),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_engine_configuration_falls_back(model_dir: Path, case: str) -> None:
    reason, change = CONFIG_CASES[case]
    assert fell_back(decide(model_dir, change), reason)


@pytest.mark.parametrize(
    ("connector", "module_path", "named"),
    [
        ("MooncakeStoreConnector", None, "MooncakeStoreConnector"),
        ("ExampleConnector", None, "ExampleConnector"),
        ("LMCacheConnectorV1", None, "LMCacheConnectorV1"),
        ("OffloadingConnector", "my.connectors", "OffloadingConnector from my.connectors"),
    ],
)
def test_the_fallback_names_the_connector(
    model_dir: Path, connector: str, module_path: str | None, named: str
) -> None:
    """Every connector but vLLM's own OffloadingConnector falls back, and the log line and
    status() name it."""
    transfer = SimpleNamespace(kv_connector=connector, kv_connector_module_path=module_path)
    assert fell_back(decide(model_dir, setter("kv_transfer_config", transfer)), "kv_connector")
    assert f"(kv_transfer_config) ({named})" in str(kvblocks.vllm.status())


def multi(*children: dict[str, Any] | str) -> SimpleNamespace:
    """A MultiConnector's kv_transfer_config of these children (a name: no module path)."""
    connectors = [{"kv_connector": c} if isinstance(c, str) else c for c in children]
    return SimpleNamespace(
        kv_connector="MultiConnector",
        kv_connector_module_path=None,
        kv_connector_extra_config={"connectors": connectors},
    )


@pytest.mark.parametrize(
    ("transfer", "named"),
    [
        (multi("NixlConnector", "LMCacheConnectorV1"), "NixlConnector, LMCacheConnectorV1"),
        (
            multi({"kv_connector": "OffloadingConnector", "kv_connector_module_path": "my.c"}),
            "OffloadingConnector from my.c",
        ),
        (multi(), None),
    ],
    ids=["a child kvblocks does not serve", "a child from a module path", "no children"],
)
def test_a_multi_connector_falls_back_unless_kvblocks_serves_every_child(
    model_dir: Path, transfer: SimpleNamespace, named: str | None
) -> None:
    """vLLM's MultiConnector runs on kvblocks' manager only when every child is a connector
    kvblocks serves (tests/vllm_tier/test_nixl.py runs NIXL with CPU offloading); else it
    falls back, and the line names the children."""
    assert fell_back(decide(model_dir, setter("kv_transfer_config", transfer)), "kv_connector")
    expected = f"MultiConnector of {named}" if named else "MultiConnector)"
    assert expected in str(kvblocks.vllm.status())


def test_a_multi_connector_of_served_connectors_is_served(model_dir: Path) -> None:
    transfer = multi("NixlPushConnector", "OffloadingConnector")
    manager = decide(model_dir, setter("kv_transfer_config", transfer))
    assert isinstance(manager, KVCacheManager)
    assert not _state.fallbacks


def test_aux_output_falls_back(model_dir: Path) -> None:
    aux = setter("aux_output_config", SimpleNamespace(enabled=True))
    assert fell_back(decide(model_dir, aux), "aux_output")


#: case -> (the reason it falls back for, the KVCacheManager arguments that differ)
MANAGER_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "hash_block_size": ("hash_block_size", {"hash_block_size": 8}),
    "dcp_world_size": ("context_parallel", {"dcp_world_size": 2}),
    "pcp_world_size": ("context_parallel", {"pcp_world_size": 2}),
    "metrics_collector": ("metrics_collector", {"metrics_collector": object()}),
    "manager_argument": ("manager_argument", {"an_argument_from_a_later_vllm": True}),
    # vLLM's own manager raises for these; kvblocks steps aside so that it does.
    "prefill_lookahead_past_a_block": (
        "vllm_rejects",
        {"use_eagle": True, "num_prefill_lookahead": 32},
    ),
    "negative_watermark": ("vllm_rejects", {"watermark": -0.1}),
}


@pytest.mark.parametrize("case", list(MANAGER_CASES))
def test_manager_arguments_fall_back(model_dir: Path, case: str) -> None:
    reason, kwargs = MANAGER_CASES[case]
    assert fell_back(decide(model_dir, **kwargs), reason)


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


@pytest.mark.parametrize(
    "method",
    ["ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark"],
)
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
    "sliding window, retention interval 32": lambda: retained(32, sliding()),
    "full + Mamba, prefix caching (align mode)": lambda: kv_cache_config(full(), mamba("align")),
    "Mamba alone, prefix caching, retention 32": lambda: retained(32, mamba("align")),
}
#: Layouts that run on kvblocks with prefix caching off only (vLLM's Mamba cache mode "none":
#: one block of max_model_len tokens per request and Mamba group), and the scheduler's block
#: size, the least common multiple of the groups' (what EngineCore passes).
UNCACHED_LAYOUTS = {
    "full + Mamba": (lambda: kv_cache_config(full(), mamba(block_size=1024)), 1024),
    "Mamba alone": (lambda: kv_cache_config(mamba(block_size=1024)), 1024),
    "full + sliding window of another block size": (
        lambda: kv_cache_config(full(16), sliding(32)),
        32,
    ),
}


def retained(interval: int, *specs: Any) -> KVCacheConfig:
    config = kv_cache_config(*specs)
    config.prefix_cache_retention_interval = interval
    return config


@pytest.mark.parametrize("layout", list(SUPPORTED_LAYOUTS))
def test_implemented_layouts_run_on_kvblocks(model_dir: Path, layout: str) -> None:
    manager = decide(model_dir, kv_cache_config=SUPPORTED_LAYOUTS[layout]())
    assert isinstance(manager, KVCacheManager)
    assert dict(_state.fallbacks) == {}


@pytest.mark.parametrize("layout", list(UNCACHED_LAYOUTS))
def test_layouts_without_prefix_caching_run_on_kvblocks(model_dir: Path, layout: str) -> None:
    config, block_size = UNCACHED_LAYOUTS[layout]
    sizes = {"scheduler_block_size": block_size, "hash_block_size": block_size}
    manager = decide(model_dir, kv_cache_config=config(), enable_caching=False, **sizes)
    assert isinstance(manager, KVCacheManager)
    assert dict(_state.fallbacks) == {}
    # With prefix caching the same layout falls back.
    assert not isinstance(decide(model_dir, kv_cache_config=config(), **sizes), KVCacheManager)


class LaterSlidingWindowSpec(SlidingWindowSpec):
    """A spec subclass vLLM might add: not on the allowlist, whatever it inherits."""


def _role(role: KVCacheGroupRole) -> KVCacheConfig:
    config = kv_cache_config(full())
    config.kv_cache_groups[0].role = role
    return config


def _host_resident() -> KVCacheConfig:
    config = kv_cache_config(full())
    config.kv_cache_groups[0].host_resident = True
    return config


def _hisparse_host_pool() -> KVCacheConfig:
    config = kv_cache_config(full())
    config.hisparse_host_num_blocks = 8
    return config


def _subclass() -> KVCacheConfig:
    spec = LaterSlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )
    return kv_cache_config(spec)


def _spec(cls: Any, **kwargs: Any) -> Callable[[], KVCacheConfig]:
    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    return lambda: kv_cache_config(cls(**common, **kwargs))


def _replaying(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix-cacheable spec that replays tokens (the guard must look at both)."""
    monkeypatch.setattr(SlidingWindowSpec, "prefix_replay_tokens", property(lambda self: 8))


def mamba(mode: str = "none", block_size: int = 16) -> MambaSpec:
    return MambaSpec(
        block_size=block_size, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode=mode
    )


#: case -> (the reason it falls back for, its KV-cache config, the KVCacheManager arguments
#: that differ, a change to vLLM's classes for the test)
LAYOUT_CASES: dict[
    str,
    tuple[
        str,
        Callable[[], KVCacheConfig],
        dict[str, Any],
        Callable[[pytest.MonkeyPatch], None] | None,
    ],
] = {
    "no group": ("kv_cache_groups", kv_cache_config, {}, None),
    "mixed block sizes": (
        "hash_block_size",
        lambda: kv_cache_config(full(16), sliding(32)),
        {},
        None,
    ),
    "spec subclass": ("kv_cache_spec", _subclass, {}, None),
    "cross-attention": ("kv_cache_spec", _spec(CrossAttentionSpec), {}, None),
    "sink": ("kv_cache_spec", _spec(SinkFullAttentionSpec, sink_len=4), {}, None),
    "bounded replay": (
        "kv_cache_spec",
        _spec(SlidingWindowMLASpec, sliding_window=64, bounded_replay=True),
        {},
        None,
    ),
    "prefix replay tokens": ("kv_cache_spec", lambda: kv_cache_config(sliding()), {}, _replaying),
    "EAGLE with chunked local": (
        "kv_cache_spec",
        lambda: kv_cache_config(chunked(), full()),
        {"use_eagle": True},
        None,
    ),
    "host-resident group": ("kv_cache_group_role", _host_resident, {}, None),
    "HiSparse source role": (
        "kv_cache_group_role",
        lambda: _role(KVCacheGroupRole.HISPARSE_SOURCE),
        {},
        None,
    ),
    "HiSparse indexer role": (
        "kv_cache_group_role",
        lambda: _role(KVCacheGroupRole.HISPARSE_INDEXER),
        {},
        None,
    ),
    "HiSparse host pool": ("kv_cache_group_role", _hisparse_host_pool, {}, None),
    # vLLM caches Mamba states only in its "align" mode (and "none" is its mode without).
    "Mamba in none mode with prefix caching": (
        "mamba_prefix_caching",
        lambda: kv_cache_config(full(), mamba("none")),
        {},
        None,
    ),
    # Two or more lookahead tokens per hash: vLLM keeps two keys on one state block.
    "Mamba prefix caching with multi-token lookahead hashing": (
        "mamba_prefix_caching",
        lambda: kv_cache_config(full(), mamba("align")),
        {"num_hash_lookahead_tokens": 2},
        None,
    ),
    "Mamba in align mode without caching": (
        "mamba_prefix_caching",
        lambda: kv_cache_config(full(), mamba("align")),
        {"enable_caching": False},
        None,
    ),
    "Mamba block size not dividing the scheduler's": (
        "vllm_rejects",
        lambda: kv_cache_config(full(), mamba(block_size=24)),
        {"enable_caching": False},
        None,
    ),
    # vLLM refuses a retention interval that cannot apply.
    "retention without a window": ("vllm_rejects", lambda: retained(16, full()), {}, None),
    "negative retention": ("vllm_rejects", lambda: retained(-16, full(), sliding()), {}, None),
    "retention not a multiple of the block size": (
        "vllm_rejects",
        lambda: retained(24, full(), sliding()),
        {},
        None,
    ),
    "lookahead hashing, sliding window alone": (
        "lookahead_without_full",
        lambda: kv_cache_config(sliding()),
        {"num_hash_lookahead_tokens": 2},
        None,
    ),
    "lookahead hashing, chunked local alone": (
        "lookahead_without_full",
        lambda: kv_cache_config(chunked()),
        {"num_hash_lookahead_tokens": 2},
        None,
    ),
    "lookahead hashing, chunked local and a window": (
        "lookahead_without_full",
        lambda: kv_cache_config(chunked(), sliding()),
        {"num_hash_lookahead_tokens": 3},
        None,
    ),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_kv_cache_layouts_fall_back(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    reason, config, kwargs, change = LAYOUT_CASES[case]
    if change is not None:
        change(monkeypatch)
    assert fell_back(decide(model_dir, kv_cache_config=config(), **kwargs), reason)


@pytest.mark.parametrize(
    ("layout", "kwargs"),
    [
        ("one lookahead token", {"num_hash_lookahead_tokens": 1}),
        ("lookahead hashing with full attention", {"num_hash_lookahead_tokens": 3}),
        (
            "lookahead hashing, caching off",
            {"num_hash_lookahead_tokens": 3, "enable_caching": False},
        ),
    ],
)
def test_lookahead_hashing_runs_where_exact(
    model_dir: Path, layout: str, kwargs: dict[str, Any]
) -> None:
    config = kv_cache_config(sliding(), full()) if "full" in layout else kv_cache_config(sliding())
    assert isinstance(decide(model_dir, kv_cache_config=config, **kwargs), KVCacheManager)
    assert dict(_state.fallbacks) == {}


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

    monkeypatch.setattr(kv_cache_manager, "KVCacheManager", broken)
    assert fell_back(decide(model_dir), "guard_error")
    assert "(RuntimeError: simulated bug)" in guard_error_text()
