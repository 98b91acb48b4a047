"""The benchmark driver: vLLM 0.33's own V1 scheduler on the CPU, driven by a fake model;
what ``benches/bench_vllm.py`` and ``kvblocks bench --engine vllm`` run (and what the vLLM
test tier builds its schedulers with).

No network and no weights: a tiny Llama ``config.json`` written to a directory (tiny draft
models' too, for speculative decoding), a ``KVCacheConfig`` of the layout's groups, and fake
model outputs. The scheduler, its KV-cache manager and the request block hasher are vLLM's
(or kvblocks', where the plugin is installed).

- :mod:`~kvblocks.vllm.bench_driver.config`: vLLM's platform, the tiny model, the
  ``VllmConfig``, the KV-cache layout and the scheduler;
- :mod:`~kvblocks.vllm.bench_driver.speculative`: speculative decoding (vLLM's own
  ``SpeculativeConfig``, draft models written as tiny configs);
- :mod:`~kvblocks.vllm.bench_driver.fake_model`: requests, the fake model's outputs, and what
  a step decided;
- :mod:`~kvblocks.vllm.bench_driver.drafts`: the fake model's drafter (proposals, which
  drafts a step accepts, and how they reach the scheduler);
- :mod:`~kvblocks.vllm.bench_driver.timing`: workloads and timed runs;
- :mod:`~kvblocks.vllm.bench_driver.offloading`: vLLM's native CPU offloading (the
  ``OffloadingConnector``, ``SchedulerSpec.kv_offloading``) with a fake worker side. It
  imports vLLM, so it is not imported here: the driver imports it where a spec turns
  offloading on;
- :mod:`~kvblocks.vllm.bench_driver.nixl`: NIXL's connector in both roles, pull or push mode
  (disaggregated prefill and decode, ``SchedulerSpec.nixl``, ``nixl_transfer_mode``) with a
  fake worker side, and the ``kv_transfer_params`` of prefill and decode requests;
- :mod:`~kvblocks.vllm.bench_driver.mooncake`: vLLM's MooncakeConnector in both roles
  (``SchedulerSpec.mooncake``) with a fake worker side, and its requests' ``kv_transfer_params``;
- :mod:`~kvblocks.vllm.bench_driver.decode_bench`: vLLM's DecodeBenchConnector
  (``SchedulerSpec.decode_bench``) with a fake worker side;
- :mod:`~kvblocks.vllm.bench_driver.multi`: vLLM's MultiConnector of NIXL and CPU offloading
  (a spec with both ``nixl`` and ``kv_offloading``), its fake worker side joining theirs
  (imports vLLM, like the offloading module).

Importing the driver imports nothing of vLLM and changes no environment variable; it fails
with ModuleNotFoundError where vllm is not installed (``kvblocks bench --engine vllm`` says so).
The first function that builds something of vLLM's selects vLLM's CPU platform
(:func:`~kvblocks.vllm.bench_driver.config.select_cpu_platform`).
"""

from __future__ import annotations

from importlib.util import find_spec

from kvblocks.vllm.bench_driver.config import (
    LAYOUTS,
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    SchedulerSpec,
    layout_groups,
    make_kv_cache_config,
    make_scheduler,
    make_vllm_config,
    select_cpu_platform,
    tiny_model_dir,
    write_model_dir,
)
from kvblocks.vllm.bench_driver.drafts import Drafter, drafter_for
from kvblocks.vllm.bench_driver.fake_model import (
    FakeModel,
    block_hasher,
    make_request,
    model_output,
    sampled_token,
    snapshot,
)
from kvblocks.vllm.bench_driver.speculative import Speculation
from kvblocks.vllm.bench_driver.timing import Timings, Workload, implementation_of, timed_run

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
