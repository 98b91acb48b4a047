"""vLLM's NIXL connector (disaggregated prefill and decode, in NIXL's pull or push mode) for
the driver: the configuration ``SchedulerSpec.nixl`` turns on, the ``kv_transfer_params`` a
router gives prefill and decode requests, and a fake worker side.

One scheduler plays both roles (``kv_role="kv_both"``): a request with
:func:`prefill_params` is a prefill node's (it computes its prompt, and its blocks stay held
after it finishes until the decode node has them); one with :func:`decode_params` is a
decode node's (its prompt's KV comes from a remote prefill node, asynchronously, into the
blocks the scheduler allocates for it). The connector's scheduler side is vLLM's, unchanged;
its worker side is :class:`FakeNixlWorker`. In pull mode the decode node reads: a read
started by a step's metadata completes in that step, and a finished prefill's blocks are
read ``read_delay`` steps after the step that hands them over. In push mode the prefill node
writes: a decode request's registration (its local blocks, sent to the prefill node)
is answered by a write that completes ``write_delay`` steps later, and a finished prefill's
blocks are written to their decode node ``read_delay`` steps after the hand-over. With
``SchedulerSpec.nixl_failed_loads`` = n, every n-th load that completes fails instead, as
NIXL's worker reports one (the request in ``failed_recving`` and, with one KV-cache group,
its local blocks in ``invalid_block_ids``); the scheduler then recomputes the request or fails
it (``SchedulerSpec.kv_load_failure_policy``). No NIXL library, network or GPU is involved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench.platform import select_cpu_platform

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

#: The engine id every run uses (vLLM's default is a random one, which the connector puts in
#: the ``kv_transfer_params`` it returns).
ENGINE_ID = "kvblocks-driver"
#: The remote prefill node decode requests read from (nothing connects to it).
REMOTE_ENGINE_ID = "kvblocks-driver-prefill"


#: vLLM's connector name for each of NIXL's transfer modes (``NixlConnector`` is the pull one).
CONNECTOR_NAMES = {"pull": "NixlConnector", "push": "NixlPushConnector"}
#: The driver's own key in NIXL's ``kv_connector_extra_config`` (NIXL does not read it):
#: every how many completed loads the fake worker side fails one.
FAILED_LOADS_KEY = "kvblocks_driver_failed_loads"


def kv_transfer_config(
    transfer_mode: str = "pull", failed_loads: int = 0, failure_policy: str = "fail"
) -> KVTransferConfig:
    """NIXL's connector in both roles, as ``--kv-transfer-config`` sets it, in pull or push
    mode, with vLLM's ``kv_load_failure_policy`` ("fail", vLLM's default, or "recompute");
    ``failed_loads`` = n makes the fake worker side fail every n-th load."""
    if transfer_mode not in CONNECTOR_NAMES:
        raise ValueError(f"NIXL's transfer mode is 'pull' or 'push', not {transfer_mode!r}")
    select_cpu_platform()
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAMES[transfer_mode],
        kv_role="kv_both",
        engine_id=ENGINE_ID,
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config={FAILED_LOADS_KEY: failed_loads} if failed_loads else {},
    )


def prefill_params() -> dict[str, Any]:
    """A prefill node's request: its KV goes to a decode node once computed."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def decode_params(request_id: str, num_remote_blocks: int) -> dict[str, Any]:
    """A decode node's request, as the prefill node's ``request_finished`` returned it: its
    prompt's KV is on the remote prefill node (``num_remote_blocks`` blocks; push mode's
    decode side does not read them: the prefill node learns the decode node's blocks)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(1, num_remote_blocks + 1))],
        "remote_engine_id": REMOTE_ENGINE_ID,
        "remote_request_id": f"prefill-{request_id}",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    }


class FakeNixlWorker:
    """NIXL's worker side, faked. Pull mode: every read a step's metadata starts for a
    request the scheduler parked (``awaiting_kvs``) completes in that step
    (``finished_recving``). Push mode: the prefill node's write answering a decode request's
    registration (``push_registrations``) completes ``write_delay`` steps later
    (``finished_recving``, also for a request aborted meanwhile, whose blocks the scheduler
    holds until then). Both: every finished prefill's blocks handed over in a step
    (``reqs_to_send``) reach the decode node ``read_delay`` steps later
    (``finished_sending``); an aborted one (``reqs_not_processed``) does not. With
    ``fail_every`` = n, every n-th completed load fails (``failed_recving``, and with
    ``num_groups`` 1 its local blocks in ``invalid_block_ids``, as NIXL's worker reports it)."""

    def __init__(
        self, read_delay: int = 2, write_delay: int = 2, fail_every: int = 0, num_groups: int = 1
    ) -> None:
        self.read_delay = read_delay
        self.write_delay = write_delay
        self.fail_every = fail_every
        self.num_groups = num_groups
        self._sending: dict[str, int] = {}
        self._writing: dict[str, int] = {}
        #: Each load's local blocks, per group (what a failed one reports).
        self._load_blocks: dict[str, list[list[int]]] = {}
        self._num_loads = 0

    def step(self, out: SchedulerOutput) -> KVConnectorOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        metadata = out.kv_connector_metadata
        assert isinstance(metadata, NixlConnectorMetadata)
        recving = {r for r, meta in metadata.reqs_to_recv.items() if meta.awaiting_kvs}
        for request_id in recving:
            blocks = metadata.reqs_to_recv[request_id].local_block_ids
            self._load_blocks[request_id] = [list(group) for group in blocks]
        for request_id, registration in metadata.push_registrations.items():
            self._writing.setdefault(request_id, self.write_delay)
            blocks = registration["local_block_ids"]
            self._load_blocks[request_id] = [list(group) for group in blocks]
        for request_id in metadata.reqs_to_send:
            self._sending.setdefault(request_id, self.read_delay)
        for request_id in metadata.reqs_not_processed:
            self._sending.pop(request_id, None)
        recving |= count_down(self._writing)
        sent = count_down(self._sending)
        failed: set[str] = set()
        invalid: set[int] = set()
        for request_id in sorted(recving):
            blocks = self._load_blocks.pop(request_id, [])
            self._num_loads += 1
            if self.fail_every and self._num_loads % self.fail_every == 0:
                failed.add(request_id)
                if self.num_groups == 1:
                    invalid.update(blocks[0] if blocks else ())
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
        )


