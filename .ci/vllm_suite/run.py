#!/usr/bin/env python3
"""The vLLM-suite tier: a vLLM release's own scheduler, prefix-caching and CPU-offloading
tests, run twice, with ``KVBLOCKS_VLLM=off`` and ``=all``, and compared.

    python .ci/vllm_suite/run.py            # this Python's vLLM (0.33.0); from any directory
    python .ci/vllm_suite/run.py --vllm-root .ci/cache/vllm-0.34.0   # a `pip install
                                            # --no-deps --target` tree of another release

The release is the version of the vLLM under test; releases.py holds, per release, its sdist,
the test files, its expected-failures list and the kvblocks parts ported to it. Fetches the
release's sdist into ``.ci/cache/`` (once), writes the model configs the tests read, runs
pytest in a child process per mode (from the unpacked directory, so that ``tests`` is vLLM's
package; with ``--vllm-root``, that tree first on its path), then checks that

- the children ran the release's vLLM;
- each kvblocks part ported to the release did work in the ``all`` run (0.33: schedulers on
  kvblocks' KV-cache manager and request blocks hashed by kvblocks' hasher; 0.34: the hasher),
  and none did in the ``off`` run;
- every test whose outcome differs between the runs is listed in the release's
  expected-failures list with a reason, and every listed test still differs.

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
import releases  # noqa: E402
import sdist  # noqa: E402
from releases import Release  # noqa: E402

MODES = ("off", "all")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-root",
        type=Path,
        help="a directory holding a vLLM release's vllm/ and its dist-info (pip install"
        " --no-deps --target DIR vllm==X), first on the tests' path (default: this Python's)",
    )
    parser.add_argument("--cache", type=Path, default=REPO / ".ci" / "cache")
    parser.add_argument("--sdist", type=Path, help="a local vllm-X.tar.gz (sha256-checked)")
    parser.add_argument("--expected", type=Path, help="default: the release's list (releases.py)")
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


def environment(
    mode: str, redirects: Path, cache: Path, report: Path, release: Release, vllm_root: Path | None
) -> dict[str, str]:
    """The child pytest's environment: the vLLM under test, this checkout's kvblocks, the
    mode, no network."""
    env = dict(os.environ)
    # The vLLM tree under test first, this checkout's kvblocks next; packages installed with
    # `pip install --target <cache>/deps -r requirements.txt` (for a shared environment one
    # may not change) after them.
    path = [str(REPO / "python"), str(HERE), str(cache / "deps"), env.get("PYTHONPATH", "")]
    if vllm_root is not None:
        path.insert(0, str(vllm_root.resolve()))
    env.pop("KVBLOCKS_SUITE_CPU_TRITON", None)
    if release.cpu_triton_flag:
        env["KVBLOCKS_SUITE_CPU_TRITON"] = "1"
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
    mode: str,
    root: Path,
    files: list[str],
    extra: list[str],
    args: argparse.Namespace,
    release: Release,
    name: str = "",
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Starts one pytest run; returns the process, its report path and its log path."""
    logs = args.cache / "logs" / f"vllm-{release.version}"
    logs.mkdir(parents=True, exist_ok=True)
    report, log = logs / f"{name or mode}.json", logs / f"{name or mode}.log"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "kvblocks_suite_plugin"]
    command += ["-p", "no:cacheprovider", "-q", "--tb=short", "-rN", *files, *extra]
    redirects = args.cache / "models" / "redirect.json"
    env = environment(mode, redirects, args.cache, report, release, args.vllm_root)
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, report, log


def run_modes(
    root: Path, files: list[str], extra: list[str], args: argparse.Namespace, release: Release
) -> dict[str, dict[str, Any]]:
    """Runs pytest per mode (both at once with --jobs 2); returns mode -> plugin report."""
    reports: dict[str, dict[str, Any]] = {}
    pending = list(MODES)
    while pending:
        batch, pending = pending[: args.jobs], pending[args.jobs :]
        began = time.monotonic()
        running = {m: start(m, root, files, extra, args, release) for m in batch}
        for mode, (process, report, log) in running.items():
            code = process.wait()
            seconds = time.monotonic() - began
            # 0: all passed, 1: some failed; anything else (usage error, crash) is the tier's
            if code not in (0, 1) or not report.exists():
                sys.exit(f"vllm_suite: pytest ({mode}) exited {code} without a report; see {log}")
            reports[mode] = json.loads(report.read_text())
            ran = reports[mode]["vllm"]
            if ran["version"] != release.version:
                sys.exit(f"vllm_suite: pytest ({mode}) ran vLLM {ran['version']} ({ran['file']})")
            outcomes = Counter(t["outcome"] for t in reports[mode]["tests"].values())
            summary = ", ".join(f"{n} {o}" for o, n in outcomes.most_common())
            print(f"KVBLOCKS_VLLM={mode}: {summary} ({seconds:.0f} s; log {log})", flush=True)
    return reports


