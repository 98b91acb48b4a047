"""The ``kvblocks`` command line.

``kvblocks bench``  generates on the embedded tiny model with the Rust and the Python block
                    manager (warmed up, in alternating order, several rounds) and shows
                    where the time goes (bookkeeping vs model); ``--engine vllm`` runs
                    vLLM 0.33's own scheduler with and without kvblocks instead
                    (needs vLLM: pip install ".[vllm]" in a kvblocks checkout).
``kvblocks bench-hashing``  times block hashing, Rust against the pure-Python reference.
``kvblocks hash``   prints the chained block hashes of a JSON list of token ids.
``kvblocks route``  answers best-replica queries for a fleet of vLLM replicas over HTTP, from
                    their KV event streams (kvblocks.router; needs pip install "kvblocks[router]").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kvblocks
from kvblocks._install import install_hint
from kvblocks._signals import ReloadSignal, StopSignals, add_snapshot_arguments
from kvblocks.engine_bench import compare, round_orders
from kvblocks.engine_bench_report import plot, print_report
from kvblocks.workloads import (
    DECODE_LENGTH,
    DECODE_PROMPT_LENGTH,
    HASHING_BLOCK_SIZE,
    HASHING_PROMPT_LENGTHS,
    decode_workload,
    hashing_hasher,
    hashing_prompt,
    shared_prefix_prompts,
)


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


Workload = Callable[[Any], Callable[[], object]]


def _hash_prompt(algo: str, block_size: int, tokens: list[int]) -> Workload:
    def make(module: Any) -> Callable[[], object]:
        hasher = hashing_hasher(module, algo, block_size=block_size)
        return lambda: hasher.hash_blocks(tokens)

    return make


def _decode(algo: str, block_size: int, num_tokens: int) -> Workload:
    def make(module: Any) -> Callable[[], object]:
        hasher = hashing_hasher(module, algo, block_size=block_size)
        return decode_workload(module, hasher, num_tokens)

    return make


def _reference() -> Any:
    try:
        import cbor2  # noqa: F401
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        return None
    import kvblocks.reference

    return kvblocks.reference


def bench_hashing(args: argparse.Namespace) -> int:
    reference = _reference()
    if reference is None:
        hint = install_hint("reference")
        print(f"note: to compare with the reference, install cbor2 and xxhash: {hint}")
    cases: list[tuple[str, str, Workload]] = []
    for n in args.tokens:
        tokens = hashing_prompt(n)
        for algo in args.algo:
            cases.append(
                (f"hash a {n:,}-token prompt", algo, _hash_prompt(algo, args.block_size, tokens))
            )
    for algo in args.algo:
        workload = f"grow to {args.decode_tokens:,} tokens, 1 per call"
        cases.append((workload, algo, _decode(algo, args.block_size, args.decode_tokens)))

    rows: list[tuple[str, str, float, float | None]] = []
    for i, (workload, algo, make) in enumerate(cases, 1):
        print(
            f"\r[{i}/{len(cases)}] {workload}, {algo}" + " " * 10,
            end="",
            file=sys.stderr,
            flush=True,
        )
        rust_s = _best_time(make(kvblocks), args.repeat)
        reference_s = None
        if reference is not None:
            reference_s = _best_time(make(reference), max(2, args.repeat // 3))
        rows.append((workload, algo, rust_s, reference_s))
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)

    print(
        f"{_build()}: block hashing, block size {args.block_size}, "
        f"best of {args.repeat} runs (Rust) vs the pure-Python reference, same process\n"
    )
    header = f"{'workload':<36} {'algorithm':<12} {'Rust':>10} {'reference':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for workload, algo, rust_s, reference_s in rows:
        reference_cell, ratio = f"{'n/a':>10}", f"{'':>9}"
        if reference_s is not None:
            reference_cell, ratio = f"{reference_s * 1e3:8.2f}ms", f"{reference_s / rust_s:8.1f}x"
        print(f"{workload:<36} {algo:<12} {rust_s * 1e3:8.3f}ms {reference_cell} {ratio}")
    print("\nFull suite with statistics: pytest benches/ (see docs/benchmarks.md).")
    return 0


def _show_bar(label: str, done: int, total: int) -> None:
    filled = 30 * done // max(total, 1)
    print(
        f"\r{label:<22} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _bar(label: str) -> Callable[[int, int], None]:
    return lambda done, total: _show_bar(label, done, total)


def _clear_bar() -> None:
    print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)


#: The options only ``--engine kvblocks`` reads.
_KVBLOCKS_ENGINE_ONLY = ("backend", "model", "device", "dtype", "threads", "warmup")
#: The options only ``--engine vllm`` reads.
_VLLM_ENGINE_ONLY = (
    "layout",
    "no_enable_prefix_caching",
    "device_ms",
    "workload",
    "no_async_scheduling",
)
#: The options of vLLM's scheduler benchmark that ``--device-ms`` (vLLM's engine loop on its
#: own workloads, ``--workload``) does not read.
_SCHEDULER_ONLY = (
    "prefix_len",
    "suffix_len",
    "block_size",
    "hash_algo",
    "layout",
    "num_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "no_enable_prefix_caching",
    "plot",
)
#: ``--workload``'s choices, for ``kvblocks.vllm.bench.engine_loop.WORKLOADS``.
ENGINE_WORKLOADS = {"shared-prefix": "shared prefix", "chat": "chat"}
#: ``--layout``'s choices: the KV-cache layouts of ``kvblocks.vllm.bench.config.LAYOUTS``
#: (named here so that the parser needs no vLLM; the vLLM tier checks that they agree).
VLLM_LAYOUTS = ("llama", "gpt-oss", "gemma3", "llama4", "mla", "qwen3.5", "jamba")


def bench(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print(f"--plot needs matplotlib: {install_hint('plot')}", file=sys.stderr)
            return 2
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():  # found before the benchmark runs, not after
            print(f"--plot {args.plot}: there is no directory {folder}", file=sys.stderr)
            return 2
    other = "kvblocks" if args.engine == "vllm" else "vllm"
    names = _KVBLOCKS_ENGINE_ONLY if other == "kvblocks" else _VLLM_ENGINE_ONLY
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]
    if given:
        print(f"{', '.join(given)}: these options apply to --engine {other}", file=sys.stderr)
        return 2
    return bench_vllm(args) if args.engine == "vllm" else bench_engine(args)


@contextmanager
def _torch_threads(torch: Any, threads: int) -> Iterator[int]:
    """torch's intra-op thread count set to ``threads`` for the block; yields torch's own
    setting, which is put back afterwards (``main`` may run inside a caller's process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield before
    finally:
        torch.set_num_threads(before)


def bench_engine(args: argparse.Namespace) -> int:
    """``kvblocks.LLM`` with the Rust block manager against its pure-Python reference."""
    _engine_defaults(
        args,
        num_requests=32,
        prefix_len=1024,
        suffix_len=64,
        hash_algo="sha256_cbor",
        rounds=5,
        warmup=1,
        threads=DEFAULT_TORCH_THREADS,
        backend="both",
        num_blocks=KVBLOCKS_ENGINE_NUM_BLOCKS,
        max_num_batched_tokens=KVBLOCKS_ENGINE_MAX_NUM_BATCHED_TOKENS,
        block_size=16,
    )
    needs = _blocks_one_request_needs(args)
    if needs > args.num_blocks - 1:  # block 0 is the null block; arithmetic before any work
        raise ValueError(
            f"the pool cannot hold a single request: raise num_blocks (--num-blocks "
            f"{args.num_blocks}; one request needs up to {needs})"
        )
    try:
        import torch

        from kvblocks.engine import LLM, PoolTooSmall, SamplingParams, parse_device
    except ModuleNotFoundError as e:  # torch is an optional extra
        print(f"kvblocks bench needs torch ({e}): {install_hint('torch')}", file=sys.stderr)
        return 2
    from kvblocks.model import LlamaConfig, LlamaForCausalLM, load_pretrained

    with _torch_threads(torch, args.threads) as torch_default:
        device = parse_device(args.device or "cpu")
        dtype = getattr(torch, args.dtype or "float32")
        if args.model:
            model = load_pretrained(args.model, dtype=dtype, device=device)
            model_name = f"model {args.model}"
        else:  # what LLM(None) builds, once for every run
            model = LlamaForCausalLM.random(LlamaConfig(), seed=0, dtype=dtype, device=device)
            model_name = "embedded tiny model"
        prompts = shared_prefix_prompts(
            args.num_requests, args.prefix_len, args.suffix_len, vocab_size=model.config.vocab_size
        )

        def make_engine(backend: str) -> Any:
            return LLM(
                model,
                backend=backend,
                block_size=args.block_size,
                hash_algo=args.hash_algo,
                num_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs or 32,
                max_num_batched_tokens=args.max_num_batched_tokens,
                device=device,
                dtype=dtype,
            )

        backends = ["rust", "python"] if args.backend == "both" else [args.backend]
        try:
            result = compare(
                make_engine,
                prompts,
                SamplingParams(max_tokens=args.output_len),
                backends,
                rounds=args.rounds,
                warmup=args.warmup,
                progress=_show_bar,
            )
        except PoolTooSmall as e:
            raise RuntimeError(
                f"{e} (--num-blocks {args.num_blocks}; one request needs up to {needs})"
            ) from e
        finally:
            _clear_bar()
    if len(backends) == 2:
        order = "  ".join(",".join(b[0].upper() for b in o) for o in round_orders(backends, 4))
        rounds = f"{args.rounds} timed rounds, the order alternating ({order} ...)"
    else:
        rounds = f"{args.rounds} timed runs"
    print(
        f"{_build()}: {args.num_requests} requests, {args.prefix_len}-token "
        f"shared prefix + {args.suffix_len} own tokens, {args.output_len} output tokens, "
        f"block size {args.block_size}, {args.hash_algo}, {model_name} on {device}, "
        f"{str(dtype).removeprefix('torch.')} KV cache of {args.num_blocks} blocks\n"
        f"torch threads: {args.threads} (--threads; torch's default here: {torch_default}). "
        f"Per backend {args.warmup} untimed warm-up run(s), then {rounds}; "
        f"median [min-max] over the rounds.\n"
    )
    print_report(result)
    if args.plot:
        plot(result, args.plot)
    return 0


def _blocks_one_request_needs(args: argparse.Namespace) -> int:
    """The blocks of one full-attention group that a request of the workload needs at its
    longest: its prompt and every output token but the last (which is sampled, never fed)."""
    slots: int = args.prefix_len + args.suffix_len + args.output_len - 1
    block_size: int = args.block_size
    return -(-slots // block_size)


def _build() -> str:
    """``kvblocks 0.1.0 (release build)``, or a dev build and what to do about its timings."""
    from kvblocks import _core

    if _core.BUILD_PROFILE == "release":
        return f"kvblocks {kvblocks.__version__} (release build)"
    return (
        f"kvblocks {kvblocks.__version__} (dev build: its timings are not the release's; "
        "`pip install .` builds a release)"
    )


def _device_steps(text: str) -> list[float]:
    """``--device-ms``: comma-separated positive step times in milliseconds."""
    try:
        steps = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        steps = []
    if not steps or not all(0 < v < 1e6 for v in steps):
        raise argparse.ArgumentTypeError(f"positive milliseconds like 4,8,12, not {text!r}")
    return steps


def _engine_defaults(args: argparse.Namespace, **defaults: Any) -> None:
    """Fills the workload options the user left out with the engine's own defaults."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


#: How to install the vLLM that ``--engine vllm`` benchmarks (0.33 or 0.34, the releases
#: kvblocks' manager runs on).
VLLM_FOR_BENCH = 'pip install ".[vllm]" in a kvblocks checkout'
#: vLLM 0.34 refuses x86 CPUs without Triton's CPU backend (``triton-cpu``, not on PyPI):
#: what the benchmark, which runs vLLM's scheduler on the CPU platform, says there.
VLLM_NEEDS_TRITON = (
    "--engine vllm: this vLLM refuses x86 CPUs without Triton's CPU backend (triton-cpu, not "
    "on PyPI): run the benchmark where vLLM finds Triton (a machine with a GPU), or benchmark "
    'vLLM 0.33 here: pip install ".[vllm]" "vllm==0.33.0" in a kvblocks checkout'
)


def vllm_missing_message(error: ModuleNotFoundError) -> str:
    """What ``--engine vllm`` says when an import fails: vLLM itself is missing, or vLLM is
    there but one of its own dependencies is not (vLLM installed with ``--no-deps``)."""
    if error.name == "vllm":
        from kvblocks.vllm.versions import supported_range

        return (
            f"--engine vllm needs vllm{supported_range()}, which is not installed: {VLLM_FOR_BENCH}"
        )
    return (
        f"--engine vllm: vLLM is installed, but a module it imports is missing: {error.name!r} "
        f"({error}); install the package that provides it, or reinstall vLLM with its "
        f"dependencies ({install_hint('vllm')})"
    )


def _print_logs(lines: list[str], heading: str) -> None:
    if lines:
        print("\n".join([heading, *("  " + line for line in lines)]), file=sys.stderr)


def _manager_not_running() -> str | None:
    """Why kvblocks' KV-cache manager does not run on the installed vLLM (the benchmark compares
    it with vLLM's), from its fingerprints (a vLLM release it is not ported to yet, changed
    sources); None when it runs, or when vLLM cannot be found (importing it says why)."""
    import importlib.util

    import kvblocks.vllm._state as _state
    import kvblocks.vllm.fingerprints as fingerprints

    if importlib.util.find_spec("vllm") is None:
        return None
    stale = fingerprints.check().get("kv_cache_manager")
    if stale is None:
        return None
    reason, detail = stale
    return (
        f"--engine vllm: kvblocks' KV-cache manager does not run on this vLLM: "
        f"{_state.REASONS.get(reason, reason)} ({detail})"
    )


def bench_vllm(args: argparse.Namespace) -> int:
    """Stock vLLM against vLLM with kvblocks, on vLLM's scheduler (fake model, CPU), or with
    ``--device-ms`` on vLLM's whole engine-core loop and a modelled device."""
    engine_loop = args.device_ms is not None
    if engine_loop:
        given = [f"--{name.replace('_', '-')}" for name in _SCHEDULER_ONLY if getattr(args, name)]
        if given:
            print(
                f"{', '.join(given)}: these options apply to vLLM's scheduler benchmark, not to "
                "--device-ms (vLLM's engine loop on its own workloads: --workload)",
                file=sys.stderr,
            )
            return 2
        running = args.num_requests or 1024
    elif args.workload is not None or args.no_async_scheduling:
        print("--workload, --no-async-scheduling: these options need --device-ms", file=sys.stderr)
        return 2
    _engine_defaults(
        args,
        num_requests=256,
        prefix_len=1500,
        suffix_len=500,
        hash_algo="sha256",
        rounds=3,
        layout="llama",
        num_blocks=VLLM_ENGINE_NUM_BLOCKS,
        max_num_batched_tokens=VLLM_ENGINE_MAX_NUM_BATCHED_TOKENS,
    )
    from kvblocks.vllm import status
    from kvblocks.vllm.bench.logs import held_back, summary
    from kvblocks.vllm.block_hasher import ALGORITHMS
    from kvblocks.vllm.versions import installed_vllm_version, unsupported_vllm

    if args.hash_algo not in ALGORITHMS:
        print(f"vLLM has no hash algorithm {args.hash_algo!r}", file=sys.stderr)
        return 2
    version = installed_vllm_version()
    if version is not None and (refusal := unsupported_vllm(version)) is not None:
        # The driver builds vLLM's scheduler as the supported releases take it.
        print(f"--engine vllm: {refusal}", file=sys.stderr)
        return 2
    if (stale := _manager_not_running()) is not None:
        print(stale, file=sys.stderr)
        return 2
    if engine_loop:
        return bench_vllm_engine_loop(args, running)
    print("loading vLLM ...", file=sys.stderr, flush=True)
    # vLLM's imports and first configuration log their warnings here, once, before the bar.
    with held_back() as start_up:
        try:
            import vllm  # noqa: F401
            from vllm.config import CacheConfig

            from kvblocks.vllm.bench import (
                IMPLS,
                SchedulerSpec,
                Workload,
                compare,
                describe_layout,
                mamba_checkpoint_alignment_for,
                pool_blocks,
                prepare,
            )
            from kvblocks.vllm.bench.config import layout_groups
        except ModuleNotFoundError as e:
            print(vllm_missing_message(e), file=sys.stderr)
            return 2
        # The block size vLLM gives a model that does not ask for one.
        _engine_defaults(args, block_size=CacheConfig.DEFAULT_BLOCK_SIZE)
        needs = _blocks_one_request_needs(args)
        if any(kind in ("full", "mla") for kind, _ in layout_groups(args.layout)) and (
            needs > args.num_blocks - 1
        ):  # a full-attention group holds every block of a request (block 0: the null block)
            raise ValueError(
                f"the pool cannot hold a single request: --num-blocks {args.num_blocks} per "
                f"group; one request needs up to {needs} in a full-attention group"
            )
        workload = Workload(
            num_requests=args.num_requests,
            prompt_len=args.prefix_len + args.suffix_len,
            shared_len=args.prefix_len,
            output_len=args.output_len,
        )
        num_groups = len(layout_groups(args.layout))
        spec = SchedulerSpec(
            block_size=args.block_size,
            num_blocks=pool_blocks(args.num_blocks, args.layout),
            layout=args.layout,
            hash_algo=args.hash_algo,
            enable_caching=not args.no_enable_prefix_caching,
            mamba_checkpoint_alignment=mamba_checkpoint_alignment_for(args.layout, args.block_size),
            max_num_seqs=args.max_num_seqs or args.num_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        try:
            prepare(spec)
        except RuntimeError as e:
            if "requires Triton" not in str(e):
                raise
            print(VLLM_NEEDS_TRITON, file=sys.stderr)
            return 2
    _print_logs(summary(start_up), "vLLM's start-up said:")
    show, total, done = _bar("vLLM scheduler"), len(IMPLS) * (args.rounds + 1), [0]

    def progress(impl: str) -> None:
        done[0] += 1
        show(done[0], total)

    show(0, total)
    # vLLM rebuilds its configuration for every run and warns again each time.
    with held_back() as during:
        result = compare(workload, spec, rounds=args.rounds, progress=progress)
    _clear_bar()
    _print_logs(summary(during), "logged during the runs (each message once):")
    print(
        f"\n{_build()} in vLLM {status().vllm_version}: {args.num_requests} "
        f"requests, {workload.prompt_len}-token prompts sharing {workload.shared_len}, "
        f"{args.output_len} output tokens, block size {args.block_size}, "
        f"{args.hash_algo if spec.enable_caching else 'prefix caching off'}; "
        f"vLLM's V1 scheduler with a fake model on the CPU, median of {args.rounds} runs\n"
        f"KV-cache layout {args.layout}: {num_groups} group{'s' if num_groups > 1 else ''} "
        f"({describe_layout(args.layout)}), {spec.num_blocks} blocks "
        f"({args.num_blocks} per group)\n"
    )
    header = (
        f"{'vLLM':<16} {'scheduler CPU':>13} {'steps':>6} {'hashing at arrival':>19} "
        f"{'KV-cache manager':>17}"
    )
    print(header)
    print("-" * len(header))
    for impl, side in result.sides.items():
        name = "stock" if impl == "vllm" else "with kvblocks"
        print(
            f"{name:<16} {side.timings.scheduler * 1e3:>11.0f}ms {side.timings.steps:>6} "
            f"{side.hashing_share:>19.1%} {side.manager_share:>17.1%}"
        )
    stock, ours = result.sides["vllm"], result.sides["kvblocks"]
    print(f"\nscheduler-side CPU time (arrival + schedule + update): {result.speedup:.1f}x lower")
    for method in ("allocate_slots", "get_computed_blocks", "free"):
        before, after = stock.per_call(method), ours.per_call(method)
        if before and after and after > 0:
            print(f"  {method:<22} {before * 1e6:7.2f} us -> {after * 1e6:6.2f} us per call")
    print(
        "scheduler outputs: "
        + ("identical in every run" if result.identical else "DIFFERENT (please report)")
    )
    if args.plot:
        _plot_vllm(result, args.plot)
    return 0 if result.identical else 1


def bench_vllm_engine_loop(args: argparse.Namespace, running: int) -> int:
    """``--device-ms``: vLLM's engine-core loop, stock and with kvblocks, recorded on this
    machine and replayed against a device of each step time (docs/engine-loop.md)."""
    print("loading vLLM ...", file=sys.stderr, flush=True)
    from kvblocks.vllm.bench.logs import held_back, summary

    with held_back() as start_up:
        try:
            from kvblocks.vllm.bench.engine_loop import (
                IMPLS,
                compare_sides,
                markdown_table,
                sweep_rows,
                workload,
            )
            from kvblocks.vllm.bench.platform import select_cpu_platform

            select_cpu_platform()
        except ModuleNotFoundError as e:
            print(vllm_missing_message(e), file=sys.stderr)
            return 2
    _print_logs(summary(start_up), "vLLM's start-up said:")
    name = ENGINE_WORKLOADS[args.workload or "shared-prefix"]
    load = workload(name, running)
    async_scheduling = not args.no_async_scheduling
    show, total, done = _bar("vLLM engine loop"), len(IMPLS) * args.rounds, [0]

    def progress(impl: str) -> None:
        done[0] += 1
        show(done[0], total)

    show(0, total)
    with held_back() as during:
        try:
            recordings = compare_sides(load, async_scheduling, args.rounds, progress)
        except RuntimeError as e:
            _clear_bar()
            if "requires Triton" in str(e):
                print(VLLM_NEEDS_TRITON, file=sys.stderr)
                return 2
            print(f"--engine vllm: {e} (please report)", file=sys.stderr)
            return 1
    _clear_bar()
    _print_logs(summary(during), "logged during the runs (each message once):")
    rows = sweep_rows(name, load, async_scheduling, recordings, args.device_ms)
    print(
        f"\n{_build()}: vLLM's engine-core loop (EngineCore, "
        f"{'async scheduling' if async_scheduling else 'async scheduling off'}), "
        f"{running} running requests, workload {args.workload or 'shared-prefix'} "
        f"({load.prefix_len}-token shared prefix, {load.tail_len} tokens of each request's "
        f"own, {load.output_len} output tokens); the engine thread's CPU per call, median of "
        f"{args.rounds} runs per side, replayed against a device step of the given time plus "
        "1 us per scheduled token (docs/engine-loop.md)\n"
    )
    print(markdown_table(rows))
    print("\noutputs: identical token for token (stock vLLM and with kvblocks)")
    return 0


def _plot_vllm(result: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, hashing, manager, rest = [], [], [], []
    for impl, side in result.sides.items():
        total = side.timings.scheduler * 1e3
        names.append("stock vLLM" if impl == "vllm" else "vLLM + kvblocks")
        hashing.append(total * side.hashing_share)
        manager.append(total * side.manager_share)
        rest.append(total * (1 - side.hashing_share - side.manager_share))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, rest, label="rest of the scheduler", color="#8fb3d9")
    ax.bar(names, manager, bottom=rest, label="KV-cache manager", color="#d95f5f")
    bottom = [r + m for r, m in zip(rest, manager, strict=True)]
    ax.bar(names, hashing, bottom=bottom, label="block hashing at arrival", color="#f0b05a")
    ax.set_ylabel("scheduler-side CPU time (ms)")
    ax.set_title(f"vLLM scheduler: {result.speedup:.1f}x less CPU time with kvblocks")
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False, fontsize="small"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot written to {path}")


def route_command(args: argparse.Namespace) -> int:
    """Serves ``kvblocks.router.scorer`` until SIGTERM or SIGINT (status 0 whenever either
    arrives, from here to exit: ``kvblocks._signals``), reading the fleet file again when it
    changes or on SIGHUP."""
    stop = StopSignals()
    hup = ReloadSignal()
    try:
        from kvblocks.router.fleet import FleetFile, follow_fleet_file
        from kvblocks.router.scorer import report_restored, serve
    except ImportError as error:  # pyzmq or msgspec missing
        raise ImportError(f"{error}; {install_hint('router')}") from None
    fleet_file = FleetFile(args.fleet)
    fleet = fleet_file.load()
    if stop.received is not None:  # stopped while starting: nothing to serve
        stop.wait()
        return 0
    serving = serve(
        fleet,
        args.host,
        args.port,
        snapshot=args.snapshot,
        snapshot_interval=args.snapshot_interval,
    )
    with serving as running:
        report_restored(running.restored, running.snapshot, "kvblocks route")
        print(
            f"kvblocks route: {len(fleet.replicas)} replicas, serving on {running.url} "
            "(POST /score, GET /replicas, GET /health)",
            flush=True,
        )
        # The fleet file read again on a change or SIGHUP, until a stop signal; then feeds
        # and sockets close as the block ends.
        follow_fleet_file(fleet_file, stop, hup, running.service.reload, "kvblocks route")
    return 0


def hash_command(args: argparse.Namespace) -> int:
    source = sys.stdin if args.file == "-" else open(args.file)  # noqa: SIM115
    name = "stdin" if args.file == "-" else args.file
    with source:
        try:
            tokens = json.load(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must hold a JSON list of token ids ({e})") from None
    if not isinstance(tokens, list):
        kind = type(tokens).__name__
        raise ValueError(f"{name} must hold a JSON list of token ids, not a {kind}")
    if len(tokens) < args.block_size:
        print(
            f"kvblocks hash: {len(tokens)} tokens make no full {args.block_size}-token block: "
            "no block hash (vLLM hashes full blocks only)",
            file=sys.stderr,
        )
    hasher = kvblocks.BlockHasher(args.algo, block_size=args.block_size, seed=args.seed)
    lora = tuple(args.lora) if args.lora else None
    for h in hasher.hash_blocks(tokens, cache_salt=args.cache_salt, lora=lora):
        print(h.hex())
    return 0


def _int_at_least(minimum: int, name: str) -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``minimum``, or argparse's usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = name
    return parse


positive_int = _int_at_least(1, "positive_int")
non_negative_int = _int_at_least(0, "non_negative_int")


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive ints (argparse ``type``)."""
    values = [positive_int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers")
    return values


#: ``kvblocks bench --threads``' default. The embedded model's matrices are small (hidden
#: size 64), so torch's extra threads have little to split and, where the cores are busy, wait
#: on each other: on a shared 2-core machine torch's default (2 threads) made the default bench
#: 2.5 to 10 times slower than 1 thread, and Rust slower end to end than the reference
#: (0.64x [0.51x-0.89x]) while its bookkeeping was 11x faster.
DEFAULT_TORCH_THREADS = 1

#: ``kvblocks bench``'s pool and per-step token budget: ``kvblocks.LLM``'s default pool and
#: a 4,096-token budget for the kvblocks engine; vLLM's scheduler gets 8,192 of each (blocks
#: per KV-cache group).
KVBLOCKS_ENGINE_NUM_BLOCKS = 4096
KVBLOCKS_ENGINE_MAX_NUM_BATCHED_TOKENS = 4096
VLLM_ENGINE_NUM_BLOCKS = 8192
VLLM_ENGINE_MAX_NUM_BATCHED_TOKENS = 8192


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kvblocks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    top.add_argument("--version", action="version", version=f"kvblocks {kvblocks.__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    e = sub.add_parser(
        "bench", help="generate on the embedded tiny model with both backends; time breakdown"
    )
    e.add_argument(
        "--engine",
        choices=["kvblocks", "vllm"],
        default="kvblocks",
        help="kvblocks: kvblocks.LLM, Rust vs the Python reference (default); vllm: vLLM's "
        f"scheduler, stock vs with kvblocks (needs vLLM 0.33 or 0.34: {VLLM_FOR_BENCH})",
    )
    e.add_argument("--num-requests", type=positive_int, help="default 32 (kvblocks), 256 (vllm)")
    e.add_argument(
        "--prefix-len",
        type=non_negative_int,
        help="shared prompt prefix; default 1024 (kvblocks), 1500 (vllm)",
    )
    e.add_argument(
        "--suffix-len",
        type=non_negative_int,
        help="each request's own tokens; default 64 (kvblocks), 500 (vllm)",
    )
    e.add_argument(
        "--output-len", type=positive_int, default=32, help="tokens generated per request"
    )
    e.add_argument(
        "--block-size",
        type=positive_int,
        help="default 16 (kvblocks), vLLM's own default block size (vllm: 16 on 0.33, 64 on 0.34)",
    )
    e.add_argument(
        "--hash-algo",
        choices=kvblocks.HASH_ALGORITHMS,
        help="default sha256_cbor (kvblocks), sha256 (vllm, its default)",
    )
    e.add_argument(
        "--backend",
        choices=["both", "rust", "python"],
        help="block manager(s) to run (kvblocks engine; default both)",
    )
    e.add_argument(
        "--max-num-seqs", type=positive_int, help="default 32 (kvblocks), all requests (vllm)"
    )
    e.add_argument(
        "--num-blocks",
        type=positive_int,
        help=f"KV-cache blocks: the pool (kvblocks engine, default {KVBLOCKS_ENGINE_NUM_BLOCKS}),"
        f" or per KV-cache group (vllm engine, default {VLLM_ENGINE_NUM_BLOCKS}; the groups "
        "share one pool of this many times the number of groups)",
    )
    e.add_argument(
        "--layout",
        choices=VLLM_LAYOUTS,
        help="KV-cache layout (vllm engine): llama (one full-attention group, the default), "
        "gpt-oss (full + 128-token sliding window), gemma3 (5 sliding-window 1024 : 1 full), "
        "llama4 (chunked local 8192 + full), mla (one MLA group), qwen3.5 (full + 3 Mamba/linear "
        "attention), jamba (full + 7 Mamba)",
    )
    e.add_argument(
        "--no-enable-prefix-caching",
        action="store_true",
        default=None,
        help="vllm engine: prefix caching off (vLLM's flag; on by default, as in vLLM)",
    )
    e.add_argument(
        "--device-ms",
        type=_device_steps,
        metavar="MS[,MS...]",
        help="vllm engine: run vLLM's whole engine-core loop (async scheduling, output "
        "encoding) instead of its scheduler alone, and replay it against a device step of each "
        "of these times (plus 1 us per token): tokens/s, device idle, TTFT, ITL; "
        "--num-requests running requests (default 1024)",
    )
    e.add_argument(
        "--workload",
        choices=list(ENGINE_WORKLOADS),
        help="with --device-ms: shared-prefix (512-token shared prefix, 64 of each request's "
        "own, 64 out; the default) or chat (256 shared, 768 own, 128 out)",
    )
    e.add_argument(
        "--no-async-scheduling",
        action="store_true",
        default=None,
        help="with --device-ms: vLLM's async scheduling off (on by default, as in vLLM)",
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        help="tokens scheduled per step; default "
        f"{KVBLOCKS_ENGINE_MAX_NUM_BATCHED_TOKENS} (kvblocks), "
        f"{VLLM_ENGINE_MAX_NUM_BATCHED_TOKENS} (vllm)",
    )
    e.add_argument(
        "--rounds",
        type=positive_int,
        help="timed runs per backend; the kvblocks engine alternates which backend goes first "
        "(default 5), the vllm engine reports the median (default 3)",
    )
    e.add_argument(
        "--warmup",
        type=non_negative_int,
        help="untimed runs per backend before the timed rounds (kvblocks engine; default 1)",
    )
    e.add_argument(
        "--threads",
        type=positive_int,
        help=f"torch intra-op threads (kvblocks engine; default {DEFAULT_TORCH_THREADS}: the "
        "embedded model is too small to gain from more, and threads beyond the free cores "
        "wait on each other; raise it for a large --model on the CPU)",
    )
    e.add_argument(
        "--plot",
        metavar="FILE.png",
        help="bar chart: bookkeeping and end-to-end time per run, on separate axes",
    )
    e.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face directory (config.json + *.safetensors; Llama, Qwen2, "
        "Mistral) instead of the embedded tiny model (kvblocks engine)",
    )
    e.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default cpu)")
    e.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache dtype (default float32)",
    )
    e.set_defaults(func=bench)

    b = sub.add_parser(
        "bench-hashing", help="time block hashing, Rust vs the pure-Python reference"
    )
    b.add_argument(
        "--tokens",
        type=positive_int_list,
        default=list(HASHING_PROMPT_LENGTHS),
        help="comma-separated prompt lengths (default: "
        + ",".join(map(str, HASHING_PROMPT_LENGTHS))
        + ")",
    )
    b.add_argument(
        "--algo",
        nargs="+",
        choices=kvblocks.HASH_ALGORITHMS,
        default=list(kvblocks.HASH_ALGORITHMS),
        help="hash algorithms (default: all)",
    )
    b.add_argument("--block-size", type=positive_int, default=HASHING_BLOCK_SIZE)
    b.add_argument(
        "--decode-tokens",
        type=_int_at_least(DECODE_PROMPT_LENGTH, f"int >= {DECODE_PROMPT_LENGTH}"),
        default=DECODE_LENGTH,
        help="length the decode workload grows a sequence to, one token per call "
        "(default: %(default)s)",
    )
    b.add_argument(
        "--repeat", type=positive_int, default=9, help="timed runs per case (best is kept)"
    )
    b.set_defaults(func=bench_hashing)

    h = sub.add_parser("hash", help="print the block hashes of a JSON list of token ids")
    h.add_argument("file", nargs="?", default="-", help="JSON file (default: stdin)")
    h.add_argument("--algo", choices=kvblocks.HASH_ALGORITHMS, default="sha256_cbor")
    h.add_argument("--block-size", type=positive_int, default=16)
    h.add_argument("--seed", default=None, help="NONE_HASH seed (default: vLLM's rules)")
    h.add_argument("--cache-salt", default=None)
    h.add_argument("--lora", nargs=2, metavar=("NAME", "PATH"), default=None)
    h.set_defaults(func=hash_command)

    r = sub.add_parser(
        "route", help="answer best-replica queries for a fleet of vLLM replicas over HTTP"
    )
    r.add_argument("fleet", help="the fleet's JSON file (see kvblocks.router.fleet)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8100)
    add_snapshot_arguments(r)
    r.set_defaults(func=route_command)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.func is bench and args.prefix_len == 0 and args.suffix_len == 0:
        top.error("--prefix-len and --suffix-len are both 0: a prompt needs at least one token")
    try:
        code: int = args.func(args)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as e:
        print(f"kvblocks: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
