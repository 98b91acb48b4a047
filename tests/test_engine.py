"""The scheduler and engine end to end on the embedded tiny model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the engine needs the kvblocks[torch] extra")

from kvblocks.cli import main  # noqa: E402
from kvblocks.engine import LLM, SamplingParams  # noqa: E402
from kvblocks.model import LlamaConfig, LlamaForCausalLM  # noqa: E402

MODEL = LlamaForCausalLM.random(
    LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48), seed=2
)
rng = np.random.default_rng(0)
SHARED = rng.integers(0, 101, size=40).tolist()
PROMPTS = [SHARED + rng.integers(0, 101, size=k).tolist() for k in (3, 9, 16, 1, 30)]


def tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def run(**kwargs: Any) -> tuple[LLM, list[Any]]:
    params = kwargs.pop("params", SamplingParams(max_tokens=8))
    llm = LLM(MODEL, block_size=4, **kwargs)
    return llm, llm.generate(PROMPTS, params)


def test_prefix_caching_changes_nothing_but_the_work() -> None:
    on, out_on = run()
    off, out_off = run(enable_prefix_caching=False)
    assert tokens(out_on) == tokens(out_off)
    assert on.stats.prefix_hits >= 4 * 40 - 4 * 4  # later prompts reuse the shared prefix
    assert off.stats.prefix_hits == 0
    assert [o.num_cached_tokens for o in out_on][1:] == [40] * 4
    assert all(o.outputs[0].finish_reason == "length" for o in out_on)


def test_preemption_gives_the_same_outputs() -> None:
    small, out_small = run(num_blocks=24, max_num_batched_tokens=64)
    _, out_large = run(num_blocks=512)
    assert small.stats.num_preemptions > 0
    assert tokens(out_small) == tokens(out_large)


def test_parallel_sampling() -> None:
    _, greedy = run(params=SamplingParams(max_tokens=6, n=3))
    for out in greedy:
        assert len(out.outputs) == 3
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    sampled = SamplingParams(max_tokens=6, n=3, temperature=1.0, top_p=0.9, seed=11)
    _, together = run(params=sampled)
    for i in range(3):
        alone = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=11 + i)
        _, separate = run(params=alone)
        assert [o.outputs[i].token_ids for o in together] == [
            o.outputs[0].token_ids for o in separate
        ]
    assert len({tuple(o.token_ids) for o in together[0].outputs}) > 1


def test_backends_agree_on_outputs_hits_and_blocks() -> None:
    rust, out_rust = run(backend="rust", num_blocks=40, max_num_batched_tokens=48)
    python, out_python = run(backend="python", num_blocks=40, max_num_batched_tokens=48)
    assert tokens(out_rust) == tokens(out_python)
    assert [o.num_cached_tokens for o in out_rust] == [o.num_cached_tokens for o in out_python]
    assert rust.stats.prefix_hits == python.stats.prefix_hits
    assert rust.stats.num_preemptions == python.stats.num_preemptions
    assert rust.manager.debug_state() == python.manager.debug_state()


def test_eos_and_validation() -> None:
    llm = LLM(MODEL, block_size=4)
    first = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5))[0].outputs[0].token_ids
    stop = next((k for k, t in enumerate(first) if k and t not in first[:k]), 0)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, eos_token_id=first[stop]))
    assert out[0].outputs[0].token_ids == first[: stop + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        LLM(MODEL, backend="java")
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 101]])


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        # Strings are not token ids, even when int() would read them.
        (["12", "34"], TypeError, "prompt 0: token ids must be integers, got str at index 0"),
        (["hello"], TypeError, "prompt 0: token ids must be integers, got str at index 0"),
        ("hello", TypeError, "prompts must be token ids or a list of them, got str"),
        ([[1, 2], ["3"]], TypeError, "prompt 1: token ids must be integers, got str at index 0"),
        ([1.7, 2.2], TypeError, "prompt 0: token ids must be integers, got float at index 0"),
        (
            [[5, 6], [7, 8.0]],
            TypeError,
            "prompt 1: token ids must be integers, got float at index 1",
        ),
        ([1, True], TypeError, "prompt 0: token ids must be integers, got bool at index 1"),
        (
            [[1], [np.bool_(True)]],
            TypeError,
            "prompt 1: token ids must be integers, got bool at index 0",
        ),
        ([1, [2, 3]], TypeError, "prompt 0: token ids must be integers, got list at index 1"),
        ([[1, 2], 3], TypeError, "prompt 1 must be a list of token ids, got int"),
        (
            [np.array([1.5, 2.0])],
            TypeError,
            "prompt 0: token ids must have an integer dtype, got float64",
        ),
        (
            np.array([True, False]),
            TypeError,
            "prompt 0: token ids must have an integer dtype, got bool",
        ),
        (
            np.zeros((2, 2, 2), dtype=np.int64),
            ValueError,
            "prompt 0: token ids must be a 1-D array",
        ),
        ([], ValueError, "no prompts given"),
        (np.zeros((0, 4), dtype=np.int64), ValueError, "no prompts given"),
        (np.zeros((2, 0), dtype=np.int64), ValueError, "prompt 0 is empty"),
        ([[1, 2], []], ValueError, "prompt 1 is empty"),
        ([[1, 2], [3, 101]], ValueError, "prompt 1: token id 101 at index 1 is outside"),
        ([[1, 2], [-1]], ValueError, "prompt 1: token id -1 at index 0 is outside"),
    ],
)
def test_generate_refuses_what_is_not_token_ids(prompts: Any, error: type, message: str) -> None:
    llm = LLM(MODEL, block_size=4)
    before = llm.manager.debug_state()
    with pytest.raises(error) as info:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert str(info.value).startswith(message)
    assert llm.manager.debug_state() == before
    assert len(llm.manager) == 0  # nothing was scheduled


def test_generate_takes_lists_tuples_and_integer_arrays_alike() -> None:
    params = SamplingParams(max_tokens=3)
    expected = tokens(LLM(MODEL, block_size=4).generate(PROMPTS[:2], params))
    as_arrays = [
        np.array(p, dtype=dtype)
        for p, dtype in zip(PROMPTS[:2], (np.int64, np.uint32), strict=True)
    ]
    for prompts in (
        as_arrays,
        [tuple(p) for p in PROMPTS[:2]],
        [[np.int32(t) for t in p] for p in PROMPTS[:2]],
    ):
        assert tokens(LLM(MODEL, block_size=4).generate(prompts, params)) == expected
    one = LLM(MODEL, block_size=4).generate(np.array(PROMPTS[0]), params)  # one prompt
    assert tokens(one) == expected[:1]
    same_length = np.array([PROMPTS[0][:20], PROMPTS[1][:20]])  # a 2-D array: one per row
    rows = LLM(MODEL, block_size=4).generate(same_length, params)
    assert tokens(rows) == tokens(
        LLM(MODEL, block_size=4).generate([PROMPTS[0][:20], PROMPTS[1][:20]], params)
    )


def test_cli_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    code = main(
        [
            "bench",
            "--num-requests",
            "3",
            "--prefix-len",
            "32",
            "--suffix-len",
            "4",
            "--output-len",
            "3",
            "--block-size",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Rust speed-up on bookkeeping" in out
    assert out.count("%") >= 6


def test_num_blocks_zero_is_an_error_not_a_default() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        LLM(MODEL, num_blocks=0)


def test_the_scheduler_only_calls_the_batched_step_per_step() -> None:
    """Per step the scheduler makes one manager call (plus remove_request at finishing): no
    per-request bookkeeping crosses into the manager."""
    llm = LLM(MODEL, block_size=4)
    calls: list[str] = []
    real = llm.scheduler.manager

    class Counting:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real, name)

    llm.scheduler.manager = Counting()  # type: ignore[assignment]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    steps = llm.stats.steps
    assert calls.count("schedule_step") == steps
    assert calls.count("remove_request") == len(PROMPTS)
    assert set(calls) <= {"schedule_step", "remove_request", "add_request", "block_size"}
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens": "3"}, TypeError, "max_tokens must be an int, not str"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int, not float"),
        ({"n": True}, TypeError, "n must be an int, not bool"),
        ({"seed": "1"}, TypeError, "seed must be an int or None, not str"),
        ({"temperature": "0"}, TypeError, "temperature must be a number, not str"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, ValueError, "temperature must be >= 0, got nan"),
        ({"top_p": 2}, ValueError, r"top_p must be in \(0, 1\], got 2"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    ],
)
def test_sampling_params_name_the_field(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_generate_says_what_sampling_params_must_be() -> None:
    llm = LLM(MODEL, block_size=4)
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams .*not dict$"):
        llm.generate([PROMPTS[0]], {"max_tokens": 3})  # type: ignore[arg-type]


def test_a_hub_name_is_not_a_directory() -> None:
    with pytest.raises(FileNotFoundError, match=r"from a local directory .* never from a hub"):
        LLM("meta-llama/Llama-3.2-1B")


def test_a_pool_too_small_says_how_many_blocks_the_shortest_request_needs() -> None:
    from kvblocks.engine import PoolTooSmall

    llm = LLM(MODEL, block_size=4, num_blocks=3)  # 2 usable blocks
    with pytest.raises(
        PoolTooSmall,
        match=r"\(num_blocks 3, of which block 0 is the null block; "
        r"the shortest waiting request needs 5 blocks\)$",
    ):
        llm.generate([list(range(1, 18))], SamplingParams(max_tokens=2))
