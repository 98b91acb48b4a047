"""vLLM's ``MooncakeConnector`` (disaggregated prefill and decode over Mooncake's transfer
engine) for the driver: the configuration ``SchedulerSpec.mooncake`` turns on, the
``kv_transfer_params`` a router gives prefill and decode requests, and a fake worker side.

As with :mod:`~kvblocks.vllm.bench_driver.nixl`, one scheduler plays both roles
(``kv_role="kv_both"``): a request with :func:`prefill_params` is a prefill node's (its blocks
stay held after it finishes until they are sent), one with :func:`decode_params` a decode
node's (its prompt's KV arrives asynchronously into the blocks allocated for it). The
connector's scheduler side is vLLM's, unchanged; its worker side is
:class:`FakeMooncakeWorker`: a decode request's transfer started by a step's metadata
completes in that step, and a finished prefill's blocks are sent ``send_delay`` steps after
the step that hands them over. No Mooncake library, network or GPU is involved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench_driver.config import select_cpu_platform

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
        self._sending: dict[str, tuple[str, int]] = {}  # request id -> (transfer id, steps)

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
                self._sending.setdefault(request_id, (transfer_id, self.send_delay))
        dropped = metadata.reqs_not_processed
        sent = set()
        for request_id, (transfer_id, steps) in list(self._sending.items()):
            if transfer_id in dropped:
                del self._sending[request_id]
            elif steps <= 1:
                del self._sending[request_id]
                sent.add(request_id)
            else:
                self._sending[request_id] = (transfer_id, steps - 1)
        return KVConnectorOutput(finished_sending=sent or None, finished_recving=recving or None)


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
