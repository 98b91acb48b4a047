"""Which driver module fakes the worker side of each of vLLM's KV connectors.

Each such module has ``fake_worker(scheduler, connector)`` (the worker side) and
``connector_decisions(out)`` (a step's decisions as plain values). They are looked up by the
class name of vLLM's connector and of its metadata, and imported on first use (the
offloading and MultiConnector modules import vLLM at module level).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvblocks.vllm.bench.fake_model import WorkerSide

_FAKES = {
    "OffloadingConnector": "offloading",
    "OffloadingConnectorMetadata": "offloading",
    "NixlPullConnector": "nixl",  # also vLLM's NixlConnector
    "NixlPushConnector": "nixl",
    "NixlConnectorMetadata": "nixl",
    "MooncakeConnector": "mooncake",
    "MooncakeConnectorMetadata": "mooncake",
    "DecodeBenchConnector": "decode_bench",
    "DecodeBenchConnectorMetadata": "decode_bench",
    "MultiConnector": "multi",
    "MultiKVConnectorMetadata": "multi",
}


def _fake(connector_or_metadata: Any) -> Any:
    name = type(connector_or_metadata).__name__
    if name not in _FAKES:
        raise ValueError(f"the driver fakes no worker side for {name}")
    return importlib.import_module(f"tests.vllm_driver.{_FAKES[name]}")


def connector_worker(scheduler: Scheduler, connector: Any = None) -> WorkerSide:
    """The worker side the driver fakes for the scheduler's KV connector (or for
    ``connector``, a MultiConnector's child): the OffloadingConnector's, NIXL's, Mooncake's,
    the DecodeBenchConnector's or a MultiConnector's; any other connector is refused."""
    connector = scheduler.connector if connector is None else connector
    worker: WorkerSide = _fake(connector).fake_worker(scheduler, connector)
    return worker


def connector_decisions(out: SchedulerOutput) -> tuple[Any, ...]:
    """What the step's KV connector metadata decided, as plain values (each fake module's
    ``connector_decisions``)."""
    decisions: tuple[Any, ...] = _fake(out.kv_connector_metadata).connector_decisions(out)
    return decisions
