"""Deterministic synthetic workloads shared by ``kvblocks bench`` and ``benches/``."""

from __future__ import annotations

import numpy as np

#: Qwen2's vocabulary size: token ids span the 3-byte CBOR and pickle integer forms.
DEFAULT_VOCAB_SIZE = 151_936


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
