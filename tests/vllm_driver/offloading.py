"""vLLM's native CPU offloading in the driver: the ``OffloadingConnector`` that
``--kv-offloading-size`` turns on, with vLLM's own scheduler side (its
``OffloadingConnectorScheduler`` and ``CPUOffloadingManager``, LRU by default) and a fake
worker side that moves no memory.

:class:`~tests.vllm_driver.config.SchedulerSpec` turns it on
(``kv_offloading``: the CPU tier's size in chunks); then
:func:`~kvblocks.vllm.bench.config.make_vllm_config` sets the
:func:`kv_transfer_config` that ``--kv-offloading-size`` would (connector
``OffloadingConnector``, role ``kv_both``, ``cpu_bytes_to_use``), except that the spec is
:class:`DriverCPUOffloadingSpec`, and
:func:`~kvblocks.vllm.bench.config.make_kv_cache_config` describes the KV-cache
tensors (:func:`kv_cache_tensors`), from which vLLM sizes a chunk.

The worker side is :class:`ConnectorWorker`: a WORKER-role ``OffloadingConnector`` over small
CPU tensors, stepped as vLLM's model runner steps it, whose transfers
(:class:`FakeOffloadingWorker`) all complete, successfully, within the step they are
submitted in. :class:`~kvblocks.vllm.bench.fake_model.FakeModel` holds one where the
scheduler has a connector. :func:`connector_decisions` turns a step's connector metadata
into plain values (what :func:`~kvblocks.vllm.bench.fake_model.snapshot` records).

Nothing imports this module when the driver is imported: the driver's functions import it
once they have selected vLLM's CPU platform, and vLLM imports it by name
(``spec_module_path``) when it builds a connector. It imports vLLM at once (its classes extend
vLLM's) and sets no environment variable: import it after the driver has selected vLLM's CPU
platform (any driver function that builds a configuration does), or with
``VLLM_TARGET_DEVICE=cpu`` set.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.math_utils import round_up
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from tests.vllm_driver.config import SchedulerSpec

#: The spec vLLM's ``OffloadingSpecFactory`` loads (``spec_name``, ``spec_module_path``).
SPEC_NAME = "DriverCPUOffloadingSpec"
SPEC_MODULE = __name__


def kv_cache_tensors(groups: list[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    """The KV-cache tensors of ``groups`` as vLLM's planning lays out a hybrid model: the
    groups overlay one allocation of ``num_blocks`` blocks of the largest page (a block id
    belongs to one group at a time), each group's layers layer-outermost in it.
    ``build_offloading_config`` divides the allocation by the blocks: the bytes a block
    holds on a worker, which sizes the CPU tier's chunks."""
    block_bytes = max(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    return [
        KVCacheTensor(
            size=block_bytes * num_blocks,
            layers=list(g.layer_names),
            layer_stride=g.kv_cache_spec.page_size_bytes * num_blocks,
            block_stride=g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
    ]


def chunk_bytes(kv_cache_config: KVCacheConfig, blocks_per_chunk: int = 1) -> int:
    """The CPU bytes one chunk (``blocks_per_chunk`` GPU blocks) takes in vLLM's CPU tier,
    with its alignment (``CPUOffloadingSpec``'s arithmetic, on one worker)."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        raise ValueError("KV offloading needs a KV-cache config with kv_cache_tensors")
    block_bytes = tensors[0].size // kv_cache_config.num_blocks
    alignment: int = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    return int(round_up(block_bytes * blocks_per_chunk, alignment))


def blocks_per_chunk(spec: SchedulerSpec) -> int:
    """GPU blocks per CPU chunk, from ``spec.kv_offloading_config`` (``blocks_per_chunk``,
    or ``block_size`` in tokens) as vLLM reads them; 1 by default."""
    extra = spec.kv_offloading_config
    if "blocks_per_chunk" in extra:
        return int(extra["blocks_per_chunk"])
    if "block_size" in extra:
        return int(extra["block_size"]) // spec.block_size
    return 1


def kv_transfer_config(spec: SchedulerSpec, kv_cache_config: KVCacheConfig) -> KVTransferConfig:
    """What ``VllmConfig._post_init_kv_transfer_config`` sets for ``--kv-offloading-size``
    with the native backend, sized for ``spec.kv_offloading`` chunks (``cpu_bytes_to_use``,
    as vLLM counts a chunk's bytes: :func:`chunk_bytes`), with :class:`DriverCPUOffloadingSpec`
    as the spec and ``spec.kv_offloading_config`` on top."""
    cpu_bytes = spec.kv_offloading * chunk_bytes(kv_cache_config, blocks_per_chunk(spec))
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_bytes,
        "spec_name": SPEC_NAME,
        "spec_module_path": SPEC_MODULE,
        **spec.kv_offloading_config,
    }
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


class KeyedCPUOffloadingManager(CPUOffloadingManager):  # type: ignore[misc]
    """vLLM's ``CPUOffloadingManager``, whose load and store specs also carry the offload
    keys they were prepared for (``offload_keys``, a tuple): what
    :func:`connector_decisions` records. It decides nothing differently."""

    def _get_load_store_spec(self, keys: Any, chunks: Any) -> Any:
        keys = list(keys)
        spec = super()._get_load_store_spec(keys, chunks)
        spec.offload_keys = tuple(keys)
        return spec


class DriverCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``CPUOffloadingSpec`` (its chunk count, its ``CPUOffloadingManager`` with the
    configured eviction policy, its events) with a :class:`FakeOffloadingWorker` on the
    worker side instead of its CUDA worker."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.fake_worker: FakeOffloadingWorker | None = None

    def get_manager(self) -> Any:
        if self._manager is None:
            manager = super().get_manager()
            # vLLM's manager as built, with the key-recording spec hook.
            if type(manager) is CPUOffloadingManager:
                manager.__class__ = KeyedCPUOffloadingManager
        return self._manager

    def get_worker(self, kv_caches: Any) -> FakeOffloadingWorker:
        if self.fake_worker is None:
            self.fake_worker = FakeOffloadingWorker()
        return self.fake_worker


@dataclasses.dataclass
class Transfer:
    """One transfer a :class:`FakeOffloadingWorker` was given."""

    job_id: int
    store: bool  # GPU to CPU; else a load, CPU to GPU
    src: LoadStoreSpec
    dst: LoadStoreSpec
    expedited: bool = False


class FakeOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    """An ``OffloadingWorker`` that copies nothing: it records every transfer submitted
    (``transfers``, in order) and completes them, successfully, when told to
    (:meth:`complete_all`) or waited on."""

    def __init__(self) -> None:
        self.transfers: list[Transfer] = []
        self.pending: dict[int, Transfer] = {}
        self.completed: list[int] = []  # job ids, in completion order
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        return self._submit(Transfer(job_id, True, src_spec, dst_spec))

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._submit(Transfer(job_id, False, src_spec, dst_spec, expedited))

    def _submit(self, transfer: Transfer) -> bool:
        assert transfer.job_id not in self.pending, f"job {transfer.job_id} submitted twice"
        self.transfers.append(transfer)
        self.pending[transfer.job_id] = transfer
        return True

    def complete(self, job_ids: Any) -> None:
        for job_id in sorted(job_ids):
            if self.pending.pop(job_id, None) is not None:
                self.completed.append(job_id)
                self._finished.append(TransferResult(job_id=job_id, success=True))

    def complete_all(self) -> None:
        self.complete(list(self.pending))

    def wait(self, job_ids: set[int]) -> None:
        self.complete(job_ids)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished


def fake_kv_caches(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Every layer's KV cache (a Mamba layer's: one page a block, as bytes), as small CPU
    tensors laid out as :func:`kv_cache_tensors` says (the groups overlaying one zeroed
    allocation). Nothing reads or writes them: the worker's transfers copy nothing."""
    tensors = kv_cache_config.kv_cache_tensors
    num_blocks = kv_cache_config.num_blocks
    allocation = torch.zeros(max(t.size for t in tensors), dtype=torch.int8)
    placement = {layer: (t, i) for t in tensors for i, layer in enumerate(t.layers)}
    caches: dict[str, torch.Tensor] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer in group.layer_names:
            tensor, index = placement[layer]
            start = tensor.offset + index * tensor.layer_stride
            view = allocation[start : start + spec.page_size_bytes * num_blocks]
            if isinstance(spec, MLAAttentionSpec):
                shape: tuple[int, ...] = (num_blocks, spec.block_size, spec.head_size)
            elif isinstance(spec, AttentionSpec):
                shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
            else:  # a Mamba state: one page a block
                caches[layer] = view.view(num_blocks, spec.page_size_bytes)
                continue
            caches[layer] = view.view(spec.dtype).view(shape)
    return caches


def copy_metadata(metadata: OffloadingConnectorMetadata) -> OffloadingConnectorMetadata:
    """The metadata as a worker receives it (a copy: the worker pops flushed store jobs from
    it, and the scheduler's record must keep them)."""
    return dataclasses.replace(
        metadata,
        load_jobs=dict(metadata.load_jobs),
        store_jobs=dict(metadata.store_jobs),
        jobs_to_flush=None if metadata.jobs_to_flush is None else set(metadata.jobs_to_flush),
    )


class ConnectorWorker:
    """The worker side of a scheduler's ``OffloadingConnector``, as vLLM's model runner
    drives it: a WORKER-role connector over :func:`fake_kv_caches`, whose spec's worker is a
    :class:`FakeOffloadingWorker`. :meth:`step` runs it over one ``SchedulerOutput`` and
    returns the ``KVConnectorOutput`` for the model runner's output; every transfer
    submitted in a step completes in that step."""

    def __init__(self, scheduler: Scheduler, connector: Any = None) -> None:
        """``connector``: the scheduler's OffloadingConnector (by default
        ``scheduler.connector``; a MultiConnector's child, with that child's configuration)."""
        connector = scheduler.connector if connector is None else connector
        if not isinstance(connector, OffloadingConnector):
            raise ValueError(
                f"the driver fakes the OffloadingConnector's worker side only, "
                f"not {type(connector).__name__}'s"
            )
        vllm_config: VllmConfig = connector._vllm_config
        kv_cache_config = scheduler.kv_cache_config
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        with set_current_vllm_config(vllm_config):
            self.connector.register_kv_caches(fake_kv_caches(kv_cache_config))
        worker = self.connector.connector_worker.worker
        assert isinstance(worker, FakeOffloadingWorker), (
            f"the spec must be {SPEC_NAME} (spec_module_path {SPEC_MODULE})"
        )
        self.worker: FakeOffloadingWorker = worker
        self._context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})

    def step(self, out: SchedulerOutput) -> KVConnectorOutput:
        """One step of the worker side: preemption flushes, this step's loads and the last
        step's stores submitted, every transfer completed, this step's stores queued (vLLM
        submits them at the next step's start), and what finished reported."""
        assert isinstance(out.kv_connector_metadata, OffloadingConnectorMetadata)
        metadata = copy_metadata(out.kv_connector_metadata)
        connector = self.connector
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(self._context)
        self.worker.complete_all()
        connector.wait_for_save()
        finished_sending, finished_recving = connector.get_finished(out.finished_req_ids)
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=worker_meta,
        )


