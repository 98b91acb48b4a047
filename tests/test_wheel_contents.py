"""What ``pip install kvblocks`` puts on a user's disk: the modules users import and what the
shipped commands run, nothing else (test doubles and benchmark drivers stay in the repository).

maturin packs every file of ``python/kvblocks`` next to the native module, so the source tree
is checked on every run; ``.ci/run`` also builds the wheel and points ``KVBLOCKS_WHEEL`` at it,
and then the wheel itself is listed.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "kvblocks"

#: Every file of the installed package but the native module, by what it is for.
ALLOWLIST = {
    # The native API and the package's own entry points.
    "kvblocks/__init__.py",
    "kvblocks/__main__.py",
    "kvblocks/_core.pyi",
    "kvblocks/_install.py",
    "kvblocks/py.typed",
    "kvblocks/kv_events.py",
    "kvblocks/stats.py",
    "kvblocks/step.py",
    # The router package: the routing index for fleets of vLLM replicas (on the native
    # RouterIndex), its event feeds, the fleet file, the `kvblocks route` service and the
    # endpoint picker for Envoy (the Gateway API Inference Extension).
    "kvblocks/router/__init__.py",
    "kvblocks/router/index.py",
    "kvblocks/router/feeds.py",
    "kvblocks/router/fleet.py",
    "kvblocks/router/scorer.py",
    "kvblocks/router/picker.py",
    "kvblocks/router/openai.py",
    # How long-running commands (`kvblocks route`) stop on SIGTERM and SIGINT.
    "kvblocks/_signals.py",
    # kvblocks inside vLLM: the plugin, hasher (and the prompt hasher for frontends), manager,
    # scheduler hook, allowlist (support), status, the releases it supports and the
    # fingerprints of the vLLM rules it reproduces.
    "kvblocks/vllm/__init__.py",
    "kvblocks/vllm/_state.py",
    "kvblocks/vllm/block_hasher.py",
    "kvblocks/vllm/frontend.py",
    "kvblocks/vllm/kv_cache_manager.py",
    "kvblocks/vllm/scheduler.py",
    "kvblocks/vllm/support.py",
    "kvblocks/vllm/versions.py",
    "kvblocks/vllm/fingerprints/__init__.py",
    "kvblocks/vllm/fingerprints/__main__.py",
    "kvblocks/vllm/fingerprints/extract.py",
    "kvblocks/vllm/fingerprints/ported.py",
    "kvblocks/vllm/fingerprints/vllm-0.33.0.json",
    "kvblocks/vllm/fingerprints/vllm-0.34.0.json",
    # `kvblocks bench --engine vllm`: vLLM's scheduler on a tiny model with a fake model, no
    # KV connector and no drafter (those test doubles are in tests/vllm_driver).
    "kvblocks/vllm/bench/__init__.py",
    "kvblocks/vllm/bench/config.py",
    "kvblocks/vllm/bench/fake_model.py",
    "kvblocks/vllm/bench/logs.py",
    "kvblocks/vllm/bench/platform.py",
    "kvblocks/vllm/bench/timing.py",
    # vLLM's engine-core loop on a modelled device, replayed (benches/bench_vllm_engine.py).
    "kvblocks/vllm/bench/engine_loop.py",
    # The pure-Python reference (kvblocks.reference): the baseline users compare against.
    "kvblocks/reference/__init__.py",
    "kvblocks/reference/_args.py",
    "kvblocks/reference/_events.py",
    "kvblocks/reference/_requests.py",
    "kvblocks/reference/_step.py",
    "kvblocks/reference/_verify.py",
    "kvblocks/reference/hashing.py",
    "kvblocks/reference/manager.py",
    "kvblocks/reference/pool.py",
    "kvblocks/reference/router.py",
    "kvblocks/reference/sequence.py",
    # The embedded engine (the [torch] extra): scheduler, engine, runtime, model.
    "kvblocks/scheduler.py",
    "kvblocks/engine.py",
    "kvblocks/prompts.py",
    "kvblocks/model/__init__.py",
    "kvblocks/model/config.py",
    "kvblocks/model/llama.py",
    "kvblocks/model/loading.py",
    "kvblocks/runtime/__init__.py",
    "kvblocks/runtime/_metadata.py",
    "kvblocks/runtime/_torch_attention.py",
    "kvblocks/runtime/attention.py",
    "kvblocks/runtime/kv_cache.py",
    "kvblocks/runtime/runner.py",
    "kvblocks/runtime/triton_attention.py",
    "kvblocks/runtime/triton_selfcheck.py",
    # The `kvblocks` command (`kvblocks bench`, the Quickstart's main job, and `kvblocks hash`)
    # and the workloads and report of its embedded-engine benchmark.
    "kvblocks/cli.py",
    "kvblocks/engine_bench.py",
    "kvblocks/engine_bench_report.py",
    "kvblocks/workloads.py",
}


def _is_native(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith("_core.") and base.endswith((".so", ".pyd"))


def _source_files() -> set[str]:
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix not in (".pyc", ".pyo")
        and not _is_native(path.name)
    }


def _diff(found: set[str]) -> str:
    return (
        f"not in the allowlist: {sorted(found - ALLOWLIST)}; "
        f"listed but missing: {sorted(ALLOWLIST - found)}"
    )


def test_the_package_source_holds_exactly_the_allowlisted_files() -> None:
    found = _source_files()
    assert found == ALLOWLIST, _diff(found)


def test_no_test_double_or_benchmark_driver_is_in_the_package() -> None:
    """The fakes of vLLM's connectors and the drafter live in tests/vllm_driver."""
    assert (ROOT / "tests" / "vllm_driver" / "offloading.py").is_file()
    names = {path.rsplit("/", 1)[-1] for path in _source_files()}
    assert not names & {"offloading.py", "nixl.py", "mooncake.py", "drafts.py", "multi.py"}


@pytest.mark.skipif(
    not os.environ.get("KVBLOCKS_WHEEL"), reason="no built wheel (.ci/run sets KVBLOCKS_WHEEL)"
)
def test_the_built_wheel_holds_the_allowlist_and_the_native_module() -> None:
    with zipfile.ZipFile(os.environ["KVBLOCKS_WHEEL"]) as wheel:
        names = [n for n in wheel.namelist() if not n.endswith("/")]
    metadata = {n for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    native = {n for n in names if _is_native(n)}
    package = set(names) - metadata - native
    assert len(native) == 1, native
    (native_name,) = native
    assert native_name.startswith("kvblocks/_core."), native
    assert package == ALLOWLIST, _diff(package)
    # The default build has no benchmark-only native code (cargo feature bench-floor): the
    # class's name would be in the module's strings.
    with zipfile.ZipFile(os.environ["KVBLOCKS_WHEEL"]) as wheel:
        assert b"_HashingFloor" not in wheel.read(native_name)
    assert any(n.endswith("/entry_points.txt") for n in metadata)
