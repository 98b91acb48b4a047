"""kvblocks on the real vLLM 0.34.0, the second release it supports: there kvblocks' request
block hasher and its KV-cache manager both run, as on 0.33.

``.ci/run`` installs that release (vllm 0.34.0, ``--no-deps``) into a directory of its own
and names it in ``KVBLOCKS_NEXT_VLLM``; each case runs in a fresh process that finds it first
on its path (the rest of the environment is the tier's). Its plugin loads through vLLM's own
plugin loader, as in every process vLLM starts; the hasher EngineCore would build is
kvblocks' and hashes a request as vLLM 0.34's own does (the full differentials on 0.34 are
the tier's files that ``.ci/run`` runs on each release); ``--scheduler-cls
kvblocks.vllm.Scheduler`` (and ``AsyncScheduler``) builds kvblocks' manager; every module of
kvblocks' vLLM integration imports; vLLM 0.34's scheduler decides the same, step by step,
with kvblocks' hasher and manager as with its own; ``kvblocks bench --engine vllm`` on an x86
CPU without Triton says in one line why vLLM 0.34 does not run there. (vLLM 0.34 removed
``KVCacheManager.get_num_common_prefix_blocks``, which kvblocks 0.1.0 bound at import, so
that ``--scheduler-cls kvblocks.vllm.Scheduler`` stopped vLLM's start-up.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.fresh_process import run_cli, run_python
from tests.test_any_vllm import IMPORT_EVERY_MODULE, KEEP_LOG_LINES, PRODUCT

NEXT = os.environ.get("KVBLOCKS_NEXT_VLLM")
if NEXT is None and os.environ.get("KVBLOCKS_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVBLOCKS_NEXT_VLLM is not set: .ci/run installs vLLM 0.34 and sets it")
pytestmark = pytest.mark.skipif(
    NEXT is None, reason="KVBLOCKS_NEXT_VLLM names no vLLM release (.ci/run installs one)"
)

CHILD = (
    KEEP_LOG_LINES
    + r"""
logging.getLogger("vllm.kvblocks").setLevel(logging.INFO)
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every process vLLM starts does first
from vllm.v1.core import kv_cache_utils
"""
    + IMPORT_EVERY_MODULE
    + r"""
import json, sys
from importlib.metadata import version
import numpy as np
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from kvblocks.vllm import AsyncScheduler, Scheduler, _state
from tests.vllm_driver import SchedulerSpec, make_scheduler, tiny_model_dir

# The hasher EngineCore builds (the name kv_cache_utils holds), and vLLM's own, on a prompt
# sent as the int32 array a frontend sends; and continuing from the first two block hashes a
# frontend computed (EngineCoreRequest.block_hashes).
hash_fn = get_hash_fn_by_name("sha256_cbor")
kv_cache_utils.init_none_hash(hash_fn)
ours = kv_cache_utils.get_request_block_hasher(16, hash_fn, 0)
stock = _state.original_or_current(kv_cache_utils, "get_request_block_hasher")(16, hash_fn, 0)
prompt = np.arange(1000, 1000 + 16 * 5 + 3, dtype=np.int32)
def request(name, hasher, **kwargs):
    return Request(name, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher, **kwargs)
hashes = [request("a", stock).block_hashes, request("b", ours).block_hashes]
hashes.append(request("c", ours, block_hashes=list(hashes[0][:2])).block_hashes)

managers = []
for cls in (Scheduler, AsyncScheduler):
    spec = SchedulerSpec(block_size=16, num_blocks=64, layout="llama", hash_algo="sha256",
                         async_scheduling=cls is AsyncScheduler)
    scheduler = make_scheduler(tiny_model_dir(), spec, scheduler_cls=cls)
    managers.append(type(scheduler.kv_cache_manager).__module__)
