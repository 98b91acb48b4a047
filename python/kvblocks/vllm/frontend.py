"""Prompt block hashes computed outside vLLM's engine core, as the engine would compute them.

vLLM 0.34 lets a frontend send a request's prompt block hashes with it
(``EngineCoreRequest.block_hashes``): the engine core then starts the request with them and
hashes only the blocks after them, so that hashing a long prompt leaves the engine core's
thread. The hashes must be the engine's own: computed with its ``PrefixHashConfig`` (the
algorithm, the block size, NONE_HASH and the lookahead), which the engine core reports, and
as many as the engine would hash from the prompt (vLLM drops them otherwise, and hashes the
prompt itself).

:class:`PromptBlockHasher` computes them with kvblocks' Rust hasher, byte for byte vLLM's, for
a frontend or for a router that forwards them to the replica it picks. Where kvblocks would not
be byte-identical to the engine's hasher (the cases where the plugin's hasher falls back to
vLLM's: prompt embeddings, a multimodal layout vLLM resumes differently, strings whose pickle
identity differs) it returns None: send no hashes, and the engine hashes the prompt itself.
It imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvblocks._core import BlockHasher
from kvblocks.vllm.block_hasher import _PICKLED, ALGORITHMS, _extra_key_args

__all__ = ["PromptBlockHasher"]


class PromptBlockHasher:
    """The prompt block hashes a vLLM engine core computes, for one engine configuration.

    ``prefix_hash_config`` is vLLM's ``PrefixHashConfig`` (``vllm.v1.engine``), or any object
    with its four fields: ``hash_algo`` (one of ``sha256``, ``sha256_cbor``, ``xxhash``,
    ``xxhash_cbor``), ``hash_block_size``, ``none_hash`` (the engine's NONE_HASH, bytes) and
    ``num_lookahead_tokens``.
    """

    __slots__ = ("_hasher", "_lookahead", "_none_hash", "_pickled")

    def __init__(self, prefix_hash_config: Any) -> None:
        config = prefix_hash_config
        algo = config.hash_algo
        if algo not in ALGORITHMS:
            raise ValueError(f"hash_algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
        block_size = config.hash_block_size
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"hash_block_size must be a positive int, got {block_size!r}")
        lookahead = config.num_lookahead_tokens
        if type(lookahead) is not int or lookahead < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {lookahead!r}")
        hasher = BlockHasher(algo, block_size=block_size)
        none_hash = config.none_hash
        if not isinstance(none_hash, bytes) or len(none_hash) != hasher.digest_size:
            raise ValueError(
                f"none_hash must be the engine's NONE_HASH, {hasher.digest_size} bytes for "
                f"{algo}, got {none_hash!r}"
            )
        self._hasher = hasher
        self._none_hash = none_hash
        self._lookahead = lookahead
        self._pickled = algo in _PICKLED

    def block_hashes(
        self,
        prompt_token_ids: Sequence[int] | Any,
        *,
        lora_request: Any = None,
        cache_salt: str | None = None,
        mm_features: Sequence[Any] | None = None,
    ) -> list[bytes] | None:
        """The hashes of the prompt's full blocks (a block counts once its lookahead tokens
        are in the prompt too), as the engine core would compute them, or None where kvblocks
        would not be byte-identical (send none then). ``prompt_token_ids`` is a list or an
        int32 array; the other arguments are the request's (``EngineCoreRequest``'s fields of
        those names: a ``LoRARequest``, the cache salt, the ``MultiModalFeatureSpec`` list)."""
        request = SimpleNamespace(
            lora_request=lora_request, cache_salt=cache_salt, mm_features=mm_features
        )
        keys: dict[str, Any] = {}
        if lora_request or cache_salt or mm_features:
            found = _extra_key_args(request, self._pickled)
            if not isinstance(found, dict):
                return None
            keys = found
        return self._hasher.hash_blocks(
            prompt_token_ids,
            parent=self._none_hash,
            num_lookahead_tokens=self._lookahead,
            **keys,
        )
