#!/usr/bin/env python3
"""The vLLM-suite tier: vLLM 0.33.0's own scheduler, prefix-caching and CPU-offloading tests,
run twice, with ``KVBLOCKS_VLLM=off`` and ``=all``, and compared.

    python .ci/vllm_suite/run.py            # from any directory; uses this Python

Fetches vLLM's sdist into ``.ci/cache/`` (once), writes the model configs the tests read,
runs pytest in a child process per mode (from the unpacked directory, so that ``tests`` is
vLLM's package), then checks that

- in the ``all`` run kvblocks' KV-cache manager was built for at least one scheduler;
- every test whose outcome differs between the runs is listed in ``expected_failures.txt``
  with a reason, and every listed test still differs.

``--write-expected`` rewrites the list (reasons kept, new entries without one, to be written
by hand). ``--probe`` reruns only the listed tests on kvblocks' manager with the vLLM internals
they read answered from kvblocks' pool (probe_internals.py), to tell internals reads from real
differences. Arguments after ``--`` go to both pytest runs (e.g. ``-- -k prefix``); with them,
or with test files named, listed tests that did not run are not called stale.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import models  # noqa: E402
import sdist  # noqa: E402

# vLLM's tests/v1/core files that build a scheduler, a KV-cache manager or request block
# hashes. Left out: prefix_cache/test_hybrid_prefix_cache_hit_rate.py (an OpenAI server on
# Qwen3.5-0.8B weights), test_reset_prefix_cache_e2e.py and test_scheduler_e2e.py (LLMEngine
# / LLM with model weights and a GPU), and the files that touch none of what kvblocks
# replaces: test_encoder_cache_manager, test_kv_cache_config_builder, test_kv_cache_metrics,
# test_kv_cache_planning, test_output, test_repetition_detection.
TEST_FILES = (
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
    # vLLM's CPU offloading (the OffloadingConnector) driven through the scheduler with a
    # fake worker side. (Its other test files build no scheduler: they drive the connector
    # with mocks of the manager's results.)
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
    # The scheduler with NIXL's connector (remote prefill and decode, the connector's
    # worker side mocked), vLLM's MultiConnector and DecodeBenchConnector, connector
    # lifecycles, failed and invalid loads. (test_nixl_connector*.py import `ray` and drive
    # NIXL's worker side, which needs the nixl library; the other connectors' files build
    # schedulers with connectors kvblocks does not serve, or none.)
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
)
MODES = ("off", "all")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=REPO / ".ci" / "cache")
    parser.add_argument("--sdist", type=Path, help="a local vllm-0.33.0.tar.gz (sha256-checked)")
    parser.add_argument("--expected", type=Path, default=HERE / "expected_failures.txt")
    parser.add_argument("--write-expected", action="store_true")
    parser.add_argument(
        "--jobs", type=int, choices=(1, 2), default=1, help="2: both runs at the same time"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="only rerun the listed tests with KVBLOCKS_VLLM=all under probe_internals.py",
    )
    parser.add_argument("files", nargs="*", help="test files (default: the tier's selection)")
    return parser.parse_args(argv), extra


def environment(mode: str, redirects: Path, cache: Path, report: Path) -> dict[str, str]:
    """The child pytest's environment: this checkout's kvblocks, the mode, no network."""
    env = dict(os.environ)
    # This checkout's kvblocks first; packages installed with `pip install --target
    # <cache>/deps -r requirements.txt` (for a shared environment one may not change) next.
    path = [str(REPO / "python"), str(HERE), str(cache / "deps"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        KVBLOCKS_VLLM=mode,
        KVBLOCKS_SUITE_REPORT=str(report),
        VLLM_TARGET_DEVICE="cpu",  # the PyPI wheel is a CUDA build
        VLLM_MODEL_REDIRECT_PATH=str(redirects),
        # No Hub: the configs come from models.py, anything else fails at once (instead of
        # after minutes of retries) and the same way on every machine.
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(cache / "hf-home"),
        VLLM_CACHE_ROOT=str(cache / "vllm-cache"),
    )
    return env


def start(
    mode: str, root: Path, files: list[str], extra: list[str], cache: Path, name: str = ""
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Starts one pytest run; returns the process, its report path and its log path."""
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report, log = logs / f"{name or mode}.json", logs / f"{name or mode}.log"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "kvblocks_suite_plugin"]
    command += ["-p", "no:cacheprovider", "-q", "--tb=short", "-rN", *files, *extra]
    env = environment(mode, cache / "models" / "redirect.json", cache, report)
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, report, log