def fake_worker(scheduler: Any, connector: Any) -> FakeNixlWorker:
    """The driver's worker side for NIXL (``fake_model.connector_worker``), failing loads as
    the engine's KV transfer configuration says (:data:`FAILED_LOADS_KEY`; NIXL alone: a
    MultiConnector's configuration has none)."""
    extra = scheduler.vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return FakeNixlWorker(
        fail_every=int(extra.get(FAILED_LOADS_KEY, 0)),
        num_groups=len(scheduler.kv_cache_config.kv_cache_groups),
    )


def count_down(pending: dict[str, int]) -> set[str]:
    """One step passes for each pending transfer; the ones it completes (removed)."""
    done = set()
    for request_id in list(pending):
        pending[request_id] -= 1
        if pending[request_id] <= 0:
            del pending[request_id]
            done.add(request_id)
    return done


def connector_decisions(out: SchedulerOutput) -> tuple[list[Any], list[Any], list[Any]]:
    """What a step's NIXL metadata decided, as plain values: the reads it starts (request id,
    the local blocks per group that receive the remote KV, the locally cached blocks per
    group, whether the request waits for them), the finished prefills whose blocks are
    handed over, and the requests prefilled in the batch, those that will not be sent, and
    push mode's registrations (decode requests' local blocks per group) and finished
    prefills' blocks per group."""
    metadata = out.kv_connector_metadata
    recv = sorted(
        (
            request_id,
            [list(group) for group in meta.local_block_ids],
            tuple(meta.local_num_computed_blocks),
            meta.awaiting_kvs,
        )
        for request_id, meta in metadata.reqs_to_recv.items()
    )
    send = sorted(metadata.reqs_to_send)
    other = [
        sorted(metadata.reqs_in_batch),
        sorted(metadata.reqs_not_processed),
        sorted(
            (request_id, [list(group) for group in registration["local_block_ids"]])
            for request_id, registration in metadata.push_registrations.items()
        ),
        sorted(
            (request_id, [list(group) for group in blocks])
            for request_id, blocks in metadata.push_finished_blocks.items()
        ),
    ]
    return recv, send, other
