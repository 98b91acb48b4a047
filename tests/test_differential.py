"""Hypothesis drives the Rust implementation and the pure-Python reference with the same random
inputs; every hash must agree, and TokenSequence must not care how the tokens arrive."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvblocks
import kvblocks.reference as ref

ALGOS = st.sampled_from(kvblocks.HASH_ALGORITHMS)
TOKEN = st.one_of(
    st.integers(0, 300),
    st.integers(0, 2**32 - 1),
    st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]),
)
TEXT = st.text(max_size=12) | st.sampled_from(["", "a", "é", "ā", "mm", "lora"])
EXTRA_KEY = st.one_of(
    st.tuples(st.just("lora"), TEXT, TEXT),
    st.tuples(st.just("mm"), TEXT, st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("cache_salt"), TEXT),
    st.tuples(st.just("prompt_embeds"), st.binary(max_size=40)),
)
EXTRA_KEYS = st.none() | st.lists(EXTRA_KEY, max_size=5).map(tuple)
SEED = st.none() | TEXT

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mm_features(draw: st.DrawFn, num_tokens: int) -> list[tuple[str, int, int]]:
    features = []
    for _ in range(draw(st.integers(0, 4))):
        offset = draw(st.integers(0, num_tokens + 4))
        features.append((draw(TEXT), offset, draw(st.integers(1, 20))))
    return sorted(features, key=lambda f: f[1])


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    tokens = draw(st.lists(TOKEN, min_size=1, max_size=120))
    return {
        "tokens": tokens,
        "cache_salt": draw(st.none() | TEXT),
        "lora": draw(st.none() | st.tuples(TEXT, TEXT)),
        "mm_features": draw(st.none() | mm_features(len(tokens))),
    }


@SETTINGS
@given(
    algo=ALGOS,
    block_size=st.integers(1, 40),
    seed=SEED,
    parent=st.none() | st.binary(max_size=40),
    tokens=st.lists(TOKEN, max_size=80),
    extra=EXTRA_KEYS,
)
def test_hash_block_agrees(
    algo: str,
    block_size: int,
    seed: str | None,
    parent: bytes | None,
    tokens: list[int],
    extra: Any,
) -> None:
    seed = seed if seed is not None else "fixed"
    native = kvblocks.BlockHasher(algo, block_size=block_size, seed=seed)
    reference = ref.BlockHasher(algo, block_size=block_size, seed=seed)
    assert native.none_hash == reference.none_hash
    assert native.hash_block(parent, tokens, extra) == reference.hash_block(parent, tokens, extra)


@SETTINGS
@given(algo=ALGOS, block_size=st.integers(1, 24), request=requests())
def test_hash_blocks_agree(algo: str, block_size: int, request: dict[str, Any]) -> None:
    native = kvblocks.BlockHasher(algo, block_size=block_size, seed="x")
    reference = ref.BlockHasher(algo, block_size=block_size, seed="x")
    tokens = request.pop("tokens")
    expected = reference.hash_blocks(tokens, **request)
    assert len(expected) == len(tokens) // block_size
    assert native.hash_blocks(tokens, **request) == expected


@SETTINGS
@given(
    algo=ALGOS,
    block_size=st.integers(1, 24),
    request=requests(),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    prompt_len=st.integers(1, 120),
)
def test_token_sequence_agrees_however_tokens_arrive(
    algo: str, block_size: int, request: dict[str, Any], cuts: list[int], prompt_len: int
) -> None:
    tokens = request.pop("tokens")
    prompt_len = min(prompt_len, len(tokens))
    expected = ref.BlockHasher(algo, block_size=block_size, seed="x").hash_blocks(tokens, **request)
    for impl in (kvblocks, ref):
        hasher = impl.BlockHasher(algo, block_size=block_size, seed="x")
        seq = impl.TokenSequence(tokens[:prompt_len], hasher=hasher, **request)
        rest = tokens[prompt_len:]
        bounds = sorted({0, len(rest), *(c for c in cuts if c < len(rest))})
        for lo, hi in itertools.pairwise(bounds):
            chunk = rest[lo:hi]
            seq.append_token_ids(chunk[0] if len(chunk) == 1 else chunk)
        assert seq.block_hashes == expected, impl.__name__
        assert seq.get_token_ids() == tokens
        assert seq.num_prompt_tokens == prompt_len
        assert seq.num_output_tokens == len(tokens) - prompt_len
        assert seq.last_token_id == tokens[-1]
        assert seq.prompt_token_ids.tolist() == tokens[:prompt_len]
        assert seq.output_token_ids.tolist() == tokens[prompt_len:]
        for n in {0, prompt_len, len(tokens), len(tokens) // 2}:
            head, tail = seq.get_prefix_token_ids(n)
            assert list(head) + list(tail or ()) == tokens[:n]
            assert (tail is None) == (n <= prompt_len)
