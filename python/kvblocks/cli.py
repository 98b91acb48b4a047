"""The ``kvblocks`` command line.

``kvblocks bench``  generates on the embedded tiny model with the Rust and the Python block
                    manager and shows where the time goes (bookkeeping vs model);
                    ``--engine vllm`` runs vLLM 0.33's own scheduler with and without
                    kvblocks instead (needs kvblocks[vllm]).
``kvblocks bench-hashing``  times block hashing, Rust against the pure-Python twin.
``kvblocks hash``   prints the chained block hashes of a JSON list of token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import kvblocks
from kvblocks.workloads import (
    DECODE_LENGTH,
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


def _twin() -> Any:
    try:
        import cbor2  # noqa: F401
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        return None
    import kvblocks.reference

    return kvblocks.reference


def bench_hashing(args: argparse.Namespace) -> int:
    twin = _twin()
    if twin is None:
        print("note: install kvblocks[reference] (cbor2, xxhash) to compare with the twin")
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
        twin_s = None if twin is None else _best_time(make(twin), max(2, args.repeat // 3))
        rows.append((workload, algo, rust_s, twin_s))
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)

    print(
        f"kvblocks {kvblocks.__version__}: block hashing, block size {args.block_size}, "
        f"best of {args.repeat} runs (Rust) vs the pure-Python twin, same process\n"
    )
    header = f"{'workload':<36} {'algorithm':<12} {'Rust':>10} {'twin':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for workload, algo, rust_s, twin_s in rows:
        twin_cell = f"{twin_s * 1e3:8.2f}ms" if twin_s is not None else f"{'n/a':>10}"
        ratio = f"{twin_s / rust_s:8.1f}x" if twin_s is not None else f"{'':>9}"
        print(f"{workload:<36} {algo:<12} {rust_s * 1e3:8.3f}ms {twin_cell} {ratio}")
    print("\nFull suite with statistics: pytest benches/ (see the README).")
    return 0


def _bar(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        filled = 30 * done // max(total, 1)
        print(
            f"\r{label:<8} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def bench(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print("--plot needs matplotlib: pip install 'kvblocks[plot]'", file=sys.stderr)
            return 2
    if args.engine == "vllm":
        if args.model or args.device or args.dtype:
            print("--model, --device and --dtype apply to --engine kvblocks", file=sys.stderr)
            return 2
        return bench_vllm(args)
    _engine_defaults(args, num_requests=32, prefix_len=1024, suffix_len=64, hash_algo="sha256_cbor")
    try:
        import torch

        from kvblocks.engine import LLM, SamplingParams, parse_device
    except ModuleNotFoundError as e:  # torch is an optional extra
        print(f"kvblocks bench needs torch: pip install 'kvblocks[torch]' ({e})", file=sys.stderr)
        return 2
    from kvblocks.model import LlamaConfig, LlamaForCausalLM, load_pretrained

    device = parse_device(args.device or "cpu")
    dtype = getattr(torch, args.dtype or "float32")
    model: LlamaForCausalLM | None = None
    model_name = "embedded tiny model"
    vocab_size = LlamaConfig().vocab_size
    if args.model:
        model = load_pretrained(args.model, dtype=dtype, device=device)
        model_name, vocab_size = f"model {args.model}", model.config.vocab_size
    prompts = shared_prefix_prompts(
        args.num_requests, args.prefix_len, args.suffix_len, vocab_size=vocab_size
    )
    params = SamplingParams(max_tokens=args.output_len)
    backends = ["rust", "python"] if args.backend == "both" else [args.backend]
    rows = []
    for backend in backends:
        llm = LLM(
            model,
            backend=backend,
            block_size=args.block_size,
            hash_algo=args.hash_algo,
            max_num_seqs=args.max_num_seqs or 32,
            max_num_batched_tokens=4096,
            device=device,
            dtype=dtype,
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, progress=_bar(backend))
        wall = time.perf_counter() - start
        print(file=sys.stderr)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append((backend, wall, tokens, llm.stats))
    print(
        f"\nkvblocks {kvblocks.__version__}: {args.num_requests} requests, {args.prefix_len}-token "
        f"shared prefix + {args.suffix_len} own tokens, {args.output_len} output tokens, "
        f"block size {args.block_size}, {args.hash_algo}, {model_name} on {device}, "
        f"{str(dtype).removeprefix('torch.')} KV cache\n"
    )
    header = (
        f"{'backend':<8} {'requests/s':>10} {'out tok/s':>10} {'prefix hits':>11} "
        f"{'bookkeeping':>11} {'model':>7}"
    )
    print(header)
    print("-" * len(header))
    for backend, wall, tokens, stats in rows:
        print(
            f"{backend:<8} {args.num_requests / wall:>10.1f} {tokens / wall:>10.1f} "
            f"{stats.prefix_hit_rate:>10.1%} {stats.bookkeeping_share:>11.1%} "
            f"{1 - stats.bookkeeping_share:>7.1%}"
        )
    if len(rows) == 2:
        speedup = rows[1][3].bookkeeping_s / rows[0][3].bookkeeping_s
        print(
            f"\nRust speed-up on bookkeeping (hashing, block management, scheduling): "
            f"{speedup:.1f}x"
        )
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _engine_defaults(args: argparse.Namespace, **defaults: Any) -> None:
    """Fills the workload options the user left out with the engine's own defaults."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def bench_vllm(args: argparse.Namespace) -> int:
    """Stock vLLM 0.33 against vLLM with kvblocks, on vLLM's scheduler (fake model, CPU)."""
    _engine_defaults(args, num_requests=256, prefix_len=1500, suffix_len=500, hash_algo="sha256")
    from kvblocks.vllm import status
    from kvblocks.vllm.block_hasher import ALGORITHMS

    if args.hash_algo not in ALGORITHMS:
        print(f"vLLM has no hash algorithm {args.hash_algo!r}", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm

        from kvblocks.vllm.bench import IMPLS, compare
        from kvblocks.vllm.bench_driver import SchedulerSpec, Workload
    except ModuleNotFoundError as e:
        print(f"--engine vllm needs vllm: pip install 'kvblocks[vllm]' ({e})", file=sys.stderr)
        return 2
    workload = Workload(
        num_requests=args.num_requests,
        prompt_len=args.prefix_len + args.suffix_len,
        shared_len=args.prefix_len,
        output_len=args.output_len,
    )
    spec = SchedulerSpec(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        hash_algo=args.hash_algo,
        max_num_seqs=args.max_num_seqs or args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    with tqdm(total=len(IMPLS) * (args.rounds + 1), desc="vLLM scheduler", unit="run") as bar:
        result = compare(workload, spec, rounds=args.rounds, progress=lambda impl: bar.update())
    print(
        f"\nkvblocks {kvblocks.__version__} in vLLM {status().vllm_version}: {args.num_requests} "
        f"requests, {workload.prompt_len}-token prompts sharing {workload.shared_len}, "
        f"{args.output_len} output tokens, block size {args.block_size}, {args.num_blocks} "
        f"blocks, {args.hash_algo}; vLLM's V1 scheduler with a fake model on the CPU, median "
        f"of {args.rounds} runs\n"
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


def _plot(rows: list[Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r[0] for r in rows]
    book = [r[3].bookkeeping_s for r in rows]
    model = [r[3].model_s for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, model, label="model (forward + sampling)", color="#8fb3d9")
    ax.bar(names, book, bottom=model, label="bookkeeping (kvblocks)", color="#d95f5f")
    ax.set_ylabel("seconds")
    ax.set_title("kvblocks bench: where the time goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def hash_command(args: argparse.Namespace) -> int:
    source = sys.stdin if args.file == "-" else open(args.file)  # noqa: SIM115
    with source:
        tokens = json.load(source)
    hasher = kvblocks.BlockHasher(args.algo, block_size=args.block_size, seed=args.seed)
    lora = tuple(args.lora) if args.lora else None
    for h in hasher.hash_blocks(tokens, cache_salt=args.cache_salt, lora=lora):
        print(h.hex())
    return 0


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


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
        help="kvblocks: kvblocks.LLM, Rust vs the Python twin (default); vllm: vLLM 0.33's "
        "scheduler, stock vs with kvblocks (needs kvblocks[vllm])",
    )
    e.add_argument("--num-requests", type=int, help="default 32 (kvblocks), 256 (vllm)")
    e.add_argument(
        "--prefix-len", type=int, help="shared prompt prefix; default 1024 (kvblocks), 1500 (vllm)"
    )
    e.add_argument(
        "--suffix-len",
        type=int,
        help="each request's own tokens; default 64 (kvblocks), 500 (vllm)",
    )
    e.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument(
        "--hash-algo",
        choices=kvblocks.HASH_ALGORITHMS,
        help="default sha256_cbor (kvblocks), sha256 (vllm, its default)",
    )
    e.add_argument("--backend", choices=["both", "rust", "python"], default="both")
    e.add_argument("--max-num-seqs", type=int, help="default 32 (kvblocks), all requests (vllm)")
    e.add_argument("--num-blocks", type=int, default=8192, help="KV-cache blocks (vllm engine)")
    e.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget (vllm engine)"
    )
    e.add_argument("--rounds", type=int, default=3, help="timed runs per side (vllm engine)")
    e.add_argument("--plot", metavar="FILE.png", help="bar chart of the time breakdown")
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

    b = sub.add_parser("bench-hashing", help="time block hashing, Rust vs the pure-Python twin")
    b.add_argument(
        "--tokens",
        type=_int_list,
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
    b.add_argument("--block-size", type=int, default=HASHING_BLOCK_SIZE)
    b.add_argument(
        "--decode-tokens",
        type=int,
        default=DECODE_LENGTH,
        help="length the decode workload grows a sequence to, one token per call "
        "(default: %(default)s)",
    )
    b.add_argument("--repeat", type=int, default=9, help="timed runs per case (best is kept)")
    b.set_defaults(func=bench_hashing)

    h = sub.add_parser("hash", help="print the block hashes of a JSON list of token ids")
    h.add_argument("file", nargs="?", default="-", help="JSON file (default: stdin)")
    h.add_argument("--algo", choices=kvblocks.HASH_ALGORITHMS, default="sha256_cbor")
    h.add_argument("--block-size", type=int, default=16)
    h.add_argument("--seed", default=None, help="NONE_HASH seed (default: vLLM's rules)")
    h.add_argument("--cache-salt", default=None)
    h.add_argument("--lora", nargs=2, metavar=("NAME", "PATH"), default=None)
    h.set_defaults(func=hash_command)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"kvblocks: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
