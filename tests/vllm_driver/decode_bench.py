"""vLLM's ``DecodeBenchConnector`` in the driver (``SchedulerSpec.decode_bench``): the connector
vLLM offers for benchmarking a decode instance, which tells the scheduler that every prompt's
KV but its last token is already there (an external hit, loaded synchronously) and has its
worker side fill the blocks with dummy values. The scheduler side is vLLM's, unchanged; the
worker side, :class:`FakeDecodeBenchWorker`, fills nothing and, as vLLM's fills are
synchronous, has nothing to report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench.platform import select_cpu_platform

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput


def kv_transfer_config(startup_fill: bool = False) -> KVTransferConfig:
    """The connector as ``--kv-transfer-config`` sets it (``startup_fill``: vLLM's option to
    fill the groups that need it once at start-up instead of per request)."""
    select_cpu_platform()
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="DecodeBenchConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"startup_fill": startup_fill},
    )


class FakeDecodeBenchWorker:
    """The connector's worker side, faked: the fills need no memory here, and finish within
    the step (vLLM reports nothing for them)."""

    def step(self, out: SchedulerOutput) -> KVConnectorOutput:
        from vllm.v1.outputs import KVConnectorOutput

        return KVConnectorOutput()


def fake_worker(scheduler: Any, connector: Any) -> FakeDecodeBenchWorker:
    """The driver's worker side for the connector (``fake_model.connector_worker``)."""
    return FakeDecodeBenchWorker()


def connector_decisions(out: SchedulerOutput) -> tuple[list[Any], list[Any], list[Any]]:
    """The step's fills as plain values: (request id, the block ids per group it fills, the
    number of tokens), by request id; then two empty fields (the snapshot's connector slots)."""
    metadata = out.kv_connector_metadata
    fills = sorted(
        (request_id, [list(group) for group in blocks], num_tokens)
        for request_id, (blocks, num_tokens) in metadata.reqs_to_fill.items()
    )
    return fills, [], []
