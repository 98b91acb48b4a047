"""kvblocks' request block hasher for vLLM 0.33 and 0.34: a drop-in for
``vllm.v1.core.kv_cache_utils.get_request_block_hasher``.

vLLM calls the returned function with a ``Request`` when the request is built and after every
``append_output_token_ids``; it returns the hashes of the blocks that became full since
``request.block_hashes`` was last extended. This one keeps no state per request: it starts at
``len(request.block_hashes)`` and chains from ``request.block_hashes[-1]``, so it follows the
scheduler when it truncates that list. With lookahead hashing (EAGLE/MTP,
``num_hash_lookahead_tokens = L``) a block is hashed only once the ``L`` tokens after it exist,
so the same rule holds: every hash in the list is final. The tokens are read in Rust straight
from the request's token list, from the first unhashed block on; the only Python objects made
per block are the ``bytes`` hashes vLLM keeps.

Wherever kvblocks would not produce vLLM's exact bytes, the request is hashed by vLLM's own
hasher instead (see ``kvblocks.vllm._state.REASONS``), and the reason is logged once per process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvblocks.vllm._state as _state
import kvblocks.vllm.fingerprints as fingerprints
from kvblocks._core import BlockHasher
from kvblocks.vllm._state import Reason

#: vLLM's hash functions (``vllm.utils.hashing``) by the kvblocks algorithm of the same name.
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: The algorithms that serialize with pickle, whose bytes depend on object identity.
_PICKLED = frozenset({"sha256", "xxhash"})
#: The tag strings of vLLM's extra keys: a key string equal to one may be the same interned
#: object, which pickle would write as a back-reference.
_TAGS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})

#: The part of kvblocks this module is (the name ``status()`` reports it under).
_PART = "hasher"

Request = Any
RequestBlockHasher = Callable[[Request], list[bytes]]


def _hash_function_names() -> dict[Callable[[Any], bytes], str]:
    """vLLM's function for each algorithm kvblocks implements, as vLLM itself names them."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return {get_hash_fn_by_name(name): name for name in ALGORITHMS}


class _SeededHasher:
    """The kvblocks ``BlockHasher`` whose NONE_HASH is vLLM's current one.

    vLLM keeps NONE_HASH in a module global that ``init_none_hash`` may set again (a second
    engine in the process; with the xxhash algorithms, a new random seed each time), and its
    own hasher reads it at every call. So this one checks it whenever a chain starts at block 0.
    """

    __slots__ = ("_algo", "_block_size", "_hasher", "_kv_cache_utils")

    def __init__(self, algo: str, block_size: int) -> None:
        from vllm.v1.core import kv_cache_utils

        self._algo = algo
        self._block_size = block_size
        self._kv_cache_utils = kv_cache_utils
        self._hasher: BlockHasher | None = None

    def for_chain_start(self) -> BlockHasher | None:
        """The hasher for a chain that starts at NONE_HASH, or None if kvblocks cannot
        reproduce vLLM's NONE_HASH."""
        none_hash = getattr(self._kv_cache_utils, "NONE_HASH", None)
        hasher = self._hasher
        if hasher is not None and hasher.none_hash == none_hash:
            return hasher
        seed = self._kv_cache_utils.get_none_hash_seed()
        hasher = BlockHasher(self._algo, block_size=self._block_size, seed=seed)
        if none_hash is None or hasher.none_hash != none_hash:
            return None
        self._hasher = hasher
        return hasher

    def any(self) -> BlockHasher:
        """The hasher for a chain that continues from a parent (NONE_HASH is not read)."""
        if self._hasher is None:
            seed = self._kv_cache_utils.get_none_hash_seed()
            self._hasher = BlockHasher(self._algo, block_size=self._block_size, seed=seed)
        return self._hasher


def _pickle_identity_ok(strings: list[Any]) -> bool:
    """True when pickle's memo (by object identity) treats these strings as kvblocks' encoder
    assumes: equal empty or one-character latin-1 strings are one shared object, other equal
    strings are distinct objects, and no string is a tag (which vLLM writes as an interned
    literal). Strings whose value occurs once are fine whatever their identity."""
    first_seen: dict[str, list[Any]] = {}
    for s in strings:
        if type(s) is not str or s in _TAGS:
            return False
        first_seen.setdefault(s, []).append(s)
    for value, objects in first_seen.items():
        if len(objects) == 1:
            continue
        ids = {id(o) for o in objects}
        shared = len(value) == 0 or (len(value) == 1 and ord(value) < 256)
        if len(ids) != (1 if shared else len(objects)):
            return False
    return True