def print_schedulers(report: dict[str, Any]) -> None:
    """Prints where the ``all`` run's schedulers got their manager, what kvblocks' hasher
    hashed, and why kvblocks handed work to vLLM's code."""
    tests = report["tests"].values()
    on_kvblocks = int(sum(t["kvblocks"] for t in tests))
    on_vllm = sum(t["vllm"] for t in tests)
    passed_on_kvblocks = sum(1 for t in tests if t["kvblocks"] and t["outcome"] in compare.OK)
    print(f"schedulers built: {on_kvblocks + on_vllm}")
    print(f"  on kvblocks' manager: {on_kvblocks}")
    print(f"  on vLLM's manager (kvblocks fell back): {on_vllm}")
    print(f"tests that passed with a scheduler on kvblocks' manager: {passed_on_kvblocks}")
    hashed = [t["hashed"] for t in tests if t["hashed"]]
    print(f"request blocks hashed by kvblocks' hasher: {sum(hashed)} (in {len(hashed)} tests)")
    print("fallbacks to vLLM's code (count, part: reason; tests):")
    reasons: Counter[str] = Counter()
    tests_with: Counter[str] = Counter()
    for t in tests:
        reasons.update(t["fallbacks"])
        tests_with.update(t["fallbacks"].keys())
    for reason, count in reasons.most_common():
        print(f"  {count:5d}  {reason}; {tests_with[reason]} tests")


def report_comparison(
    result: compare.Comparison, off: dict[str, Any], all_: dict[str, Any], expected: Path
) -> None:
    for nodeid in result.unlisted + result.reasonless:
        before, after = result.differing[nodeid]
        message = all_.get(nodeid, {}).get("message") or off.get(nodeid, {}).get("message", "")
        label = "NEW" if nodeid in result.unlisted else "NO REASON"
        print(f"{label}: {nodeid}: off {before}, all {after}: {message}")
    for nodeid in result.stale:
        print(f"STALE: {nodeid} is listed but behaves as stock now (or was not collected):")
        print(f"       remove it from {expected.name}")
    if result.unlisted or result.reasonless:
        print(f"\nEntries to add to {expected.name} (write the reason after '#'):")
        for nodeid in result.unlisted + result.reasonless:
            print(compare.entry_line(nodeid))
    if result.changed_message:
        print(f"\n{len(result.changed_message)} tests fail in both runs with different errors:")
        for nodeid in result.changed_message:
            print(f"  {nodeid}\n    off: {off[nodeid].get('message')}")
            print(f"    all: {all_[nodeid].get('message')}")


def probe(root: Path, expected: dict[str, str], args: argparse.Namespace, release: Release) -> int:
    """Reruns the listed tests on kvblocks' manager with internals reads translated."""
    if not expected:
        print("vllm_suite: no listed test to probe")
        return 0
    probe_plugin = ["-p", "probe_internals"]
    process, report, log = start(
        "all", root, sorted(expected), probe_plugin, args, release, name="probe"
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
    release = releases.release(releases.vllm_version(args.vllm_root))
    expected_path = args.expected or release.expected
    check_requirements(args.cache)
    files = args.files or list(release.test_files)
    root = sdist.ensure_tests(args.cache, release, args.sdist)
    models.ensure_redirects(args.cache)
    expected = compare.read_expected(expected_path) if expected_path.exists() else {}
    if args.probe:
        return probe(root, expected, args, release)
    print(f"vLLM {release.version}'s tests ({root}), kvblocks ported there: {release.ported}")
    began = time.monotonic()
    reports = run_modes(root, files, extra, args, release)
    print(f"both runs: {time.monotonic() - began:.0f} s")
    print(f"vLLM from {reports['all']['vllm']['file']}")
    print(f"kvblocks from {reports['all']['kvblocks']}")
    print(reports["all"]["status"].splitlines()[0])
    off, all_ = reports["off"]["tests"], reports["all"]["tests"]
    print_schedulers(reports["all"])
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
    report_comparison(result, off, all_, expected_path)
    if args.write_expected:
        old = expected_path.read_text().splitlines() if expected_path.exists() else []
        entries = compare.regenerated(expected, result, ran=off.keys() | all_.keys())
        lines = [line for line in old if line.startswith("#")] + entries
        expected_path.write_text("\n".join(lines) + "\n")
        print(f"wrote {expected_path}: {len(entries)} entries")
    inactive = releases.activity_failures(release.ported, off.values(), all_.values())
    for failure in inactive:
        print(f"FAIL: {failure}")
    if inactive:
        return 1
    if not result.ok:
        print(f"FAIL: outcomes differ from stock vLLM outside {expected_path.name} (see above)")
        return 1
    print("vllm_suite: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
