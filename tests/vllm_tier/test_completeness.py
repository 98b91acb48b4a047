"""Nothing vLLM calls on its KV-cache manager is missing from kvblocks' manager, except what
``kvblocks.vllm.support.UNREACHABLE`` lists, and the configurations listed there really are
refused: a call to a missing member would raise AttributeError inside vLLM's ``schedule()``."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.config import AuxOutputConfig, KVTransferConfig
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

import kvblocks.vllm
from kvblocks.vllm import _state, scheduler
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from kvblocks.vllm.kv_cache_manager import _BlockPool as BlockPoolFacade
from kvblocks.vllm.support import UNREACHABLE
from tests.vllm_driver import (
    MAX_MODEL_LEN,
    SchedulerSpec,
    make_kv_cache_config,
    make_vllm_config,
)

VLLM = Path(inspect.getfile(Scheduler)).parents[3]
#: vLLM's manager and what it builds: their reads of one another are not calls into kvblocks.
CORE = {
    "v1/core/kv_cache_manager.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/single_type_kv_cache_manager.py",
    "v1/core/block_pool.py",
}
#: Files that name the manager but read coordinators and managers of their own.
OWN_COORDINATOR = {
    "distributed/kv_transfer/kv_connector/v1/umbp/scheduler.py": "its lookup coordinator",
    "v1/simple_kv_offload/manager.py": "its CPU coordinator",
}
#: What vLLM code outside its manager reads of ``kv_cache_manager.coordinator`` and of the
#: coordinator's ``single_type_managers`` (the scan below finds the direct reads).
COORDINATOR_READS = {
    "single_type_managers": "Scheduler.__init__, EngineCore, connectors",
    "enable_partial_hash_hits": "Scheduler.__init__",
    "get_num_blocks_to_allocate": "Scheduler._request_remaining_blocks",
    "num_reprefillable_tokens": "get_hisparse_coordinator",
    "find_longest_cache_hit_per_group": "OffloadingConnector",
}
SINGLE_TYPE_READS = {
    "block_size": "Scheduler.__init__, EngineCore, the auxiliary-output connector",
    "kv_cache_spec": "Scheduler.__init__, EngineCore",
    "block_pool": "the UMBP and auxiliary-output connectors",
}


def manager_kwargs(**overrides: Any) -> dict[str, Any]:
    spec = SchedulerSpec()
    return {
        "kv_cache_config": make_kv_cache_config(spec),
        "max_model_len": MAX_MODEL_LEN,
        "scheduler_block_size": spec.block_size,
        "hash_block_size": spec.block_size,
        "log_stats": True,
        **overrides,
    }


def defined_members(cls: type, *instances: object) -> set[str]:
    """The public members of ``cls``: its attributes and methods, the operators its source
    defines, the attributes its methods assign to ``self``, and those of ``instances``."""
    names = {n for n in vars(cls) if not n.startswith("_")}
    names |= {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}
    source_file = inspect.getfile(cls)
    names |= {
        n
        for n, v in vars(cls).items()
        if n.startswith("__")
        and n != "__init__"
        and inspect.isfunction(v)
        and v.__code__.co_filename == source_file
    }
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and not node.attr.startswith("_")
        ):
            names.add(node.attr)
    for instance in instances:
        names |= {n for n in vars(instance) if not n.startswith("_")}
    return names


@pytest.fixture(scope="module", params=[True, False], ids=["caching", "no-caching"])
def managers(request: pytest.FixtureRequest) -> tuple[Any, KVCacheManager]:
    """vLLM's manager and kvblocks', built with the same arguments (KV events on)."""
    kwargs = manager_kwargs(enable_caching=request.param, enable_kv_cache_events=True)
    return VllmKVCacheManager(**kwargs), KVCacheManager(**kwargs)


def walked(vllm_manager: Any, ours: KVCacheManager) -> Iterator[tuple[str, Any, Any]]:
    """(table key, vLLM's object, kvblocks' object) for every member vLLM code may use."""
    for name in sorted(defined_members(VllmKVCacheManager, vllm_manager)):
        yield f"KVCacheManager.{name}", vllm_manager, ours
    vllm_blocks, our_blocks = vllm_manager.empty_kv_cache_blocks, ours.empty_kv_cache_blocks
    for name in sorted(defined_members(KVCacheBlocks, vllm_blocks)):
        yield f"KVCacheBlocks.{name}", vllm_blocks, our_blocks
    for name in COORDINATOR_READS:
        yield f"coordinator.{name}", vllm_manager.coordinator, ours.coordinator
    vllm_group = vllm_manager.coordinator.single_type_managers[0]
    our_group = ours.coordinator.single_type_managers[0]
    for name in SINGLE_TYPE_READS:
        yield f"single_type_manager.{name}", vllm_group, our_group


def test_every_member_is_implemented_or_unreachable(managers: tuple[Any, KVCacheManager]) -> None:
    vllm_manager, ours = managers
    missing, listed_but_present, wrong_kind = [], [], []
    for key, vllm_object, our_object in walked(vllm_manager, ours):
        name = key.split(".", 1)[1]
        present = hasattr(our_object, name)
        if key in UNREACHABLE:
            if present:
                listed_but_present.append(key)
        elif not present:
            missing.append(key)
        elif hasattr(vllm_object, name) and callable(getattr(vllm_object, name)) != callable(
            getattr(our_object, name)
        ):
            wrong_kind.append(key)
    assert not missing, f"vLLM members kvblocks lacks, not in support.UNREACHABLE: {missing}"
    assert not listed_but_present, f"implemented now: remove from UNREACHABLE: {listed_but_present}"
    assert not wrong_kind, f"a method where vLLM has an attribute, or the reverse: {wrong_kind}"


def test_walk_finds_what_it_should(managers: tuple[Any, KVCacheManager]) -> None:
    """The walk sees members from every source: methods, properties, operators, attributes
    set in ``__init__`` and dataclass fields; and every table entry is something it walks."""
    keys = {key for key, _, _ in walked(*managers)}
    for key in (
        "KVCacheManager.allocate_slots",
        "KVCacheManager.usage",
        "KVCacheManager.block_pool",
        "KVCacheManager.prefix_cache_stats",
        "KVCacheBlocks.blocks",
        "KVCacheBlocks.__add__",
    ):
        assert key in keys
    assert "KVCacheManager.__init__" not in keys
    assert set(UNREACHABLE) <= keys


def test_table_names_guard_reasons() -> None:
    for key, reasons in UNREACHABLE.items():
        assert reasons, key
        assert set(reasons) <= set(_state.REASONS), key


def _reads(pattern: str, text: str) -> set[str]:
    return set(re.findall(pattern, text, re.MULTILINE))


def test_listed_reads_cover_vllm_sources() -> None:
    """Every direct read of the manager, its coordinator and its single-type managers in
    vLLM code outside the manager is a member the walk covers."""
    manager_reads: set[str] = set()
    coordinator_reads: set[str] = set()
    group_reads: set[str] = set()
    for path in VLLM.rglob("*.py"):
        rel = path.relative_to(VLLM).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if rel in CORE or rel in OWN_COORDINATOR or "kv_cache_manager" not in text:
            continue
        manager_reads |= _reads(r"kv_cache_manager\.(\w+)", text) - {"py"}
        coordinator_reads |= _reads(r"kv_cache_manager\.coordinator\.(\w+)", text)
        for alias in _reads(r"(\w+) = [\w.]*kv_cache_manager\.coordinator\s*$", text):
            coordinator_reads |= _reads(rf"\b{alias}\.(\w+)", text)
        group_reads |= _reads(r"single_type_managers\[[^\]]*\]\.(\w+)", text)
        aliases = _reads(r"for (\w+) in [\w.]*single_type_managers", text)
        aliases |= _reads(r"(\w+) = [\w.]*single_type_managers\[", text)
        for alias in aliases:
            group_reads |= _reads(rf"\b{alias}\.(\w+)", text)
    assert manager_reads  # the scan works at all
    assert manager_reads <= defined_members(VllmKVCacheManager)
    assert coordinator_reads <= set(COORDINATOR_READS)
    assert group_reads <= set(SINGLE_TYPE_READS)


# -- the listed configurations are refused -----------------------------------------------------


#: A configuration: the spec (what ``VllmConfig`` validates) and a change made past validation.
Configuration = tuple[SchedulerSpec, Callable[[Any], None] | None]


def build_scheduler(model_dir: Path, configuration: Configuration) -> Scheduler:
    """vLLM's ``Scheduler``, or the class the configuration names."""
    spec, change = configuration
    vllm_config = make_vllm_config(model_dir, spec)
    if change is not None:
        change(vllm_config)
    cls = vllm_config.scheduler_config.scheduler_cls or Scheduler
    built: Scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(spec),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=spec.block_size,
    )
    return built


