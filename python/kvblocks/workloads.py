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
