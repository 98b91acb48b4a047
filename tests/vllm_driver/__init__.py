"""The test driver: vLLM's own V1 scheduler on the CPU, driven by a fake model; what the vLLM
test tier builds its schedulers with and ``benches/bench_vllm.py`` runs.

It extends the benchmark that ships for ``kvblocks bench --engine vllm``
(:mod:`kvblocks.vllm.bench`: the tiny model, the ``VllmConfig``, the KV-cache layout, the
scheduler, the fake model, timed runs) with test doubles that do not ship:

- :mod:`~tests.vllm_driver.config`: the :class:`SchedulerSpec` with KV connectors and
  speculative decoding (and the test-only Triton flag for vLLM 0.34's CPU platform);
- :mod:`~tests.vllm_driver.speculative`: speculative decoding (vLLM's own
  ``SpeculativeConfig``, draft models written as tiny configs);
- :mod:`~tests.vllm_driver.drafts`: the fake model's drafter (proposals, which drafts a step
  accepts, and how they reach the scheduler);
- :mod:`~tests.vllm_driver.connectors`: which module fakes each connector's worker side;
- :mod:`~tests.vllm_driver.offloading`: vLLM's native CPU offloading (the
  ``OffloadingConnector``, ``SchedulerSpec.kv_offloading``) with a fake worker side; it
  imports vLLM, so it is imported where a spec turns offloading on;
- :mod:`~tests.vllm_driver.nixl`: NIXL's connector in both roles, pull or push mode
  (``SchedulerSpec.nixl``, ``nixl_transfer_mode``) with a fake worker side, and the
  ``kv_transfer_params`` of prefill and decode requests;
- :mod:`~tests.vllm_driver.mooncake`: vLLM's MooncakeConnector in both roles
  (``SchedulerSpec.mooncake``) with a fake worker side;
- :mod:`~tests.vllm_driver.decode_bench`: vLLM's DecodeBenchConnector
  (``SchedulerSpec.decode_bench``) with a fake worker side;
- :mod:`~tests.vllm_driver.multi`: vLLM's MultiConnector of NIXL and CPU offloading (a spec
  with both ``nixl`` and ``kv_offloading``), its fake worker side joining theirs.

Importing the driver imports nothing of vLLM and changes no environment variable; it fails
with ModuleNotFoundError where vllm is not installed. The first function that builds
something of vLLM's selects vLLM's CPU platform
(:func:`~kvblocks.vllm.bench.platform.select_cpu_platform`).
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from kvblocks.vllm.bench import fake_model
from kvblocks.vllm.bench.config import (
    LAYOUTS,
    layout_groups,
    make_kv_cache_config,
    make_scheduler,
    make_vllm_config,
    tiny_model_dir,
    write_model_dir,
)
from kvblocks.vllm.bench.fake_model import (
    block_hasher,
    make_request,
    model_output,
    sampled_token,
)
from kvblocks.vllm.bench.platform import MAX_MODEL_LEN, VOCAB_SIZE, select_cpu_platform
from kvblocks.vllm.bench.timing import Timings, Workload, implementation_of, timed_run
from tests.vllm_driver.config import DriverModel as FakeModel
from tests.vllm_driver.config import SchedulerSpec
from tests.vllm_driver.connectors import connector_decisions
from tests.vllm_driver.drafts import Drafter, drafter_for
from tests.vllm_driver.speculative import Speculation


def snapshot(out: Any) -> tuple[Any, ...]:
    """:func:`kvblocks.vllm.bench.fake_model.snapshot` with the driver's connectors."""
    return fake_model.snapshot(out, connector_decisions)


if find_spec("vllm") is None:  # say it now, not at the first run
    raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

__all__ = [
    "LAYOUTS",
    "MAX_MODEL_LEN",
    "VOCAB_SIZE",
    "Drafter",
    "FakeModel",
    "SchedulerSpec",
    "Speculation",
    "Timings",
    "Workload",
    "block_hasher",
    "drafter_for",
    "implementation_of",
    "layout_groups",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "model_output",
    "sampled_token",
    "select_cpu_platform",
    "snapshot",
    "timed_run",
    "tiny_model_dir",
    "write_model_dir",
]
