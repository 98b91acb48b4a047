"""Deterministic synthetic workloads shared by ``kvblocks bench``, ``kvblocks bench-hashing``
and ``benches/``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: Qwen2's vocabulary size: token ids span the 3-byte CBOR and pickle integer forms.
DEFAULT_VOCAB_SIZE = 151_936

# The block-hashing workloads: ``benches/bench_hashing.py`` and the defaults of
# ``kvblocks bench-hashing``.

#: Lengths of the prompts hashed whole.
HASHING_PROMPT_LENGTHS = (1024, 8192, 32768)
#: Tokens per block.
HASHING_BLOCK_SIZE = 16
#: The hashers' NONE_HASH seed.
HASHER_SEED = "bench"
#: Tokens the decode workload grows a sequence to, one token per call ...
DECODE_LENGTH = 4096
#: ... from a prompt of this many tokens.
DECODE_PROMPT_LENGTH = 16


def random_prompt(
    num_tokens: int, *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[int]:
    """``num_tokens`` token ids drawn uniformly from the vocabulary, as a list of ints (what a
    tokenizer hands an engine)."""
    rng = np.random.default_rng(seed)
    tokens: list[int] = rng.integers(0, vocab_size, size=num_tokens).tolist()
    return tokens


def shared_prefix_prompts(
    num_requests: int, prefix_len: int, suffix_len: int, *, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[list[int]]:
    """``num_requests`` prompts: one shared ``prefix_len``-token prefix, then ``suffix_len``
    tokens of each request's own (the ``kvblocks bench`` workload)."""
    prefix = random_prompt(prefix_len, seed=1, vocab_size=vocab_size)
    return [
        prefix + random_prompt(suffix_len, seed=100 + i, vocab_size=vocab_size)
        for i in range(num_requests)
    ]


def hashing_prompt(num_tokens: int) -> list[int]:
    """The tokens of a hashing workload of ``num_tokens`` tokens (a prompt hashed whole, or
    the decode workload's whole sequence): seed 0 whatever the length."""
    return random_prompt(num_tokens, seed=0)


def hashing_hasher(module: Any, algo: str, *, block_size: int = HASHING_BLOCK_SIZE) -> Any:
    """The ``BlockHasher`` of the hashing workloads, from ``module`` (``kvblocks`` or its
    pure-Python reference ``kvblocks.reference``)."""
    return module.BlockHasher(algo, block_size=block_size, seed=HASHER_SEED)


def decode_workload(
    module: Any, hasher: Any, num_tokens: int = DECODE_LENGTH
) -> Callable[[], None]:
    """The decode workload: a ``module.TokenSequence`` of ``hasher`` starts from a
    ``DECODE_PROMPT_LENGTH``-token prompt and grows to ``num_tokens`` tokens one token per
    call, as a decode loop does. Returns the timed call."""
    tokens = hashing_prompt(num_tokens)

    def decode() -> None:
        seq = module.TokenSequence(tokens[:DECODE_PROMPT_LENGTH], hasher=hasher)
        for t in tokens[DECODE_PROMPT_LENGTH:]:
            seq.append_token_ids(t)

    return decode
