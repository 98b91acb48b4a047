"""vLLM's ``MultiConnector`` in the driver: NIXL (disaggregated prefill and decode) and vLLM's
CPU offloading side by side, as a deployment runs them (``--kv-transfer-config
'{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [...]}}'``).
``SchedulerSpec`` turns it on when it asks for both (``nixl`` and ``kv_offloading``).

The scheduler side is vLLM's (the MultiConnector and its two children, unchanged). The
worker side, :class:`FakeMultiWorker`, runs each child's fake worker (the driver's, by
``fake_model.connector_worker``) on that child's part of the
step's metadata and joins their reports as vLLM's MultiConnector worker joins its children's.
Import it after the driver has selected vLLM's CPU platform (as the offloading module)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput

from tests.vllm_driver import nixl, offloading

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tests.vllm_driver.config import SchedulerSpec


def kv_transfer_config(spec: SchedulerSpec, kv_cache_config: KVCacheConfig) -> KVTransferConfig:
    """The MultiConnector of NIXL (``spec.nixl_transfer_mode``) then the OffloadingConnector
    (``spec.kv_offloading`` chunks), both in both roles."""
    children = [
        nixl.kv_transfer_config(spec.nixl_transfer_mode),
        offloading.kv_transfer_config(spec, kv_cache_config),
    ]
    fields = ("kv_connector", "kv_role", "kv_connector_extra_config")
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id=nixl.ENGINE_ID,
        kv_connector_extra_config={
            "connectors": [{f: getattr(c, f) for f in fields} for c in children]
        },
    )


def _part(out: SchedulerOutput, metadata: Any) -> SchedulerOutput:
    """``out`` as one child connector sees it: with that child's metadata."""
    part = copy.copy(out)
    part.kv_connector_metadata = metadata
    return part


class FakeMultiWorker:
    """The MultiConnector's worker side: each child's fake worker on its part of the step;
    the requests any child finished receiving or sending (vLLM's MultiConnector counts a
    request whose blocks two children hold until both finish; with NIXL and offloading only
    NIXL holds them, so :meth:`step` refuses such a count), and the children's worker
    metadata in one ``MultiKVConnectorWorkerMetadata``."""

    def __init__(self, scheduler: Scheduler, connector: Any) -> None:
        from tests.vllm_driver.connectors import connector_worker

        self.workers = [connector_worker(scheduler, c) for c in connector.sub_connectors]

    def step(self, out: SchedulerOutput) -> KVConnectorOutput:
        metadata = out.kv_connector_metadata
        assert isinstance(metadata, MultiKVConnectorMetadata)
        if metadata.extra_async_saves:
            raise ValueError("two children hold a finished request's blocks: not faked")
        reports = [
            w.step(_part(out, m)) for w, m in zip(self.workers, metadata.metadata, strict=True)
        ]
        sending = set().union(*(r.finished_sending or () for r in reports))
        recving = set().union(*(r.finished_recving or () for r in reports))
        worker_meta = [r.kv_connector_worker_meta for r in reports]
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=(
                MultiKVConnectorWorkerMetadata(metadata=tuple(worker_meta))
                if any(m is not None for m in worker_meta)
                else None
            ),
        )


def fake_worker(scheduler: Scheduler, connector: Any) -> FakeMultiWorker:
    """The driver's worker side for the connector (``fake_model.connector_worker``)."""
    return FakeMultiWorker(scheduler, connector)


def connector_decisions(out: SchedulerOutput) -> tuple[Any, ...]:
    """Each child's decisions of the step, one after the other (with NIXL and offloading:
    NIXL's three, then the OffloadingConnector's loads, stores and flushed jobs)."""
    from tests.vllm_driver.connectors import connector_decisions as decisions_of

    metadata = out.kv_connector_metadata
    assert isinstance(metadata, MultiKVConnectorMetadata)
    return tuple(field for part in metadata.metadata for field in decisions_of(_part(out, part)))
