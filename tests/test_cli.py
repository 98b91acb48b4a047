"""The ``kvblocks`` command line: which function runs each command, and ``bench-hashing``'s
workload (the one ``benches/bench_hashing.py`` measures, both from ``kvblocks.workloads``)."""

from __future__ import annotations

import pytest

import kvblocks
from kvblocks import cli
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
    monkeypatch.setattr(cli, "_twin", lambda: None)
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
    monkeypatch.setattr(cli, "_twin", lambda: None)
    argv = ["bench-hashing", "--tokens", "40,100", "--algo", "sha256", "--block-size", "8"]
    argv += ["--decode-tokens", "50", "--repeat", "2"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert set(recorder.hashers) == {("sha256", 8, HASHER_SEED)}
    assert recorder.prompts == [("sha256", hashing_prompt(n)) for n in (40, 100) for _ in (0, 1)]
    assert recorder.decodes == [("sha256", hashing_prompt(50))] * 2


def test_bench_hashing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A small real run, Rust against the twin."""
    argv = ["bench-hashing", "--tokens", "64,256", "--algo", "sha256_cbor", "xxh3_128"]
    assert cli.main([*argv, "--decode-tokens", "64", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "block hashing, block size 16" in out
    for row in ("hash a 64-token prompt", "hash a 256-token prompt", "grow to 64 tokens"):
        assert row in out
    assert out.count("x\n") == 6  # a speed-up over the twin on every row