def fake_worker(scheduler: Scheduler, connector: Any) -> ConnectorWorker:
    """The driver's worker side for the connector (``fake_model.connector_worker``)."""
    return ConnectorWorker(scheduler, connector)


def _gpu_spec(spec: Any) -> tuple[Any, ...]:
    if not isinstance(spec, GPULoadStoreSpec):
        return ("?", repr(spec))
    return (
        tuple(int(b) for b in spec.block_ids),
        tuple(spec.group_sizes),
        tuple(spec.block_indices),
    )


def _offload_spec(spec: Any) -> tuple[Any, ...]:
    block_ids = getattr(spec, "block_ids", None)
    return (
        None if block_ids is None else tuple(int(b) for b in block_ids),
        getattr(spec, "offload_keys", None),
    )


def _job(job_id: int, job: TransferJob, store: bool) -> tuple[Any, ...]:
    gpu, offloaded = (job.src_spec, job.dst_spec) if store else (job.dst_spec, job.src_spec)
    return (job_id, job.req_id, _gpu_spec(gpu), *_offload_spec(offloaded), job.sync)


def connector_decisions(out: SchedulerOutput) -> tuple[list[Any], list[Any], list[int]]:
    """What a step's ``OffloadingConnector`` metadata decided, as plain values:
    ``(loads, stores, flushed)``. Each load or store is ``(job id, request id, (GPU block
    ids, blocks per group, first block index per group), CPU chunk ids, offload keys,
    sync)`` (the keys where :class:`KeyedCPUOffloadingManager` prepared the spec, else
    None), by job id; ``flushed`` the job ids the step flushes. All empty without
    offloading metadata."""
    metadata = out.kv_connector_metadata
    if not isinstance(metadata, OffloadingConnectorMetadata):
        return [], [], []
    loads = [_job(i, j, False) for i, j in sorted(metadata.load_jobs.items())]
    stores = [_job(i, j, True) for i, j in sorted(metadata.store_jobs.items())]
    return loads, stores, sorted(metadata.jobs_to_flush or ())