def run_modes(
    root: Path, files: list[str], extra: list[str], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Runs pytest per mode (both at once with --jobs 2); returns mode -> plugin report."""
    reports: dict[str, dict[str, Any]] = {}
    pending = list(MODES)
    while pending:
        batch, pending = pending[: args.jobs], pending[args.jobs :]
        began = time.monotonic()
        running = {m: start(m, root, files, extra, args.cache) for m in batch}
        for mode, (process, report, log) in running.items():
            code = process.wait()
            seconds = time.monotonic() - began
            # 0: all passed, 1: some failed; anything else (usage error, crash) is the tier's
            if code not in (0, 1) or not report.exists():
                sys.exit(f"vllm_suite: pytest ({mode}) exited {code} without a report; see {log}")
            reports[mode] = json.loads(report.read_text())
            outcomes = Counter(t["outcome"] for t in reports[mode]["tests"].values())
            summary = ", ".join(f"{n} {o}" for o, n in outcomes.most_common())
            print(f"KVBLOCKS_VLLM={mode}: {summary} ({seconds:.0f} s; log {log})", flush=True)
    return reports


def print_schedulers(report: dict[str, Any]) -> int:
    """Prints where the ``all`` run's schedulers got their manager and why kvblocks handed
    work to vLLM's code; returns how many schedulers ran on kvblocks' manager."""
    tests = report["tests"].values()
    on_kvblocks = int(sum(t["kvblocks"] for t in tests))
    on_vllm = sum(t["vllm"] for t in tests)
    passed_on_kvblocks = sum(1 for t in tests if t["kvblocks"] and t["outcome"] in compare.OK)
    print(f"schedulers built: {on_kvblocks + on_vllm}")
    print(f"  on kvblocks' manager: {on_kvblocks}")
    print(f"  on vLLM's manager (kvblocks fell back): {on_vllm}")
    print(f"tests that passed with a scheduler on kvblocks' manager: {passed_on_kvblocks}")
    print("fallbacks to vLLM's code (count, part: reason; tests):")
    reasons: Counter[str] = Counter()
    tests_with: Counter[str] = Counter()
    for t in tests:
        reasons.update(t["fallbacks"])
        tests_with.update(t["fallbacks"].keys())
    for reason, count in reasons.most_common():
        print(f"  {count:5d}  {reason}; {tests_with[reason]} tests")
    return on_kvblocks


def report_comparison(
    result: compare.Comparison, off: dict[str, Any], all_: dict[str, Any]
) -> None:
    for nodeid in result.unlisted + result.reasonless:
        before, after = result.differing[nodeid]
        message = all_.get(nodeid, {}).get("message") or off.get(nodeid, {}).get("message", "")
        label = "NEW" if nodeid in result.unlisted else "NO REASON"
        print(f"{label}: {nodeid}: off {before}, all {after}: {message}")
    for nodeid in result.stale:
        print(f"STALE: {nodeid} is listed but behaves as stock now (or was not collected):")
        print("       remove it from expected_failures.txt")
    if result.unlisted or result.reasonless:
        print("\nEntries to add to expected_failures.txt (write the reason after '#'):")
        for nodeid in result.unlisted + result.reasonless:
            print(compare.entry_line(nodeid))
    if result.changed_message:
        print(f"\n{len(result.changed_message)} tests fail in both runs with different errors:")
        for nodeid in result.changed_message:
            print(f"  {nodeid}\n    off: {off[nodeid].get('message')}")
            print(f"    all: {all_[nodeid].get('message')}")


def probe(root: Path, expected: dict[str, str], args: argparse.Namespace) -> int:
    """Reruns the listed tests on kvblocks' manager with internals reads translated."""
    process, report, log = start(
        "all", root, sorted(expected), ["-p", "probe_internals"], args.cache, name="probe"
    )
    if process.wait() not in (0, 1) or not report.exists():
        sys.exit(f"vllm_suite: the probe run failed; see {log}")
    tests = json.loads(report.read_text())["tests"]
    for nodeid in sorted(expected):
        entry = tests.get(nodeid, {})
        print(f"{entry.get('outcome', 'missing'):8s} {nodeid}  {entry.get('message', '')}")
    return 0


def check_requirements(cache: Path) -> None:
    """Stops early, with the command to run, when a package of requirements.txt is missing
    (vLLM's conftest would otherwise fail inside both pytest runs)."""
    import importlib.util
    import re

    sys.path.append(str(cache / "deps"))
    for line in (HERE / "requirements.txt").read_text().splitlines():
        name = re.split(r"[\s=<>!~;\[]", line.strip(), maxsplit=1)[0]
        if name and not line.startswith("#") and importlib.util.find_spec(name) is None:
            sys.exit(
                f"vllm_suite: {name} is missing: pip install -r {HERE / 'requirements.txt'}"
                f" (or, into a shared environment one may not change, add --target {cache}/deps)"
            )


def main() -> int:
    args, extra = parse_args()
    check_requirements(args.cache)
    files = args.files or list(TEST_FILES)
    root = sdist.ensure_tests(args.cache, args.sdist)
    models.ensure_redirects(args.cache)
    expected = compare.read_expected(args.expected) if args.expected.exists() else {}
    if args.probe:
        return probe(root, expected, args)
    began = time.monotonic()
    reports = run_modes(root, files, extra, args)
    print(f"both runs: {time.monotonic() - began:.0f} s")
    print(f"kvblocks from {reports['all']['kvblocks']}")
    print(reports["all"]["status"].splitlines()[0])
    off, all_ = reports["off"]["tests"], reports["all"]["tests"]
    on_kvblocks = print_schedulers(reports["all"])
    if sum(t["kvblocks"] for t in off.values()):
        print("FAIL: the off run built schedulers on kvblocks' manager")
        return 1
    for mode, wrong in (("off", "kvblocks"), ("all", "vllm")):
        bindings = reports[mode]["hasher_bindings"]
        late = sorted(m for m, bound in bindings.items() if bound == wrong)
        if late:
            print(f"FAIL ({mode}): test modules bound {wrong}'s request block hasher: {late}")
            return 1
    bound = len(reports["all"]["hasher_bindings"])
    print(f"test modules that bound kvblocks' request block hasher: {bound}")
    result = compare.compare(off, all_, expected, complete=not extra and not args.files)
    listed = len(result.differing) - len(result.unlisted)
    print(f"differing from stock: {len(result.differing)} (listed {listed})")
    report_comparison(result, off, all_)
    if args.write_expected:
        old = args.expected.read_text().splitlines() if args.expected.exists() else []
        entries = compare.regenerated(expected, result, ran=off.keys() | all_.keys())
        lines = [line for line in old if line.startswith("#")] + entries
        args.expected.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.expected}: {len(entries)} entries")
    if on_kvblocks == 0:
        print("FAIL: kvblocks' KV-cache manager was never built: the run proves nothing")
        return 1
    if not result.ok:
        print("FAIL: outcomes differ from stock vLLM outside expected_failures.txt (see above)")
        return 1
    print("vllm_suite: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
