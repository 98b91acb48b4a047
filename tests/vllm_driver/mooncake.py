"""vLLM's ``MooncakeConnector`` (disaggregated prefill and decode over Mooncake's transfer
engine) for the driver: the configuration ``SchedulerSpec.mooncake`` turns on, the
``kv_transfer_params`` a router gives prefill and decode requests, and a fake worker side.

As with :mod:`~tests.vllm_driver.nixl`, one scheduler plays both roles
(``kv_role="kv_both"``): a request with :func:`prefill_params` is a prefill node's (its blocks
stay held after it finishes until they are sent), one with :func:`decode_params` a decode
node's (its prompt's KV arrives asynchronously into the blocks allocated for it). The
connector's scheduler side is vLLM's, unchanged; its worker side is
:class:`FakeMooncakeWorker`: a decode request's transfer started by a step's metadata
completes in that step, and a finished prefill's blocks are sent ``send_delay`` steps after
the step that hands them over. No Mooncake library, network or GPU is involved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench.platform import select_cpu_platform
from tests.vllm_driver.nixl import count_down

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

#: The engine id every run uses, and the remote prefill node decode requests read from.
ENGINE_ID = "kvblocks-driver"
REMOTE_ENGINE_ID = "kvblocks-driver-prefill"


def kv_transfer_config() -> KVTransferConfig:
    """Mooncake's connector in both roles, as ``--kv-transfer-config`` sets it."""
    select_cpu_platform()
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="MooncakeConnector", kv_role="kv_both", engine_id=ENGINE_ID
    )


def prefill_params(request_id: str) -> dict[str, Any]:
    """A prefill node's request, as the router sends it (a transfer id per request)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": f"x-{request_id}"}


def decode_params(request_id: str) -> dict[str, Any]:
    """A decode node's request: its prompt's KV is on the remote prefill node."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": REMOTE_ENGINE_ID,
        "remote_bootstrap_addr": "localhost:8998",
        "transfer_id": f"x-{request_id}",
    }


class FakeMooncakeWorker:
    """Mooncake's worker side, faked: every transfer into a decode request's blocks that a
    step's metadata starts (``reqs_to_recv``, blocks given) completes in that step
    (``finished_recving``; an entry without blocks only tells the prefill node to free its
    own); a finished prefill's blocks handed over in a step (``reqs_to_send``, blocks given)
    are sent ``send_delay`` steps later (``finished_sending``), unless its transfer is
    dropped (``reqs_not_processed``, by transfer id)."""

    def __init__(self, send_delay: int = 2) -> None:
        self.send_delay = send_delay
        self._sending: dict[str, int] = {}  # request id -> steps left
        self._transfer_ids: dict[str, str] = {}  # request id -> its transfer id

    def step(self, out: SchedulerOutput) -> KVConnectorOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeConnectorMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        metadata = out.kv_connector_metadata
        assert isinstance(metadata, MooncakeConnectorMetadata)
        recving = {
            request_id
            for pulls in metadata.reqs_to_recv.values()
            for request_id, pull in pulls.items()
            if any(pull.local_block_ids)
        }
        for request_id, (transfer_id, blocks) in metadata.reqs_to_send.items():
            if any(blocks):
                self._sending.setdefault(request_id, self.send_delay)
                self._transfer_ids[request_id] = transfer_id
        for request_id, transfer_id in list(self._transfer_ids.items()):
            if transfer_id in metadata.reqs_not_processed:
                self._sending.pop(request_id, None)
        sent = count_down(self._sending)
        for request_id in set(self._transfer_ids) - set(self._sending):
            del self._transfer_ids[request_id]
        return KVConnectorOutput(finished_sending=sent or None, finished_recving=recving or None)


def fake_worker(scheduler: Any, connector: Any) -> FakeMooncakeWorker:
    """The driver's worker side for the connector (``fake_model.connector_worker``)."""
    return FakeMooncakeWorker()


def connector_decisions(out: SchedulerOutput) -> tuple[list[Any], list[Any], list[Any]]:
    """What a step's Mooncake metadata decided, as plain values: the transfers into decode
    requests' blocks it starts (request id, remote engine, local blocks per group), the
    prefills it hands over or registers (request id, transfer id, blocks per group), and the
    transfer ids that will not be sent."""
    metadata = out.kv_connector_metadata
    recv = sorted(
        (request_id, engine, [list(g) for g in pull.local_block_ids])
        for engine, pulls in metadata.reqs_to_recv.items()
        for request_id, pull in pulls.items()
    )
    send = sorted(
        (request_id, transfer_id, [list(g) for g in blocks])
        for request_id, (transfer_id, blocks) in metadata.reqs_to_send.items()
    )
    return recv, send, sorted(metadata.reqs_not_processed)
