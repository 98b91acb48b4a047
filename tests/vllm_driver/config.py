"""The test driver's :class:`SchedulerSpec`: the shipped benchmark's spec
(:class:`kvblocks.vllm.bench.config.SchedulerSpec`) plus KV connectors and speculative
decoding, through the base spec's hook methods.

Speculative decoding (:class:`~tests.vllm_driver.speculative.Speculation`) is vLLM's own
``SpeculativeConfig``, built in :mod:`~tests.vllm_driver.speculative`; the connectors are
vLLM's own, with the worker sides faked in :mod:`~tests.vllm_driver.offloading`,
:mod:`~tests.vllm_driver.nixl`, :mod:`~tests.vllm_driver.mooncake`,
:mod:`~tests.vllm_driver.decode_bench` and :mod:`~tests.vllm_driver.multi`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench import config as base
from kvblocks.vllm.bench.fake_model import FakeModel
from tests.vllm_driver.connectors import connector_decisions, connector_worker
from tests.vllm_driver.drafts import drafter_for
from tests.vllm_driver.speculative import (
    Speculation,
    mark_draft_groups,
    speculative_config,
    v2_model_runner,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


@contextmanager
def scheduler_only_cpu_platform() -> Iterator[None]:
    """TEST AND BENCHMARK ONLY: while the driver's ``VllmConfig`` is built, vLLM 0.34's CPU
    platform check is told Triton is there, so that it does not refuse x86 without Triton
    ("vLLM on x86 CPUs requires Triton (triton-cpu)"; PyPI has no triton-cpu, and PyPI's
    triton finds no active driver without a GPU). Its model runner needs Triton's CPU backend;
    the driver runs no model runner (vLLM's scheduler and a fake model). Only the platform's
    check sees the flag, and only while it runs: a module vLLM imports meanwhile reads the
    real value. kvblocks itself never sets it (a user's vLLM is left as vLLM decides); it is
    not in the installed package."""
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


def scheduler_config_has(field: str) -> bool:
    """Whether the installed vLLM's ``SchedulerConfig`` has ``field`` (a scheduler feature of
    some releases only: 0.34's ``cache_aware_admission_window``, ``max_num_inflight_kv_loads``).
    Imports vLLM's config: call it after the driver selected the CPU platform."""
    import dataclasses

    from vllm.config import SchedulerConfig

    return field in {f.name for f in dataclasses.fields(SchedulerConfig)}


class DriverModel(FakeModel):
    """The fake model with the driver's fake worker sides of vLLM's KV connectors."""

    def __init__(self, drafter: Any = None) -> None:
        super().__init__(drafter, worker_side=connector_worker, decisions=connector_decisions)


@dataclass
class SchedulerSpec(base.SchedulerSpec):
    """The knobs the tests turn; everything else is vLLM's default."""

    #: Speculative decoding (vLLM's ``SpeculativeConfig`` for it), or none.
    speculative: Speculation | None = None
    #: vLLM's native CPU offloading (the ``OffloadingConnector`` as ``--kv-offloading-size``
    #: sets it up, :mod:`~tests.vllm_driver.offloading`): the CPU tier's size in chunks, each
    #: ``blocks_per_chunk`` GPU blocks (1 unless ``kv_offloading_config`` says otherwise); 0
    #: turns it off. Requests need block hashes even without prefix caching (``EngineCore``
    #: hashes them for a KV connector too).
    kv_offloading: int = 0
    #: More ``kv_connector_extra_config`` for offloading (``eviction_policy``,
    #: ``offload_prompt_only``, ``blocks_per_chunk``, ``self_describing_kv_events``, ...).
    kv_offloading_config: dict[str, Any] = field(default_factory=dict)
    #: vLLM's ``NixlConnector`` in both roles (disaggregated prefill and decode,
    #: :mod:`~tests.vllm_driver.nixl`); requests say which role theirs is. With
    #: ``kv_offloading`` too, vLLM's ``MultiConnector`` runs both
    #: (:mod:`~tests.vllm_driver.multi`).
    nixl: bool = False
    #: NIXL's transfer mode: "pull" (the decode node reads, ``NixlConnector``) or "push" (the
    #: prefill node writes, ``NixlPushConnector``).
    nixl_transfer_mode: str = "pull"
    #: NIXL alone: every how many completed loads the fake worker side fails one (0: none),
    #: and vLLM's ``kv_load_failure_policy`` then ("fail", vLLM's default, or "recompute").
    nixl_failed_loads: int = 0
    kv_load_failure_policy: str = "fail"
    #: vLLM's ``MooncakeConnector`` in both roles (disaggregated prefill and decode,
    #: :mod:`~tests.vllm_driver.mooncake`); requests say which role theirs is.
    mooncake: bool = False
    #: vLLM's ``DecodeBenchConnector`` (:mod:`~tests.vllm_driver.decode_bench`): every
    #: prompt but its last token arrives as filled KV; "startup" with vLLM's ``startup_fill``.
    decode_bench: str = ""

    @property
    def has_kv_connector(self) -> bool:
        return bool(self.kv_offloading or self.nixl or self.decode_bench or self.mooncake)

    @property
    def config_async_scheduling(self) -> bool:
        # vLLM's CPU platform turns async scheduling off in the config anyway (the driver's
        # scheduler class is what makes it async); asking for it would only run the check of
        # the V1 model runner, the one the CPU gets, which refuses n-gram drafting on the CPU
        # under async scheduling (the V2 runner, the GPU default, runs it; ``ngram_gpu``
        # passes the check: it is asked for).
        ngram = self.speculative is not None and self.speculative.method == "ngram"
        return self.async_scheduling and not ngram

    def config_extras(self, model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.kv_offloading and self.nixl:
            from tests.vllm_driver import multi

            layout = base.make_kv_cache_config(self)
            extra["kv_transfer_config"] = multi.kv_transfer_config(self, layout)
        elif self.kv_offloading:
            from tests.vllm_driver import offloading

            layout = base.make_kv_cache_config(self)
            extra["kv_transfer_config"] = offloading.kv_transfer_config(self, layout)
        elif self.nixl:
            from tests.vllm_driver import nixl

            extra["kv_transfer_config"] = nixl.kv_transfer_config(
                self.nixl_transfer_mode, self.nixl_failed_loads, self.kv_load_failure_policy
            )
        elif self.mooncake:
            from tests.vllm_driver import mooncake

            extra["kv_transfer_config"] = mooncake.kv_transfer_config()
        elif self.decode_bench:
            from tests.vllm_driver import decode_bench

            startup = self.decode_bench == "startup"
            extra["kv_transfer_config"] = decode_bench.kv_transfer_config(startup)
        if self.speculative is not None:
            extra["speculative_config"] = speculative_config(self.speculative, model, parallel)
        return extra

    @contextmanager
    def building_config(self) -> Iterator[None]:
        # A method only vLLM's V2 model runner runs (DSpark) is validated as on V2; a run
        # that steps the scheduler holds ``v2_model_runner`` too (the scheduler reads it).
        with scheduler_only_cpu_platform(), v2_model_runner(self.speculative):
            yield

    def kv_cache_tensors(self, groups: list[KVCacheGroupSpec]) -> list[Any]:
        if not self.kv_offloading:
            return []
        # The connector sizes the CPU tier's chunks from them (vLLM's planning always
        # describes them; the scheduler and its KV-cache manager never read them).
        from tests.vllm_driver.offloading import kv_cache_tensors

        return kv_cache_tensors(groups, self.num_blocks)

    def adjust_kv_cache_config(self, config: KVCacheConfig, vllm_config: VllmConfig) -> None:
        if vllm_config.speculative_config is not None:
            draft_groups = self.speculative.draft_groups if self.speculative else None
            mark_draft_groups(config, vllm_config, draft_groups)

    def fake_model(self, scheduler: Scheduler) -> FakeModel:
        return DriverModel(drafter_for(scheduler))

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
