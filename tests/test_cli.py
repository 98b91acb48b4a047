"""The ``kvblocks`` command line: which function runs each command, ``bench-hashing``'s
workload (the one ``benches/bench_hashing.py`` measures, both from ``kvblocks.workloads``),
``bench``'s fair comparison (warm-up, alternating order, medians and spreads, torch threads),
the checks of numeric arguments, the install hints, and the vLLM engine's logs."""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kvblocks
from kvblocks import cli
from kvblocks.engine_bench import Comparison, Run, Spread, compare, round_orders
from kvblocks.vllm.bench.logs import held_back, summary
from kvblocks.workloads import (
    DECODE_LENGTH,
    DECODE_PROMPT_LENGTH,
    HASHER_SEED,
    HASHING_BLOCK_SIZE,
    HASHING_PROMPT_LENGTHS,
    hashing_prompt,
    random_prompt,
)


@pytest.mark.parametrize(
    ("argv", "func"),
    [
        (["bench"], "bench"),
        (["bench-hashing"], "bench_hashing"),
        (["hash"], "hash_command"),
    ],
)
def test_each_command_runs_the_function_of_its_name(argv: list[str], func: str) -> None:
    args = cli.parser().parse_args(argv)
    assert args.func is getattr(cli, func)
    assert args.func.__name__ == func


class _Recorder:
    """Stands in for ``kvblocks`` in ``bench-hashing``: records what the CLI hashes."""

    def __init__(self) -> None:
        self.hashers: list[tuple[str, int | None, str | None]] = []
        self.prompts: list[tuple[str, list[int]]] = []
        self.decodes: list[tuple[str, list[int]]] = []
        recorder = self

        class BlockHasher:
            def __init__(
                self, algo: str, *, block_size: int | None = None, seed: str | None = None
            ) -> None:
                self.algo = algo
                recorder.hashers.append((algo, block_size, seed))

            def hash_blocks(self, tokens: list[int]) -> list[bytes]:
                recorder.prompts.append((self.algo, list(tokens)))
                return []

        class TokenSequence:
            def __init__(self, prompt: list[int], *, hasher: BlockHasher) -> None:
                self.tokens = list(prompt)
                assert len(self.tokens) == DECODE_PROMPT_LENGTH
                recorder.decodes.append((hasher.algo, self.tokens))

            def append_token_ids(self, token: int) -> None:
                self.tokens.append(token)

        self.BlockHasher = BlockHasher
        self.TokenSequence = TokenSequence


