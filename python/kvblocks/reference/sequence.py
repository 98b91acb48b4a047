"""Pure-Python reference for :class:`kvblocks.TokenSequence`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.reference._args import one_or_many_token_ids, size_arg, token_ids
from kvblocks.reference.hashing import BlockChain, BlockHasher, RequestKeys


def _read_only(values: list[int]) -> npt.NDArray[np.uint32]:
    array = np.array(values, dtype=np.uint32)
    array.setflags(write=False)
    return array


class TokenSequence:
    """A request's tokens: an immutable prompt, append-only output tokens, and the chained
    hash of every full block."""

    def __init__(
        self,
        prompt_token_ids: Any,
        /,
        *,
        hasher: BlockHasher,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Any = None,
    ) -> None:
        if not isinstance(hasher, BlockHasher):
            raise TypeError(
                f"hasher must be a kvblocks.reference.BlockHasher, got {type(hasher).__name__}"
            )
        prompt = token_ids(prompt_token_ids)
        keys = RequestKeys(cache_salt, lora, mm_features)
        if not prompt:
            raise ValueError("invalid prompt length (must be >= 1): 0")
        self._init(prompt, hasher, keys)

    def _init(self, prompt: list[int], hasher: BlockHasher, keys: RequestKeys) -> None:
        self._hasher = hasher
        self._prompt = tuple(prompt)
        self._prompt_array = _read_only(prompt)
        self._all: list[int] = list(prompt)
        self._chain = BlockChain(hasher, keys)
        self._chain.extend(self._all)

    @classmethod
    def _from_checked(
        cls, prompt: list[int], hasher: BlockHasher, keys: RequestKeys
    ) -> TokenSequence:
        """A sequence from already-validated arguments (for the block manager)."""
        seq = cls.__new__(cls)
        seq._init(prompt, hasher, keys)
        return seq

    def _clone(self) -> TokenSequence:
        """An independent copy with the same tokens and hashes (for forks)."""
        seq = TokenSequence.__new__(TokenSequence)
        seq._hasher = self._hasher
        seq._prompt = self._prompt
        seq._prompt_array = self._prompt_array
        seq._all = list(self._all)
        seq._chain = self._chain.clone()
        return seq

    def append_token_ids(self, token_ids: Any, /) -> None:
        self._all.extend(one_or_many_token_ids(token_ids))
        self._chain.extend(self._all)

    @property
    def hasher(self) -> BlockHasher:
        return self._hasher

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    def __len__(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all) - len(self._prompt)

    @property
    def last_token_id(self) -> int:
        return self._all[-1]

    @property
    def block_hashes(self) -> list[bytes]:
        return list(self._chain.hashes)

    @property
    def num_blocks(self) -> int:
        return len(self._chain.hashes)

    def get_token_ids(self) -> list[int]:
        return list(self._all)

    def get_prefix_token_ids(
        self, num_tokens: int, /
    ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        n = size_arg(num_tokens, "num_tokens", 0)
        if n > len(self._all):
            raise ValueError(f"prefix length {n} is out of range (at most {len(self._all)})")
        if n <= len(self._prompt):
            return self._prompt[:n], None
        return self._prompt, tuple(self._all[len(self._prompt) : n])

    @property
    def prompt_token_ids(self) -> npt.NDArray[np.uint32]:
        return self._prompt_array

    @property
    def output_token_ids(self) -> npt.NDArray[np.uint32]:
        return _read_only(self._all[len(self._prompt) :])

    def __repr__(self) -> str:
        return (
            f"TokenSequence(num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_output_tokens={self.num_output_tokens}, num_blocks={self.num_blocks})"
        )