status = v.status()
print(json.dumps({
    "vllm": version("vllm"),
    "hasher": kv_cache_utils.get_request_block_hasher.__module__,
    "hashes": [[h.hex() for h in side] for side in hashes],
    "errors": errors,
    "imported": sorted(m for m in sys.modules if m.startswith("kvblocks.")),
    "managers": managers,
    "mode": status.mode,
    "active": status.active,
    "fallbacks": status.fallbacks,
    "messages": [m for m in messages if m[0] != "DEBUG"],
}))
"""
)


@pytest.fixture(scope="module")
def started() -> dict[str, Any]:
    assert NEXT is not None
    done = run_python(CHILD, env={"PYTHONPATH": NEXT, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_release_is_the_vllm_found(started: dict[str, Any]) -> None:
    assert started["vllm"] == "0.34.0"


def test_every_module_imports(started: dict[str, Any]) -> None:
    assert started["errors"] == {}
    assert set(PRODUCT) <= set(started["imported"])


def test_the_hasher_runs_on_kvblocks_and_hashes_as_vllm(started: dict[str, Any]) -> None:
    assert started["mode"] == "all"
    assert started["hasher"] == "kvblocks.vllm.block_hasher"
    assert started["active"]["hasher"] == "sha256_cbor"
    stock, ours, continued = started["hashes"]
    assert len(stock) == 5  # 83 tokens: five full blocks
    assert ours == stock
    assert continued == stock


def test_the_manager_is_kvblocks(started: dict[str, Any]) -> None:
    assert started["managers"] == ["kvblocks.vllm.kv_cache_manager"] * 2
    assert started["active"]["kv_cache_manager"] == "16-token blocks, prefix caching on"
    assert started["fallbacks"] == {}
    assert not [m for m in started["messages"] if m[0] not in ("INFO", "DEBUG")]


def test_bench_engine_vllm_on_a_cpu_without_triton_says_so_in_one_line() -> None:
    """vLLM 0.34 refuses x86 CPUs without Triton's CPU backend (not on PyPI), which the
    benchmark's CPU platform is here; elsewhere (an x86 machine with a GPU's Triton, an Arm
    CPU) it runs and compares."""
    assert NEXT is not None
    argv = ["bench", "--engine", "vllm", "--num-requests", "8", "--prefix-len", "40"]
    argv += ["--suffix-len", "9", "--output-len", "3", "--rounds", "1", "--num-blocks", "64"]
    done = run_cli(*argv, env={"PYTHONPATH": NEXT})
    if done.returncode == 0:
        assert "scheduler outputs: identical in every run" in done.stdout
        return
    assert done.returncode == 2, done.stderr[-2000:]
    *_, line = done.stderr.splitlines()
    assert line.startswith("--engine vllm: this vLLM refuses x86 CPUs without Triton's CPU")
    assert '"vllm==0.33.0"' in line
    assert "Traceback" not in done.stderr


SCHEDULER_RUN = r"""
import json
import kvblocks.vllm
from kvblocks.vllm.bench.timing import Workload, timed_run
from tests.vllm_driver import SchedulerSpec, tiny_model_dir

# vLLM 0.34's own scheduler driven by the benchmark driver's fake model: stock, then with
# kvblocks' hasher, then with its hasher and manager, on requests sharing a prefix.
workload = Workload(num_requests=12, prompt_len=150, shared_len=100, output_len=20)
runs = {}
for mode in ("off", "hasher", "all"):
    kvblocks.vllm.install(mode)
    for algo in ("sha256", "xxhash_cbor"):
        spec = SchedulerSpec(block_size=16, num_blocks=80, hash_algo=algo, max_num_seqs=6,
                             max_num_batched_tokens=256)
        timings, steps = timed_run(tiny_model_dir(), spec, workload)
        runs[f"{mode}/{algo}"] = {"implementation": timings.implementation,
                                  "steps": repr(steps), "num_steps": timings.steps}
print(json.dumps({"runs": runs, "status": str(kvblocks.vllm.status())}))
"""


def test_vllm_schedules_identically_with_kvblocks_hasher() -> None:
    """Step by step, vLLM 0.34's scheduler decides the same with kvblocks' hasher, and with
    its hasher and manager, as with its own (a pool small enough that requests wait and
    blocks are evicted), and kvblocks' parts were the ones that ran."""
    assert NEXT is not None
    done = run_python(SCHEDULER_RUN, env={"PYTHONPATH": NEXT, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    runs = result["runs"]
    hasher_only = "manager vllm.v1.core.kv_cache_manager, hasher kvblocks.vllm.block_hasher"
    for algo in ("sha256", "xxhash_cbor"):
        stock, ours, all_ = (runs[f"{mode}/{algo}"] for mode in ("off", "hasher", "all"))
        assert stock["implementation"] == "vllm"
        assert ours["implementation"] == hasher_only
        assert all_["implementation"] == "kvblocks"
        assert stock["num_steps"] > 20
        assert ours["steps"] == stock["steps"]
        assert all_["steps"] == stock["steps"]
