"""kvblocks' request block hasher against vLLM 0.33's own, on the same requests.

vLLM's hasher is the independent oracle here: every test builds the same request twice, once
with each hasher, and compares ``request.block_hashes``. A counter on vLLM's
``hash_block_tokens`` proves which code produced the kvblocks side (zero calls unless the
request fell back)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import cbor2
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm import block_hasher as block_hasher_module
from kvblocks.vllm.block_hasher import ALGORITHMS
from tests.vllm_driver import make_request

Hasher = Callable[[Request], list[bytes]]

#: One past the largest token id a vLLM request holds: vLLM 0.34 keeps them in an int32
#: buffer (vllm.v1.token_buffer), vLLM 0.33 in a list (kvblocks hashes any uint32 there).
TOKEN_LIMIT = 2**31 if importlib.util.find_spec("vllm.v1.token_buffer") else 2**32


class VllmHashCalls:
    """Counts calls of vLLM's ``hash_block_tokens`` (made only by vLLM's own hasher)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = kv_cache_utils.hash_block_tokens

        def counting(*args: Any, **kwargs: Any) -> bytes:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", counting)


@pytest.fixture
def vllm_calls(monkeypatch: pytest.MonkeyPatch) -> VllmHashCalls:
    return VllmHashCalls(monkeypatch)


def both_hashers(algo: str, block_size: int, lookahead: int = 0) -> tuple[Hasher, Hasher]:
    """(vLLM's hasher, kvblocks' hasher), both built after NONE_HASH is set, as EngineCore
    does: vLLM's reads NONE_HASH at every call, so building both after it keeps them on one
    seed even for the random-seeded xxhash algorithms."""
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    stock_factory = kv_cache_utils.get_request_block_hasher
    kvblocks.vllm.install("hasher")
    ours = kv_cache_utils.get_request_block_hasher(block_size, hash_fn, lookahead)
    assert kv_cache_utils.get_request_block_hasher is not stock_factory
    return stock_factory(block_size, hash_fn, lookahead), ours


def pair(stock: Hasher, ours: Hasher, prompt: list[int], **kwargs: Any) -> tuple[Request, Request]:
    return make_request("a", prompt, stock, **kwargs), make_request("b", prompt, ours, **kwargs)


def counted_pair(
    stock: Hasher, ours: Hasher, prompt: list[int], vllm_calls: VllmHashCalls, **kwargs: Any
) -> tuple[Request, Request, tuple[int, int]]:
    """:func:`pair`, with how often each side called vLLM's ``hash_block_tokens``."""
    start = vllm_calls.count
    a = make_request("a", prompt, stock, **kwargs)
    middle = vllm_calls.count
    b = make_request("b", prompt, ours, **kwargs)
    return a, b, (middle - start, vllm_calls.count - middle)


def expected_chain(algo: str, tokens: list[int], block_size: int) -> list[bytes]:
    """The block hashes of a request without extra keys, recomputed from vLLM's definition
    with hashlib, pickle, cbor2 and xxhash alone: NONE_HASH is the hash of the seed vLLM drew,
    and each block hashes ``(parent hash, tuple of its tokens, None)``."""

    def digest(value: Any) -> bytes:
        if algo in ("sha256", "xxhash"):
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            data = cbor2.dumps(value, canonical=True)
        if algo.startswith("sha256"):
            return hashlib.sha256(data).digest()
        xxh: bytes = xxhash.xxh3_128_digest(data)
        return xxh

    parent = digest(kv_cache_utils.get_none_hash_seed())
    chain = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = digest((parent, tuple(tokens[start : start + block_size]), None))
        chain.append(parent)
    return chain


def fallbacks() -> dict[tuple[str, str], int]:
    return dict(_state.fallbacks)


@pytest.fixture(autouse=True)
def _clear_fallbacks() -> Iterator[None]:
    _state.fallbacks.clear()
    yield
    _state.fallbacks.clear()