def test_bench_hashing_defaults_are_the_benchmark_workload(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no workload options, ``kvblocks bench-hashing`` hashes the prompts and runs the
    decode workload that ``benches/bench_hashing.py`` does: the same lengths, the same tokens,
    the same block size and hasher seed."""
    recorder = _Recorder()
    monkeypatch.setattr(kvblocks, "BlockHasher", recorder.BlockHasher)
    monkeypatch.setattr(kvblocks, "TokenSequence", recorder.TokenSequence)
    monkeypatch.setattr(cli, "_reference", lambda: None)
    algos = ["sha256_cbor", "xxh3_128"]
    assert cli.main(["bench-hashing", "--algo", *algos, "--repeat", "1"]) == 0
    assert "hash a 32,768-token prompt" in capsys.readouterr().out

    assert set(recorder.hashers) == {(algo, HASHING_BLOCK_SIZE, HASHER_SEED) for algo in algos}
    expected_prompts = [(a, hashing_prompt(n)) for n in HASHING_PROMPT_LENGTHS for a in algos]
    assert recorder.prompts == expected_prompts
    assert recorder.decodes == [(a, hashing_prompt(DECODE_LENGTH)) for a in algos]
    # One seed rule whatever the length: not the seed=n the CLI once used for prompts.
    assert hashing_prompt(1024) == random_prompt(1024, seed=0)
    assert hashing_prompt(1024) != random_prompt(1024, seed=1024)


def test_bench_hashing_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(kvblocks, "BlockHasher", recorder.BlockHasher)
    monkeypatch.setattr(kvblocks, "TokenSequence", recorder.TokenSequence)
    monkeypatch.setattr(cli, "_reference", lambda: None)
    argv = ["bench-hashing", "--tokens", "40,100", "--algo", "sha256", "--block-size", "8"]
    argv += ["--decode-tokens", "50", "--repeat", "2"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert set(recorder.hashers) == {("sha256", 8, HASHER_SEED)}
    assert recorder.prompts == [("sha256", hashing_prompt(n)) for n in (40, 100) for _ in (0, 1)]
    assert recorder.decodes == [("sha256", hashing_prompt(50))] * 2


def test_bench_hashing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A small real run, Rust against the reference."""
    argv = ["bench-hashing", "--tokens", "64,256", "--algo", "sha256_cbor", "xxh3_128"]
    assert cli.main([*argv, "--decode-tokens", "64", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "block hashing, block size 16" in out
    for row in ("hash a 64-token prompt", "hash a 256-token prompt", "grow to 64 tokens"):
        assert row in out
    assert out.count("x\n") == 6  # a speed-up over the reference on every row


# kvblocks bench: a fair comparison of the Rust block manager and its reference.


@dataclass
class _FakeOutput:
    outputs: list[Any]


class _FakeEngine:
    """Stands in for ``kvblocks.LLM``: each engine is numbered in the order it was built, and
    its run's bookkeeping and model seconds say which engine it was."""

    def __init__(self, log: list[tuple[int, str]], backend: str) -> None:
        self.number = len(log)
        self.backend = backend
        log.append((self.number, backend))
        self.stats = SimpleNamespace(bookkeeping_s=0.0, model_s=0.0)
        self.runs = 0

    def generate(self, prompts: list[list[int]], params: int) -> list[_FakeOutput]:
        """``params`` here is the number of tokens each request generates."""
        self.runs += 1
        self.stats.bookkeeping_s = float(self.number)
        self.stats.model_s = 100.0
        completion = SimpleNamespace(token_ids=[0] * params)
        return [_FakeOutput([completion]) for _ in prompts]


def test_bench_alternates_the_order_and_does_not_count_warm_up_runs() -> None:
    log: list[tuple[int, str]] = []
    engines: list[_FakeEngine] = []

    def make(backend: str) -> _FakeEngine:
        engines.append(_FakeEngine(log, backend))
        return engines[-1]

    labels: list[tuple[str, int, int]] = []
    result = compare(
        make,
        [[1, 2], [3]],
        3,
        ["rust", "python"],
        rounds=4,
        warmup=2,
        progress=lambda *a: labels.append(a),
    )
    # Two warm-up rounds, then R,P  P,R  R,P  P,R; a fresh engine for every run.
    expected = ["rust", "python"] * 2 + ["rust", "python", "python", "rust"] * 2
    assert [backend for _, backend in log] == expected
    assert all(engine.runs == 1 for engine in engines)
    # Only the eight timed runs are recorded (engines 4 to 11), each with its round.
    assert [(r.backend, r.round, r.stats.bookkeeping_s) for r in result.runs] == [
        ("rust", 0, 4.0),
        ("python", 0, 5.0),
        ("python", 1, 6.0),
        ("rust", 1, 7.0),
        ("rust", 2, 8.0),
        ("python", 2, 9.0),
        ("python", 3, 10.0),
        ("rust", 3, 11.0),
    ]
    assert result.rounds == 4
    assert all(r.tokens == 6 and r.requests == 2 for r in result.runs)
    assert labels[0] == ("rust warm-up 1/2", 0, 12)
    assert labels[4] == ("rust round 1/4", 4, 12)
    assert labels[6] == ("python round 2/4", 6, 12)
    assert labels[-1] == ("done", 12, 12)
    # Ratios are taken within each round: python's engine over rust's, 5/4, 6/7, 9/8, 10/11.
    ratios = sorted([5 / 4, 6 / 7, 9 / 8, 10 / 11])
    spread = result.ratio("python", "rust", lambda r: r.stats.bookkeeping_s)
    assert spread == Spread((ratios[1] + ratios[2]) / 2, ratios[0], ratios[-1])
    assert result.spread("rust", lambda r: r.stats.bookkeeping_s) == Spread(7.5, 4.0, 11.0)


def test_round_orders_and_spreads() -> None:
    assert round_orders(["rust", "python"], 3) == [
        ("rust", "python"),
        ("python", "rust"),
        ("rust", "python"),
    ]
    assert round_orders(["rust"], 2) == [("rust",), ("rust",)]
    assert Spread.of([3.0, 1.0, 10.0]) == Spread(3.0, 1.0, 10.0)
    with pytest.raises(ValueError):
        Spread.of([])
    with pytest.raises(ValueError):
        compare(lambda b: _FakeEngine([], b), [[1]], 1, ["rust"], rounds=0)


TINY_BENCH = ["bench", "--num-requests", "3", "--prefix-len", "32", "--suffix-len", "4"]
TINY_BENCH += ["--output-len", "3", "--block-size", "8", "--rounds", "3"]


def test_bench_sets_the_torch_threads_prints_them_and_reports_medians_and_spreads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    threads = before + 1  # differs from what torch runs with now
    seen: list[int] = []

    def recording_compare(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return compare(*args, **kwargs)

    monkeypatch.setattr(cli, "compare", recording_compare)
    # More threads than cores are slow here: a still smaller workload.
    argv = [*TINY_BENCH, "--num-requests", "2", "--prefix-len", "8", "--output-len", "2"]
    assert cli.main([*argv, "--threads", str(threads)]) == 0
    out = capsys.readouterr().out
    assert seen == [threads]
    assert torch.get_num_threads() == before  # put back for the rest of this process
    assert f"torch threads: {threads} (--threads; torch's default here: {before})" in out
    assert "1 untimed warm-up run(s), then 3 timed rounds" in out
    assert "(R,P  P,R  R,P  P,R ...)" in out
    spread = r"\d+\.\d [\[]\d+\.\d-\d+\.\d[\]]"
    rows = re.findall(rf"^(rust|python) +({spread}) +\d+ \[\d+-\d+\] +\d+\.\d%", out, re.M)
    assert [row[0] for row in rows] == ["rust", "python"]
    for name in ("on bookkeeping", "end to end"):
        line = next(x for x in out.splitlines() if x.startswith(f"Rust speed-up {name}"))
        assert re.search(r"\d+\.\d+x \[\d+\.\d+x-\d+\.\d+x\]$", line), line
    assert re.search(r"^rust +\d+ \[\d+-\d+\] +\d+\.\d \[\d+\.\d-\d+\.\d\] +\d+", out, re.M)


def test_bench_default_threads_is_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    seen: list[int] = []

    def recording_compare(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return compare(*args, **kwargs)

    monkeypatch.setattr(cli, "compare", recording_compare)
    assert cli.main([*TINY_BENCH, "--backend", "rust", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert seen == [cli.DEFAULT_TORCH_THREADS] == [1]
    assert "0 untimed warm-up run(s)" in out
    assert "Rust speed-up" not in out  # one backend: nothing to compare


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["bench", "--prefix-len", "-5"], "--prefix-len"),
        (["bench", "--num-requests", "0"], "--num-requests"),
        (["bench", "--num-requests", "ten"], "--num-requests"),
        (["bench", "--suffix-len", "-1"], "--suffix-len"),
        (["bench", "--output-len", "0"], "--output-len"),
        (["bench", "--block-size", "0"], "--block-size"),
        (["bench", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["bench", "--num-blocks", "-3"], "--num-blocks"),
        (["bench", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["bench", "--rounds", "0"], "--rounds"),
        (["bench", "--warmup", "-1"], "--warmup"),
        (["bench", "--threads", "0"], "--threads"),
        (["bench", "--prefix-len", "0", "--suffix-len", "0"], "--prefix-len"),
        (["bench-hashing", "--tokens", "64,-1"], "--tokens"),
        (["bench-hashing", "--tokens", ","], "--tokens"),
        (["bench-hashing", "--block-size", "0"], "--block-size"),
        (["bench-hashing", "--decode-tokens", "4"], "--decode-tokens"),
        (["bench-hashing", "--repeat", "0"], "--repeat"),
        (["hash", "--block-size", "-16"], "--block-size"),
    ],
)
def test_numeric_arguments_are_checked_by_argparse(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvblocks ")
    assert option in err
    assert "Traceback" not in err
    assert "negative dimensions" not in err


def test_layout_is_one_of_the_named_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--engine", "vllm", "--layout", "gemma2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--layout: invalid choice: 'gemma2'" in err
    assert "'llama', 'gpt-oss', 'gemma3', 'llama4', 'mla'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layout", "gemma3"], "--layout: these options apply to --engine vllm\n"),
        (
            ["--engine", "vllm", "--threads", "2", "--warmup", "1"],
            "--threads, --warmup: these options apply to --engine kvblocks\n",
        ),
    ],
)
def test_options_of_the_other_engine_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *argv]) == 2
    assert capsys.readouterr().err == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--engine", "vllm", "--device-ms", "4", "--layout", "gemma3", "--prefix-len", "9"],
            "--prefix-len, --layout: these options apply to vLLM's scheduler benchmark, not to "
            "--device-ms (vLLM's engine loop on its own workloads: --workload)\n",
        ),
        (
            ["--engine", "vllm", "--workload", "chat"],
            "--workload, --no-async-scheduling: these options need --device-ms\n",
        ),
        (["--device-ms", "4"], "--device-ms: these options apply to --engine vllm\n"),
    ],
)
def test_the_engine_loop_options_are_refused_where_they_do_not_apply(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *argv]) == 2
    assert capsys.readouterr().err == message


