"""The ``kvblocks`` command line.

``kvblocks bench``  times block hashing in Rust against the pure-Python twin on a synthetic
                    workload and prints the speed-ups (the full suite is ``benches/``).
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
from kvblocks.workloads import random_prompt


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
        hasher = module.BlockHasher(algo, block_size=block_size, seed="bench")
        return lambda: hasher.hash_blocks(tokens)

    return make


def _decode(algo: str, block_size: int, tokens: list[int]) -> Workload:
    def make(module: Any) -> Callable[[], object]:
        hasher = module.BlockHasher(algo, block_size=block_size, seed="bench")

        def run() -> None:
            seq = module.TokenSequence(tokens[:16], hasher=hasher)
            for t in tokens[16:]:
                seq.append_token_ids(t)

        return run

    return make


def _twin() -> Any:
    try:
        import cbor2  # noqa: F401
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        return None
    import kvblocks.reference

    return kvblocks.reference


def bench(args: argparse.Namespace) -> int:
    twin = _twin()
    if twin is None:
        print("note: install kvblocks[reference] (cbor2, xxhash) to compare with the twin")
    cases: list[tuple[str, str, Workload]] = []
    for n in args.tokens:
        for algo in args.algo:
            tokens = random_prompt(n, seed=n)
            cases.append(
                (f"hash a {n:,}-token prompt", algo, _hash_prompt(algo, args.block_size, tokens))
            )
    decode_tokens = random_prompt(args.decode_tokens, seed=0)
    for algo in args.algo:
        workload = f"grow to {args.decode_tokens:,} tokens, 1 per call"
        cases.append((workload, algo, _decode(algo, args.block_size, decode_tokens)))

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

    b = sub.add_parser("bench", help="time block hashing, Rust vs the pure-Python twin")
    b.add_argument(
        "--tokens",
        type=_int_list,
        default=[1024, 8192, 32768],
        help="comma-separated prompt lengths (default: 1024,8192,32768)",
    )
    b.add_argument(
        "--algo",
        nargs="+",
        choices=kvblocks.HASH_ALGORITHMS,
        default=list(kvblocks.HASH_ALGORITHMS),
        help="hash algorithms (default: all)",
    )
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument(
        "--decode-tokens",
        type=int,
        default=4096,
        help="tokens appended one by one in the decode workload (default: 4096)",
    )
    b.add_argument("--repeat", type=int, default=9, help="timed runs per case (best is kept)")
    b.set_defaults(func=bench)

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