@pytest.mark.parametrize("seed", [None, "0", "a shared seed"])
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_prompt_hashes_match_vllm(
    algo: str, seed: str | None, monkeypatch: pytest.MonkeyPatch, vllm_calls: VllmHashCalls
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    stock, ours = both_hashers(algo, 16)
    prompt = [random.Random(7).randrange(32000) for _ in range(16 * 9 + 5)]
    a = make_request("a", prompt, stock)
    calls_for_stock = vllm_calls.count
    assert calls_for_stock == 9
    b = make_request("b", prompt, ours)
    assert len(b.block_hashes) == 9
    assert b.block_hashes == a.block_hashes
    assert vllm_calls.count == calls_for_stock, "kvblocks' side must not call vLLM's hashing"
    # Independently of both hashers: the bytes from the definition.
    assert b.block_hashes == expected_chain(algo, prompt, 16)
    assert kvblocks.vllm.status().active == {"hasher": algo}
    assert fallbacks() == {}


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_appends_across_block_boundaries_and_truncation(
    algo: str, vllm_calls: VllmHashCalls
) -> None:
    stock, ours = both_hashers(algo, 4)
    a, b = pair(stock, ours, list(range(100, 110)))
    rng = random.Random(algo)
    for step in range(60):
        tokens: int | list[int] = (
            rng.randrange(32000) if step % 3 else [rng.randrange(32000) for _ in range(5)]
        )
        calls = vllm_calls.count
        a.append_output_token_ids(tokens)
        stock_calls = vllm_calls.count - calls
        b.append_output_token_ids(tokens)
        assert vllm_calls.count - calls == stock_calls
        assert b.block_hashes == a.block_hashes
        if step % 17 == 16:
            # The scheduler truncates block_hashes (streaming sessions, resets): the hasher
            # must resume from wherever the list now ends.
            keep = rng.randrange(len(a.block_hashes) + 1)
            del a.block_hashes[keep:]
            del b.block_hashes[keep:]
        if step == 40:
            a.block_hashes.clear()
            b.block_hashes.clear()
    assert len(a.block_hashes) > 10
    assert fallbacks() == {}


def fresh(s: str) -> str:
    """An equal string as a distinct object, as decoding a request makes it."""
    return s.encode().decode()


def _mm(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


EXTRA_KEY_CASES: dict[str, dict[str, Any]] = {
    "cache_salt": {"cache_salt": "tenant-42"},
    "lora": {"lora_request": LoRARequest("adapter-a", 3, "/adapters/a")},
    "lora_one_char": {"lora_request": LoRARequest("b", 4, "/")},
    "mm": {
        # One image twice, as two decoded strings (one object twice takes the pickle
        # fallback: see test_fallback_pickle_identity).
        "mm_features": [_mm("img-0", 3, 9), _mm("img-1", 12, 2), _mm(fresh("img-0"), 30, 40)],
    },
    "all": {
        "cache_salt": "s",
        "lora_request": LoRARequest("adapter-c", 5, "/p/c"),
        "mm_features": [_mm("image-x", 0, 20)],
    },
}


@pytest.mark.parametrize("case", list(EXTRA_KEY_CASES))
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_extra_keys_match_vllm(algo: str, case: str, vllm_calls: VllmHashCalls) -> None:
    stock, ours = both_hashers(algo, 8)
    kwargs = EXTRA_KEY_CASES[case]
    a, b = pair(stock, ours, list(range(50, 125)), **kwargs)
    assert b.block_hashes == a.block_hashes
    for token in range(40):
        a.append_output_token_ids(token)
        b.append_output_token_ids(token)
    del a.block_hashes[3:]
    del b.block_hashes[3:]
    a.append_output_token_ids(list(range(9)))
    b.append_output_token_ids(list(range(9)))
    assert b.block_hashes == a.block_hashes
    assert len(b.block_hashes) == (75 + 49) // 8
    # The keys really are mixed in: a plain request hashes differently.
    plain = make_request("c", list(range(50, 125)), ours)
    assert plain.block_hashes[0] != b.block_hashes[0]
    assert fallbacks() == {}


def test_engine_core_name_is_replaced_too() -> None:
    from vllm.v1.engine import core

    kvblocks.vllm.install("all")
    assert core.get_request_block_hasher is kv_cache_utils.get_request_block_hasher
    assert core.get_request_block_hasher.__module__ == "kvblocks.vllm.block_hasher"
    kvblocks.vllm.uninstall()
    assert core.get_request_block_hasher.__module__ == "vllm.v1.core.kv_cache_utils"
    assert kv_cache_utils.get_request_block_hasher.__module__ == "vllm.v1.core.kv_cache_utils"


# Lookahead hashing (EAGLE/MTP drafting, num_hash_lookahead_tokens = L): a block's hash also
# covers the L tokens after it, and appears only once they exist.

LOOKAHEADS = (1, 2, 3, 5)


def _append_and_compare(
    a: Request, b: Request, appends: list[int | list[int]], vllm_calls: VllmHashCalls
) -> None:
    """Appends the same tokens to both requests, comparing after each append; kvblocks' side
    must not call vLLM's hashing. Truncates both hash lists twice on the way, as the
    scheduler does."""
    for step, tokens in enumerate(appends):
        a.append_output_token_ids(tokens)
        calls = vllm_calls.count
        b.append_output_token_ids(tokens)
        assert vllm_calls.count == calls, "kvblocks' side must not call vLLM's hashing"
        assert b.block_hashes == a.block_hashes, step
        if step in (len(appends) // 3, 2 * len(appends) // 3):
            keep = len(a.block_hashes) // 2
            del a.block_hashes[keep:]
            del b.block_hashes[keep:]


@pytest.mark.parametrize("seed", [None, "0"])
@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_lookahead_matches_vllm(
    algo: str,
    lookahead: int,
    seed: str | None,
    monkeypatch: pytest.MonkeyPatch,
    vllm_calls: VllmHashCalls,
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    stock, ours = both_hashers(algo, 4, lookahead)
    assert ours.__module__ == "kvblocks.vllm.block_hasher"
    rng = random.Random(f"{algo}-{lookahead}")
    prompt = [rng.randrange(TOKEN_LIMIT) for _ in range(4 * 5 + 2)]
    calls = vllm_calls.count
    a = make_request("a", prompt, stock)
    assert vllm_calls.count - calls == (len(prompt) - lookahead) // 4
    b = make_request("b", prompt, ours)
    assert vllm_calls.count - calls == (len(prompt) - lookahead) // 4
    assert b.block_hashes == a.block_hashes
    # One token at a time across many block boundaries, then a few longer appends.
    appends: list[int | list[int]] = [rng.randrange(32000) for _ in range(30)]
    appends += [[rng.randrange(32000) for _ in range(7)] for _ in range(3)]
    _append_and_compare(a, b, appends, vllm_calls)
    assert len(a.block_hashes) >= 10
    status = kvblocks.vllm.status()
    assert status.active == {"hasher": f"{algo}, {lookahead} lookahead tokens"}
    assert fallbacks() == {}


LOOKAHEAD_KEY_CASES: dict[str, dict[str, Any]] = {
    **EXTRA_KEY_CASES,
    # With B = 8: items that start right after a block ends (so only the lookahead window of
    # the block before reaches them), one that ends on a block end, and a one-token item.
    "mm_in_lookahead_window": {
        "mm_features": [
            _mm("at-8", 8, 3),
            _mm("at-17", 17, 4),
            _mm("to-32", 30, 2),
            _mm("one", 40, 1),
        ],
    },
    # Items that overlap one another with sorted ends (no fallback: vLLM's scan and kvblocks'
    # agree there), with LoRA and a salt.
    "mm_overlapping_sorted_ends": {
        "cache_salt": "t",
        "lora_request": LoRARequest("adapter-d", 6, "/p/d"),
        "mm_features": [_mm("p", 6, 10), _mm("q", 9, 10), _mm("r", 23, 2)],
    },
}


@pytest.mark.parametrize("case", list(LOOKAHEAD_KEY_CASES))
@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_lookahead_extra_keys_match_vllm(
    algo: str, lookahead: int, case: str, vllm_calls: VllmHashCalls
) -> None:
    stock, ours = both_hashers(algo, 8, lookahead)
    kwargs = LOOKAHEAD_KEY_CASES[case]
    a = make_request("a", list(range(50, 91)), stock, **kwargs)
    calls = vllm_calls.count
    b = make_request("b", list(range(50, 91)), ours, **kwargs)
    assert vllm_calls.count == calls
    assert b.block_hashes == a.block_hashes
    _append_and_compare(a, b, [*range(40), list(range(9))], vllm_calls)
    assert len(b.block_hashes) >= 5
    # The keys and the lookahead tokens are really mixed in.
    plain = make_request("c", list(range(50, 91)), ours)
    assert plain.block_hashes[0] != b.block_hashes[0]
    ours_plain = kv_cache_utils.get_request_block_hasher(8, get_hash_fn_by_name(algo))
    no_lookahead = make_request("d", list(range(50, 91)), ours_plain, **kwargs)
    assert no_lookahead.block_hashes[0] != b.block_hashes[0]
    assert fallbacks() == {}


# Fallbacks: each case gets vLLM's bytes from vLLM's own code, and says why.


def _check_fallback(a: Request, b: Request, reason: str, calls: tuple[int, int]) -> None:
    """``b`` (kvblocks' hasher) fell back for ``reason``: its hashes are ``a``'s (vLLM's
    hasher), and vLLM's code made them (``calls``: vLLM's ``hash_block_tokens`` calls while
    hashing ``a``, then ``b``)."""
    stock_calls, our_calls = calls
    assert our_calls > 0, "the fallback must hash with vLLM's code"
    assert our_calls == stock_calls
    assert b.block_hashes == a.block_hashes
    assert len(b.block_hashes) > 0
    assert fallbacks().get(("hasher", reason), 0) >= 1, fallbacks()
    assert any(reason_text(reason) in text for text in kvblocks.vllm.status().fallbacks)


def reason_text(reason: str) -> str:
    return _state.REASONS[reason]


def test_fallback_prompt_embeds(vllm_calls: VllmHashCalls) -> None:
    stock, ours = both_hashers("sha256_cbor", 4)
    embeds = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    params = {"prompt_embeds": embeds}
    sampling = SamplingParams(max_tokens=4)
    a = Request("a", None, sampling, None, block_hasher=stock, **params)
    calls = vllm_calls.count
    b = Request("b", None, sampling, None, block_hasher=ours, **params)
    assert vllm_calls.count > calls
    _check_fallback(a, b, "prompt_embeds", (calls, vllm_calls.count - calls))


def test_fallback_bad_lookahead_argument() -> None:
    """A lookahead count that is not an int >= 0 is vLLM's to handle: kvblocks does not
    raise while the engine starts, and says why it stood aside."""
    kvblocks.vllm.install("hasher")
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    for bad in (-1, None, 1.0):
        ours = kv_cache_utils.get_request_block_hasher(4, hash_fn, bad)  # type: ignore[arg-type]
        assert ours.__module__ == "vllm.v1.core.kv_cache_utils"
    assert fallbacks() == {("hasher", "bad_field"): 3}


def test_fallback_unknown_hash_function(vllm_calls: VllmHashCalls) -> None:
    kvblocks.vllm.install("hasher")

    def custom_hash(obj: Any) -> bytes:
        return get_hash_fn_by_name("sha256")(("custom", obj))

    kv_cache_utils.init_none_hash(custom_hash)
    ours = kv_cache_utils.get_request_block_hasher(4, custom_hash)
    stock = _state.original_or_current(kv_cache_utils, "get_request_block_hasher")(4, custom_hash)
    a, b, calls = counted_pair(stock, ours, list(range(13)), vllm_calls)
    assert b.block_hashes == a.block_hashes
    assert fallbacks() == {("hasher", "hash_fn"): 1}
    _check_fallback(a, b, "hash_fn", calls)


def test_fallback_none_hash_mismatch(
    monkeypatch: pytest.MonkeyPatch, vllm_calls: VllmHashCalls
) -> None:
    stock, ours = both_hashers("sha256_cbor", 4)
    # Something else in the process set NONE_HASH from a seed kvblocks is not told about.
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"\x01" * 32)
    a, b, calls = counted_pair(stock, ours, list(range(13)), vllm_calls)
    _check_fallback(a, b, "none_hash", calls)


def test_none_hash_reinitialized_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second init_none_hash (xxhash draws a new random seed each time) changes vLLM's
    hashes of later requests; kvblocks' hasher follows it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    stock, ours = both_hashers("xxhash_cbor", 4)
    first = make_request("b", list(range(13)), ours).block_hashes
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("xxhash_cbor"))
    a, b = pair(stock, ours, list(range(13)))
    assert b.block_hashes == a.block_hashes
    assert b.block_hashes != first
    assert fallbacks() == {}


def test_fallback_pickle_identity(vllm_calls: VllmHashCalls) -> None:
    """With pickle, one string object used twice in a block is written once: kvblocks models
    distinct objects, so such a request is hashed by vLLM."""
    path = fresh("/shared/name")  # one object used as both name and path
    stock, ours = both_hashers("sha256", 4)
    a, b, calls = counted_pair(
        stock, ours, list(range(13)), vllm_calls, lora_request=LoRARequest(path, 1, path)
    )
    _check_fallback(a, b, "pickle_identity", calls)
    # The same strings as distinct objects take the fast path and still match.
    _state.fallbacks.clear()
    other = fresh(path)
    a, b = pair(stock, ours, list(range(13)), lora_request=LoRARequest(path, 1, other))
    assert b.block_hashes == a.block_hashes
    assert fallbacks() == {}


def test_fallback_overlapping_mm_items(vllm_calls: VllmHashCalls) -> None:
    stock, ours = both_hashers("sha256_cbor", 4)
    features = [_mm("outer", 0, 30), _mm("inner", 5, 3)]
    a, b, (stock_calls, our_calls) = counted_pair(
        stock, ours, list(range(33)), vllm_calls, mm_features=features
    )
    for token in range(9):
        calls = vllm_calls.count
        a.append_output_token_ids(token)
        stock_calls += vllm_calls.count - calls
        calls = vllm_calls.count
        b.append_output_token_ids(token)
        our_calls += vllm_calls.count - calls
    _check_fallback(a, b, "mm_layout", (stock_calls, our_calls))


def test_fallback_token_out_of_range(vllm_calls: VllmHashCalls) -> None:
    stock, ours = both_hashers("sha256_cbor", 4)
    # (a token id past int32 only where vLLM's request can hold one: not in 0.34's buffer)
    prompt = [1, 2, -3, 4, 5, 6, 7, 2**40 if TOKEN_LIMIT > 2**31 else 8, 9]
    a, b, calls = counted_pair(stock, ours, prompt, vllm_calls)
    _check_fallback(a, b, "bad_field", calls)


# Random requests.


def extra_key_kwargs(
    num_tokens: int,
    salt: str | None,
    lora: tuple[str, str] | None,
    gaps: list[tuple[int, int, str]],
) -> dict[str, Any]:
    """A request's extra-key arguments, as decoding a request makes them (fresh string
    objects): multimodal items after the given gaps (none if they run past the prompt)."""
    features, position = [], 0
    for gap, length, identifier in gaps:
        features.append(_mm(fresh(identifier), position + gap, length))
        position += gap + length
    if position > num_tokens:
        features = []
    kwargs: dict[str, Any] = {"cache_salt": salt, "mm_features": features}
    if lora is not None:
        kwargs["lora_request"] = LoRARequest(fresh(lora[0]), 1, fresh(lora[1]))
    return kwargs


features_strategy = st.lists(
    st.tuples(st.integers(0, 12), st.integers(1, 20), st.sampled_from(["i0", "i1", "i2"])),
    max_size=3,
)
#: A random request's hashing configuration and prompt (with :func:`extra_key_kwargs`).
REQUEST_STRATEGIES: dict[str, Any] = {
    "algo": st.sampled_from(ALGORITHMS),
    "block_size": st.sampled_from([1, 2, 3, 4, 16]),
    "prompt": st.lists(st.integers(0, TOKEN_LIMIT - 1), max_size=80),
    "salt": st.sampled_from([None, "", "salt", "é"]),
    "lora": st.sampled_from([None, ("n", "/p"), ("adapter", "x")]),
    "gaps": features_strategy,
    "lookahead": st.sampled_from([0, 0, 1, 2, 3, 5]),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **REQUEST_STRATEGIES,
    appends=st.lists(
        st.lists(st.integers(0, TOKEN_LIMIT - 1), min_size=1, max_size=9), max_size=12
    ),
    truncate_at=st.integers(0, 30),
)
def test_random_requests_match_vllm(
    algo: str,
    block_size: int,
    prompt: list[int],
    appends: list[list[int]],
    salt: str | None,
    lora: tuple[str, str] | None,
    gaps: list[tuple[int, int, str]],
    truncate_at: int,
    lookahead: int,
) -> None:
    kvblocks.vllm.uninstall()
    stock, ours = both_hashers(algo, block_size, lookahead)
    kwargs = extra_key_kwargs(len(prompt), salt, lora, gaps)
    a, b = pair(stock, ours, prompt, **kwargs)
    assert b.block_hashes == a.block_hashes
    for i, tokens in enumerate(appends):
        a.append_output_token_ids(tokens)
        b.append_output_token_ids(tokens)
        if i == len(appends) // 2:
            del a.block_hashes[truncate_at:]
            del b.block_hashes[truncate_at:]
        assert b.block_hashes == a.block_hashes
    assert fallbacks() == {}


# Prompt block hashes computed by a frontend or router (vLLM 0.34's EngineCoreRequest.
# block_hashes), with the engine's PrefixHashConfig.

PrefixHashConfig = getattr(importlib.import_module("vllm.v1.engine"), "PrefixHashConfig", None)
needs_frontend_hashes = pytest.mark.skipif(
    PrefixHashConfig is None,
    reason="vLLM 0.33 takes no frontend block hashes (EngineCoreRequest.block_hashes is "
    "vLLM 0.34's); .ci/run runs this file on vLLM 0.34 too",
)


@needs_frontend_hashes
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **REQUEST_STRATEGIES,
    appends=st.lists(st.lists(st.integers(0, TOKEN_LIMIT - 1), min_size=1, max_size=9), max_size=6),
    as_array=st.booleans(),
)
def test_prompt_block_hasher_gives_the_engines_hashes(
    algo: str,
    block_size: int,
    prompt: list[int],
    appends: list[list[int]],
    salt: str | None,
    lora: tuple[str, str] | None,
    gaps: list[tuple[int, int, str]],
    lookahead: int,
    as_array: bool,
) -> None:
    """kvblocks.vllm.PromptBlockHasher, built from the engine's PrefixHashConfig, gives the
    hashes vLLM's own hasher gives the prompt; vLLM's engine accepts them (their count), and
    a request started with them (kvblocks' hasher continuing) hashes as vLLM's throughout."""
    from vllm.v1.core.kv_cache_utils import frontend_block_hashes

    kvblocks.vllm.uninstall()
    stock, ours = both_hashers(algo, block_size, lookahead)
    config = PrefixHashConfig(
        hash_algo=algo,
        hash_block_size=block_size,
        none_hash=kv_cache_utils.NONE_HASH,
        num_lookahead_tokens=lookahead,
    )
    kwargs = extra_key_kwargs(len(prompt), salt, lora, gaps)
    tokens: Any = np.array(prompt, dtype=np.int32) if as_array else prompt
    computed = kvblocks.vllm.PromptBlockHasher(config).block_hashes(tokens, **kwargs)
    engine = make_request("a", prompt, stock, **kwargs)
    assert computed == engine.block_hashes
    sent = SimpleNamespace(block_hashes=computed, prompt_token_ids=tokens)
    assert frontend_block_hashes(sent, config) == computed  # the engine keeps them
    continued = make_request("b", prompt, ours, block_hashes=list(computed), **kwargs)
    for output in appends:
        engine.append_output_token_ids(output)
        continued.append_output_token_ids(output)
        assert continued.block_hashes == engine.block_hashes
    assert fallbacks() == {}


@needs_frontend_hashes
def test_prompt_block_hasher_declines_where_it_would_not_be_exact() -> None:
    """One string object twice in a pickled algorithm's extra keys: vLLM's pickle writes a
    back-reference kvblocks' encoder does not reproduce, so no hashes (the engine hashes)."""
    path = "/adapters/same"
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    config = PrefixHashConfig(
        hash_algo="sha256",
        hash_block_size=4,
        none_hash=kv_cache_utils.NONE_HASH,
        num_lookahead_tokens=0,
    )
    hasher = kvblocks.vllm.PromptBlockHasher(config)
    assert hasher.block_hashes(list(range(13)), lora_request=LoRARequest(path, 1, path)) is None
    assert hasher.block_hashes(list(range(13)), lora_request=LoRARequest(path, 1, fresh(path)))


def test_prompt_block_hasher_refuses_a_config_it_cannot_follow() -> None:
    good = {
        "hash_algo": "sha256_cbor",
        "hash_block_size": 16,
        "none_hash": bytes(32),
        "num_lookahead_tokens": 0,
    }
    assert kvblocks.vllm.PromptBlockHasher(SimpleNamespace(**good)).block_hashes([1] * 20)
    for field, value, message in [
        ("hash_algo", "md5", "hash_algo must be one of"),
        ("hash_block_size", 0, "hash_block_size must be a positive int"),
        ("num_lookahead_tokens", -1, "num_lookahead_tokens must be an int >= 0"),
        ("none_hash", bytes(16), "none_hash must be the engine's NONE_HASH, 32 bytes"),
        ("none_hash", "x" * 32, "none_hash must be the engine's NONE_HASH"),
    ]:
        with pytest.raises(ValueError, match=message):
            kvblocks.vllm.PromptBlockHasher(SimpleNamespace(**{**good, field: value}))


# Unexpected errors in kvblocks' own code: vLLM's hasher, the error named.


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("simulated bug")


@pytest.mark.parametrize("where", ["_hash_function_names", "_SeededHasher", "_make_hasher"])
def test_an_error_building_the_hasher_falls_back(
    where: str, monkeypatch: pytest.MonkeyPatch, vllm_calls: VllmHashCalls
) -> None:
    """What EngineCore.__init__ calls never raises for kvblocks' part: after vLLM's own hasher
    is built, any error of kvblocks' returns that hasher, counted with the error."""
    monkeypatch.setattr(block_hasher_module, where, _boom)
    stock, ours = both_hashers("sha256", 4)
    assert ours.__module__ == "vllm.v1.core.kv_cache_utils"
    a, b, calls = counted_pair(stock, ours, list(range(13)), vllm_calls)
    assert b.block_hashes == a.block_hashes
    assert fallbacks() == {("hasher", "guard_error"): 1}
    _check_fallback(a, b, "guard_error", calls)
    status = kvblocks.vllm.status()
    assert "hasher" not in status.active
    assert any("RuntimeError: simulated bug" in text for text in status.fallbacks), status


def test_an_error_hashing_a_request_falls_back(
    monkeypatch: pytest.MonkeyPatch, vllm_calls: VllmHashCalls, caplog: pytest.LogCaptureFixture
) -> None:
    """Per request, any error of kvblocks' (here: NONE_HASH lookup at a chain start, and the
    extra keys of a salted request) hashes that request with vLLM's code, naming the error."""
    stock, ours = both_hashers("sha256_cbor", 4)
    _state._logged.clear()  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        # (not monkeypatch.undo(): that would also remove vllm_calls' counter)
        with pytest.MonkeyPatch.context() as chain_start:
            chain_start.setattr(block_hasher_module._SeededHasher, "for_chain_start", _boom)
            a, b, calls = counted_pair(stock, ours, list(range(13)), vllm_calls)
            _check_fallback(a, b, "guard_error", calls)
        monkeypatch.setattr(block_hasher_module, "_extra_key_args", _boom)
        a, b, calls = counted_pair(stock, ours, list(range(13)), vllm_calls, cache_salt="salt")
    _check_fallback(a, b, "guard_error", calls)
    assert fallbacks() == {("hasher", "guard_error"): 2}
    assert any("RuntimeError: simulated bug" in t for t in kvblocks.vllm.status().fallbacks)
    lines = [r for r in caplog.records if "hasher falls back" in r.getMessage()]
    assert len(lines) == 1  # once per reason
    assert lines[0].levelno == logging.WARNING
    assert "RuntimeError: simulated bug" in lines[0].getMessage()


def test_bad_field_fallback_names_the_error(vllm_calls: VllmHashCalls) -> None:
    stock, ours = both_hashers("sha256_cbor", 4)
    a, b, calls = counted_pair(stock, ours, [1, 2, 3, -4, 5], vllm_calls)
    assert b.block_hashes == a.block_hashes
    _check_fallback(a, b, "bad_field", calls)
    (text,) = kvblocks.vllm.status().fallbacks
    assert text.startswith(f"hasher: {reason_text('bad_field')} (")
    assert "Error: " in text  # the error's type and message
