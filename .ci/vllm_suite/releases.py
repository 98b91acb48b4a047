"""The vLLM releases the tier runs vLLM's own tests of, and what it checks on each.

A release is picked by the version of the vLLM under test (this Python's, or the tree
``run.py --vllm-root DIR`` puts first on the child processes' path). Each names its sdist (the
tests come from it), the test files, its expected-failures list, and the parts of kvblocks
ported to it: the ``all`` run must show each of those doing work (a part that fell back to
vLLM's code everywhere would leave the comparison proving nothing).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: kvblocks' parts, as ``kvblocks.vllm.status()`` names them.
HASHER, MANAGER = "hasher", "kv_cache_manager"

# vLLM 0.33.0's tests/v1/core files that build a scheduler, a KV-cache manager or request block
# hashes. Left out: prefix_cache/test_hybrid_prefix_cache_hit_rate.py (an OpenAI server on
# Qwen3.5-0.8B weights), test_reset_prefix_cache_e2e.py and test_scheduler_e2e.py (LLMEngine
# / LLM with model weights and a GPU), and the files that touch none of what kvblocks
# replaces: test_encoder_cache_manager, test_kv_cache_config_builder, test_kv_cache_metrics,
# test_kv_cache_planning, test_output, test_repetition_detection.
_CORE_0_33 = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
)
# vLLM's CPU offloading (the OffloadingConnector) driven through the scheduler with a fake
# worker side. (Its other test files build no scheduler: they drive the connector with mocks
# of the manager's results.)
_OFFLOADING = ("tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",)
# The scheduler with NIXL's connector (remote prefill and decode, the connector's worker side
# mocked), vLLM's MultiConnector and DecodeBenchConnector, connector lifecycles, failed and
# invalid loads. (test_nixl_connector*.py import `ray` and drive NIXL's worker side, which
# needs the nixl library; the other connectors' files build schedulers with connectors
# kvblocks does not serve, or none.)
_CONNECTORS_0_33 = (
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
)
_KV_CONNECTOR_LIFECYCLE = "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py"

# vLLM 0.34.0: the same files, but
# - new in tests/v1/core: test_prompt_block_hash_vectors.py (the engine's prompt block hashes,
#   sha256 and sha256_cbor, with LoRA, salt and lookahead, against the vectors of vLLM's Rust
#   frontend, a JSON file the sdist holds under rust/: unpacked with the tests);
# - gone: tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py;
# - new in tests/v1/kv_connector/unit and left out: test_mooncake_store_cache_prefix.py and
#   test_mooncake_store_lookup.py (Mooncake's store connector, no scheduler),
#   test_umbp_embedded.py and test_umbp_standalone.py (the UMBP connector, which kvblocks'
#   manager does not serve, and its native library).
_CORE_0_34 = (*_CORE_0_33, "tests/v1/core/test_prompt_block_hash_vectors.py")
_CONNECTORS_0_34 = tuple(f for f in _CONNECTORS_0_33 if f != _KV_CONNECTOR_LIFECYCLE)
_HASH_VECTORS = "rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json"


@dataclass(frozen=True)
class Release:
    version: str
    #: of ``vllm-<version>.tar.gz`` on PyPI
    sdist_sha256: str
    test_files: tuple[str, ...]
    #: the parts of kvblocks ported to this release: each must do work in the ``all`` run
    ported: tuple[str, ...]
    #: the expected-failures list, a file in this directory
    expected_name: str
    #: what of the sdist the tests read (never its ``vllm/``: see sdist.py)
    unpack: tuple[str, ...] = ("tests/", "pyproject.toml")
    #: the children tell vLLM's CPU platform that Triton is there while it checks a
    #: VllmConfig (kvblocks_suite_plugin.py, test only)
    cpu_triton_flag: bool = False

    @property
    def expected(self) -> Path:
        return HERE / self.expected_name


RELEASES = {
    r.version: r
    for r in (
        Release(
            version="0.33.0",
            sdist_sha256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
            test_files=(*_CORE_0_33, *_OFFLOADING, *_CONNECTORS_0_33),
            ported=(HASHER, MANAGER),
            expected_name="expected_failures.txt",
        ),
        Release(
            version="0.34.0",
            sdist_sha256="fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
            test_files=(*_CORE_0_34, *_OFFLOADING, *_CONNECTORS_0_34),
            ported=(HASHER, MANAGER),
            expected_name="expected_failures-0.34.0.txt",
            unpack=("tests/", "pyproject.toml", _HASH_VECTORS),
            # 0.34's CpuPlatform.check_and_update_config refuses x86 without Triton.
            cpu_triton_flag=True,
        ),
    )
}


def release(version: str) -> Release:
    try:
        return RELEASES[version]
    except KeyError:
        known = ", ".join(RELEASES)
        raise SystemExit(
            f"vllm_suite: no test selection for vLLM {version} (has {known})"
        ) from None


def vllm_version(root: Path | None) -> str:
    """The version of the vLLM in ``root`` (a ``pip install --target`` tree: its
    ``vllm-*.dist-info``), or of this Python's when ``root`` is None."""
    if root is None:
        try:
            return importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit("vllm_suite: this Python has no vllm (or give --vllm-root)") from None
    found = {d.version for d in importlib.metadata.distributions(name="vllm", path=[str(root)])}
    if len(found) != 1 or not (root / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"vllm_suite: {root} holds no single installed vllm (found {found})")
    return found.pop()


def work(tests: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """What each kvblocks part did in one run, from the plugin's per-test records: the
    schedulers built on kvblocks' manager, the request blocks kvblocks' hasher hashed."""
    tests = list(tests)
    return {
        MANAGER: sum(int(t.get("kvblocks", 0)) for t in tests),
        HASHER: sum(int(t.get("hashed", 0)) for t in tests),
    }


def activity_failures(
    ported: Iterable[str],
    off: Iterable[Mapping[str, Any]],
    all_: Iterable[Mapping[str, Any]],
) -> list[str]:
    """Why the runs do not show kvblocks exactly where it should be: any part at work in the
    ``off`` run, or a ported part that did no work in the ``all`` run."""
    failures = [f"the off run used kvblocks' {part} ({n})" for part, n in work(off).items() if n]
    done = work(all_)
    failures += [
        f"kvblocks' {part} did no work in the all run (it fell back): the run proves nothing"
        for part in ported
        if not done[part]
    ]
    return failures