def with_connector(tmp: Path) -> Configuration:
    config = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp)},
    )
    return SchedulerSpec(extra={"kv_transfer_config": config}), None


def with_aux_outputs(tmp: Path) -> Configuration:
    # VllmConfig accepts auxiliary outputs only for MoE models on the V2 model runner; the
    # scheduler side builds them for any model.
    aux = AuxOutputConfig(enable_return_routed_experts=True)
    return SchedulerSpec(), lambda config: object.__setattr__(config, "aux_output_config", aux)


class CustomScheduler(Scheduler):  # type: ignore[misc]
    """An out-of-tree scheduler class, as ``--scheduler-cls`` would name it."""


def with_custom_scheduler(tmp: Path) -> Configuration:
    return SchedulerSpec(scheduler={"scheduler_cls": CustomScheduler}), None


def refusing(reason: str, tmp: Path) -> Configuration:
    """A configuration the guard refuses for ``reason``."""
    configurations: dict[str, Callable[[Path], Configuration]] = {
        "kv_connector": with_connector,
        "aux_output": with_aux_outputs,
        "scheduler_cls": with_custom_scheduler,
    }
    if reason not in configurations:
        pytest.fail(f"add a configuration for {reason!r} to refusing() in {__file__}")
    return configurations[reason](tmp)