def _extra_key_args(request: Request, pickled: bool) -> dict[str, Any] | Reason:
    """The ``cache_salt`` / ``lora`` / ``mm_features`` arguments of ``hash_blocks`` for a
    request with extra keys, or the reason it must fall back."""
    strings: list[Any] = []
    lora = None
    lora_request = request.lora_request
    if lora_request:
        lora = (lora_request.lora_name, lora_request.lora_path)
        strings += lora
    salt = request.cache_salt or None
    if salt is not None:
        strings.append(salt)
    features = None
    if request.mm_features:
        features = []
        previous_end = 0
        for feature in request.mm_features:
            position = feature.mm_position
            offset, length = position.offset, position.length
            end = offset + length
            # vLLM finds where to resume with a bisection on item ends: it agrees with a
            # scan from the first item only when the ends are sorted too.
            if end < previous_end:
                return Reason.MM_LAYOUT
            previous_end = end
            features.append((feature.identifier, offset, length))
            strings.append(feature.identifier)
    if pickled and not _pickle_identity_ok(strings):
        return Reason.PICKLE_IDENTITY
    return {"cache_salt": salt, "lora": lora, "mm_features": features}


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> RequestBlockHasher:
    """vLLM's ``get_request_block_hasher``, on kvblocks where it is exact.

    vLLM's own hasher is built first (an error there is vLLM's, as without kvblocks); after
    that nothing kvblocks does raises: an unexpected error returns vLLM's hasher, counted as
    ``guard_error`` with the error."""
    from vllm.v1.core import kv_cache_utils

    vllm_factory = _state.original_or_current(kv_cache_utils, "get_request_block_hasher")
    stock: RequestBlockHasher = vllm_factory(
        hash_block_size, caching_hash_fn, num_hash_lookahead_tokens
    )
    try:
        return _kvblocks_hasher(stock, hash_block_size, caching_hash_fn, num_hash_lookahead_tokens)
    except Exception as error:  # never break vLLM's start-up: vLLM's hasher
        _state.fall_back(_PART, Reason.GUARD_ERROR, _state.error_detail(error))
        return stock


def _kvblocks_hasher(
    stock: RequestBlockHasher,
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    lookahead: int,
) -> RequestBlockHasher:
    """kvblocks' hasher for these arguments, or ``stock`` (counting why) where kvblocks
    would not be exact."""
    stale = fingerprints.check().get(_PART)
    if stale is not None:  # not the vLLM sources kvblocks' hasher was ported from
        _state.fall_back(_PART, *stale)
        return stock
    if type(lookahead) is not int or lookahead < 0:
        _state.fall_back(_PART, Reason.BAD_FIELD, f"num_hash_lookahead_tokens={lookahead!r}")
        return stock
    algo = _hash_function_names().get(caching_hash_fn)
    if algo is None:
        _state.fall_back(_PART, Reason.HASH_FN)
        return stock
    seeded = _SeededHasher(algo, hash_block_size)
    if seeded.for_chain_start() is None:
        _state.fall_back(_PART, Reason.NONE_HASH)
        return stock
    hasher = _make_hasher(stock, seeded, hash_block_size, algo in _PICKLED, lookahead)
    _state.activate(_PART, f"{algo}, {lookahead} lookahead tokens" if lookahead else algo)
    return hasher


def _make_hasher(
    stock: RequestBlockHasher,
    seeded: _SeededHasher,
    block_size: int,
    pickled: bool,
    lookahead: int,
) -> RequestBlockHasher:
    fall_back = _state.fall_back
    error_detail = _state.error_detail

    def request_block_hasher(request: Request) -> list[bytes]:
        # Everything kvblocks does is inside the try: whatever goes wrong, vLLM's hasher
        # answers. vLLM's own hasher runs outside it (its errors are vLLM's).
        detail = None
        try:
            hashes = request.block_hashes
            tokens = request._all_token_ids
            num_hashed = len(hashes)
            if (num_hashed + 1) * block_size + lookahead > len(tokens):
                return []  # no new hashable block: the common decode step
            if request.prompt_embeds is not None:
                reason = Reason.PROMPT_EMBEDS
            else:
                parent = hashes[-1] if num_hashed else None
                hasher = seeded.any() if num_hashed else seeded.for_chain_start()
                if hasher is None:
                    reason = Reason.NONE_HASH
                elif request.lora_request or request.cache_salt or request.mm_features:
                    keys = _extra_key_args(request, pickled)
                    if not isinstance(keys, Reason):
                        return hasher.hash_blocks(
                            tokens,
                            parent=parent,
                            start_block=num_hashed,
                            num_lookahead_tokens=lookahead,
                            **keys,
                        )
                    reason = keys
                else:
                    return hasher.hash_blocks(
                        tokens,
                        parent=parent,
                        start_block=num_hashed,
                        num_lookahead_tokens=lookahead,
                    )
        except (TypeError, ValueError, OverflowError, AttributeError) as error:
            # a field kvblocks cannot read (a token id out of range, a non-str key, ...)
            reason, detail = Reason.BAD_FIELD, error_detail(error)
        except Exception as error:
            reason, detail = Reason.GUARD_ERROR, error_detail(error)
        fall_back(_PART, reason, detail)
        return stock(request)

    return request_block_hasher