@pytest.mark.parametrize("value", ["0", "4,-1", "x", ","])
def test_device_ms_takes_positive_milliseconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--engine", "vllm", "--device-ms", value])
    assert exit_info.value.code == 2
    assert "--device-ms: positive milliseconds like 4,8,12, not" in capsys.readouterr().err


def test_backend_is_refused_with_engine_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend`` picks the kvblocks engine's block managers; vLLM's comparison is always
    stock against kvblocks, so the option is refused there, not ignored."""
    assert cli.main(["bench", "--engine", "vllm", "--backend", "rust"]) == 2
    assert capsys.readouterr().err == "--backend: these options apply to --engine kvblocks\n"


def test_engine_kvblocks_passes_the_pool_and_the_token_budget_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--num-blocks`` and ``--max-num-batched-tokens`` reach ``kvblocks.LLM``; left out,
    they are the kvblocks engine's defaults (not the vllm engine's)."""
    pytest.importorskip("torch")
    import kvblocks.engine

    built: list[tuple[int, int]] = []
    real = kvblocks.engine.LLM

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append((kwargs["num_blocks"], kwargs["max_num_batched_tokens"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(kvblocks.engine, "LLM", recording)
    quick = [*TINY_BENCH, "--backend", "rust", "--warmup", "0", "--rounds", "1"]
    assert cli.main([*quick, "--num-blocks", "64", "--max-num-batched-tokens", "24"]) == 0
    assert "float32 KV cache of 64 blocks" in capsys.readouterr().out
    assert built == [(64, 24)]
    built.clear()
    assert cli.main(quick) == 0
    capsys.readouterr()
    assert built == [(cli.KVBLOCKS_ENGINE_NUM_BLOCKS, cli.KVBLOCKS_ENGINE_MAX_NUM_BATCHED_TOKENS)]
    assert built == [(4096, 4096)]


def test_engine_vllm_defaults_are_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The vllm engine's pool and token budget default to 8,192 (blocks per group, tokens)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # stops the run right after the defaults
    args = cli.parser().parse_args(["bench", "--engine", "vllm"])
    assert (args.num_blocks, args.max_num_batched_tokens, args.backend) == (None, None, None)
    assert cli.bench_vllm(args) == 2
    assert "needs vllm>=0.33,<0.35" in capsys.readouterr().err
    assert (args.num_blocks, args.max_num_batched_tokens) == (8192, 8192)


def test_a_pool_too_small_is_one_line_naming_num_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A prompt the pool cannot hold: a one-line error naming ``--num-blocks`` and what one
    request needs, exit status 2, no traceback; a larger ``--num-blocks`` runs."""
    pytest.importorskip("torch")
    quick = [*TINY_BENCH, "--backend", "rust", "--warmup", "0", "--rounds", "1"]
    assert cli.main([*quick, "--num-blocks", "3"]) == 2
    out, err = capsys.readouterr()
    # 32 + 4 prompt tokens and 3 output tokens in blocks of 8: 5 blocks.
    assert err.splitlines()[-1] == (
        "kvblocks: error: the pool cannot hold a single request: raise num_blocks "
        "(--num-blocks 3; one request needs up to 5)"
    )
    assert "Traceback" not in out + err
    assert cli.main([*quick, "--num-blocks", "8"]) == 0
    capsys.readouterr()


def test_edge_values_that_are_allowed() -> None:
    args = cli.parser().parse_args(["bench", "--prefix-len", "0", "--warmup", "0"])
    assert (args.prefix_len, args.warmup) == (0, 0)
    args = cli.parser().parse_args(["bench-hashing", "--tokens", "1,16,", "--decode-tokens", "16"])
    assert (args.tokens, args.decode_tokens) == ([1, 16], 16)


def test_install_hints_name_the_command_that_works_from_a_checkout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert cli.main(["bench", "--plot", "chart.png"]) == 2
    assert capsys.readouterr().err == (
        '--plot needs matplotlib: pip install ".[plot]" in a kvblocks checkout\n'
    )


def test_engine_vllm_without_vllm_names_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    assert cli.main(["bench", "--engine", "vllm", "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs vllm>=0.33,<0.35, which is not installed" in err
    assert 'pip install ".[vllm]" in a kvblocks checkout' in err
    assert "tqdm" not in err


def test_engine_vllm_with_a_dependency_of_vllm_missing_names_it() -> None:
    message = cli.vllm_missing_message(
        ModuleNotFoundError("No module named 'msgspec'", name="msgspec")
    )
    assert "vLLM is installed, but a module it imports is missing: 'msgspec'" in message
    assert "not installed" not in message


def test_vllm_logs_are_held_back_counted_and_the_loggers_restored() -> None:
    tree = logging.getLogger("vllm")
    ours = logging.getLogger("vllm.kvblocks")
    handlers, propagate, level = tree.handlers[:], tree.propagate, ours.level
    with held_back() as records:
        assert tree.handlers != handlers
        for _ in range(3):
            logging.getLogger("vllm.platforms.cpu").warning("block_size %d is slow", 16)
        ours.info("kvblocks: hasher runs on kvblocks (sha256)")
        logging.getLogger("vllm.config").error("once")
    assert summary(records) == [
        "WARNING [vllm.platforms.cpu] block_size 16 is slow (3 times)",
        "INFO [vllm.kvblocks] kvblocks: hasher runs on kvblocks (sha256)",
        "ERROR [vllm.config] once",
    ]
    assert (tree.handlers, tree.propagate, ours.level) == (handlers, propagate, level)


def test_the_chart_puts_bookkeeping_on_an_axis_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    from kvblocks.engine_bench_report import plot

    def run(backend: str, round_index: int, wall: float, book: float) -> Run:
        stats = SimpleNamespace(bookkeeping_s=book, model_s=wall - book)
        return Run(backend, round_index, 32, wall, 1024, stats)  # type: ignore[arg-type]

    runs = [run("rust", 0, 1.2, 0.010), run("python", 0, 1.0, 0.200)]
    runs += [run("python", 1, 1.1, 0.300), run("rust", 1, 1.0, 0.020)]
    runs += [run("rust", 2, 1.4, 0.030), run("python", 2, 1.3, 0.250)]
    fig = plot(Comparison(("rust", "python"), runs, 1), str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").stat().st_size > 0
    bookkeeping, end_to_end = fig.axes
    assert [b.get_height() for b in bookkeeping.patches] == pytest.approx([20.0, 250.0])
    assert [b.get_height() for b in end_to_end.patches] == pytest.approx([1200.0, 1100.0])
    # Within each round: 200/10, 300/20, 250/30; the median is 15 (not 250/20 = 12.5).
    assert bookkeeping.get_title() == "bookkeeping: Rust 15.0x faster"
    capsys.readouterr()


def test_a_workload_no_pool_can_hold_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The arithmetic runs first: a 100-million-token prompt is refused at once, without
    building its prompts (which took 23 GB before) and without torch."""
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    assert cli.main(["bench", "--prefix-len", "100000000"]) == 2
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 1.0
    assert peak < 20_000_000  # bytes: no prompt was built
    # 100,000,000 + 64 prompt tokens and 32 output tokens, less the last, in blocks of 16.
    assert capsys.readouterr().err == (
        "kvblocks: error: the pool cannot hold a single request: raise num_blocks "
        "(--num-blocks 4096; one request needs up to 6250006)\n"
    )


def test_a_vllm_pool_that_cannot_hold_one_request_is_refused_before_the_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--engine vllm --num-blocks 10``: vLLM's scheduler used to wait forever for room; the
    arithmetic refuses it once vLLM is imported, before any configuration is built."""
    pytest.importorskip("vllm")
    assert cli.main(["bench", "--engine", "vllm", "--num-blocks", "10"]) == 2
    # 1,500 + 500 prompt tokens and 32 output tokens, less the last, in blocks of 16.
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kvblocks: error: the pool cannot hold a single request: --num-blocks 10 per group; "
        "one request needs up to 127 in a full-attention group"
    )


def test_a_plot_into_a_missing_directory_is_refused_before_the_benchmark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    missing = tmp_path / "no" / "x.png"
    assert cli.main([*TINY_BENCH, "--plot", str(missing)]) == 2
    message = f"--plot {missing}: there is no directory {missing.parent}\n"
    assert capsys.readouterr() == ("", message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hello", "kvblocks: error: stdin must hold a JSON list of token ids (Expecting value: "),
        ('{"a": 1}', "kvblocks: error: stdin must hold a JSON list of token ids, not a dict"),
    ],
)
def test_hash_says_what_its_input_must_be(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert cli.main(["hash"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(message)
    assert len(err.splitlines()) == 1


def test_hash_of_fewer_tokens_than_a_block_says_there_is_no_full_block(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("[1, 2]"))
    assert cli.main(["hash"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "kvblocks hash: 2 tokens make no full 16-token block: no block hash (vLLM hashes full "
        "blocks only)\n"
    )
    # 16 tokens: one hash, and nothing on stderr.
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(list(range(16)))))
    assert cli.main(["hash"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 1
    assert err == ""


def test_bench_says_which_build_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Timings of a dev build (what .ci/run installs) are not the release's: the header says
    which one ran."""
    from kvblocks import _core

    assert _core.BUILD_PROFILE in ("dev", "release")
    assert cli.main(["bench-hashing", "--repeat", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    if _core.BUILD_PROFILE == "release":
        assert first.startswith(f"kvblocks {kvblocks.__version__} (release build): ")
    else:
        assert first.startswith(
            f"kvblocks {kvblocks.__version__} (dev build: its timings are not the release's; "
        )