@pytest.mark.parametrize("reason", sorted({r for rs in UNREACHABLE.values() for r in rs}))
def test_listed_reasons_are_refused(model_dir: Path, tmp_path: Path, reason: str) -> None:
    """A real scheduler in that configuration, kvblocks installed: vLLM's manager, one
    fallback for that reason."""
    kvblocks.vllm.install("all")
    _state.fallbacks.clear()
    sched = build_scheduler(model_dir, refusing(reason, tmp_path))
    assert type(sched.kv_cache_manager) is VllmKVCacheManager
    assert dict(_state.fallbacks) == {("kv_cache_manager", reason): 1}


@pytest.mark.parametrize("reason", ["aux_output"])
def test_refused_configurations_reach_listed_members(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reason: str
) -> None:
    """Why they are refused: with the guard bypassed, vLLM's start-up reads a listed member
    of kvblocks' manager and fails. (Other KV connectors than the OffloadingConnector start
    up since kvblocks has its block pool; they read listed members per request.)"""
    kvblocks.vllm.install("all")
    monkeypatch.setattr(scheduler, "unsupported_config", lambda *args, **kwargs: None)
    with pytest.raises(AttributeError) as error:
        build_scheduler(model_dir, refusing(reason, tmp_path))
    owner = error.value.obj
    if isinstance(owner, KVCacheManager):
        assert reason in UNREACHABLE[f"KVCacheManager.{error.value.name}"]
    else:  # vLLM's BlockPool internals, which kvblocks' block pool (for connectors) lacks
        assert type(owner) is BlockPoolFacade
        assert reason == "aux_output"
        assert error.value.name == "hash_block_size"
