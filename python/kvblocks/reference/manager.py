"""Pure-Python reference for :class:`kvblocks.BlockManager`, written the way vLLM 0.33's
``BlockPool``, ``FreeKVCacheBlockQueue`` and ``KVCacheManager`` work for one full-attention
group: a Python object per block, an intrusive linked list for the free queue, a dict from
hash to blocks. It makes the same decisions as the Rust manager and raises the same errors.

This module holds the manager itself (its request table and the per-request operations); the
rest is split by concept, as in the Rust core: the block pool in :mod:`.pool`, the request
records in :mod:`._requests`, the batched step in :mod:`._step`, token verification in
:mod:`._verify` and the ``BlockStored`` events in :mod:`._events`. Those modules do not import
this one: the step's functions take the manager first (what they use of it is
:class:`._step.StepManager`) and are bound here as its methods; the verifier is an object the
manager owns, and the events are built from what they read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import kvblocks.reference._step as _step
from kvblocks.kv_events import KVCacheEvent
from kvblocks.reference._args import int_arg, one_or_many_token_ids, size_arg, str_arg, token_ids
from kvblocks.reference._events import stored_event
from kvblocks.reference._requests import Request, RequestRef
from kvblocks.reference._verify import TokenVerifier
from kvblocks.reference.hashing import BlockHasher, RequestKeys
from kvblocks.reference.pool import NULL_BLOCK_ID, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvblocks.reference.sequence import TokenSequence
from kvblocks.stats import PrefixCacheStats

__all__ = [
    "NULL_BLOCK_ID",
    "BlockManager",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "RequestRef",
]


def _id_arg(value: Any) -> RequestRef:
    """A request named by its str id or its int handle."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int_arg(value, "request handle")
    raise TypeError(
        f"a request is named by its str id or its int handle, got {type(value).__name__}"
    )


@dataclass
class _Entry:
    request_id: str
    generation: int
    request: Request | None


class BlockManager:
    """The reference for :class:`kvblocks.BlockManager` (same constructor, methods and
    decisions)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.0,
        log_stats: bool = True,
        enable_events: bool = False,
        verify_tokens: bool = False,
        events_use_int_block_hashes: bool = True,
        _debug_key_bytes: int | None = None,
    ) -> None:
        for name, flag in [
            ("enable_caching", enable_caching),
            ("log_stats", log_stats),
            ("enable_events", enable_events),
            ("verify_tokens", verify_tokens),
            ("events_use_int_block_hashes", events_use_int_block_hashes),
        ]:
            if not isinstance(flag, bool | np.bool_):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        num_blocks = int_arg(num_blocks, "num_blocks")
        block_size = size_arg(block_size, "block_size", 1)
        if hash_seed is not None:
            str_arg(hash_seed, "hash_seed")
        self.hasher = BlockHasher(hash_algo, block_size=block_size, seed=hash_seed)
        if max_model_len is not None:
            max_model_len = size_arg(max_model_len, "max_model_len", 1)
        if _debug_key_bytes is not None:
            _debug_key_bytes = size_arg(_debug_key_bytes, "_debug_key_bytes", 1)
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        if num_blocks * block_size > 2**31 - 1:
            raise ValueError(
                f"num_blocks * block_size = {num_blocks} * {block_size} exceeds the int32 "
                f"slot range (at most {(2**31 - 1) // block_size} blocks of {block_size} tokens)"
            )
        if not (math.isfinite(watermark) and watermark >= 0.0):
            raise ValueError(f"watermark must be a finite number >= 0, got {watermark}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len if max_model_len is not None else 2**64
        self.watermark_blocks = int(watermark * num_blocks)
        self.verify_tokens = verify_tokens
        self._debug_key_bytes = _debug_key_bytes
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events)
        self.block_pool.external = (
            (lambda h: int.from_bytes(h[-8:], "big")) if events_use_int_block_hashes else bytes
        )
        # The request table: slots reused most recently freed first; a handle is
        # generation << 32 | slot, so a removed request's handle stays unknown.
        self._entries: list[_Entry] = []
        self._free_slots: list[int] = []
        self._by_id: dict[str, int] = {}
        self._stats = PrefixCacheStats() if log_stats else None
        self._copies: list[tuple[int, int]] = []
        self._verifier = TokenVerifier(block_size, verify_tokens)
        #: The handles of the last step's rows (``sampled_token_ids`` of the next step).
        self._last_rows: list[int] = []

    # ---------------------------------------------------------------- requests

    def _slot(self, ref: RequestRef) -> int:
        if isinstance(ref, str):
            slot = self._by_id.get(ref)
            if slot is None:
                raise KeyError(f"unknown request id {ref!r}")
            return slot
        slot = ref & 0xFFFF_FFFF
        if ref < 0 or slot >= len(self._entries) or self._handle_of(slot) != ref:
            raise KeyError(f"unknown request handle {ref}")
        if self._entries[slot].request is None:
            raise KeyError(f"unknown request handle {ref}")
        return slot

    def _handle_of(self, slot: int) -> int:
        return (self._entries[slot].generation << 32) | slot

    def _request(self, ref: RequestRef) -> Request:
        request = self._entries[self._slot(ref)].request
        assert request is not None
        return request

    def _insert(self, request_id: str, request: Request) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
            entry = self._entries[slot]
            entry.generation = (entry.generation + 1) % 2**31
            entry.request_id, entry.request = request_id, request
        else:
            slot = len(self._entries)
            self._entries.append(_Entry(request_id, 0, request))
        self._by_id[request_id] = slot
        return self._handle_of(slot)

    def handle(self, request_id: RequestRef, /) -> int:
        return self._handle_of(self._slot(_id_arg(request_id)))

    def _check_model_len(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"the request would hold {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Any,
        /,
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Any = None,
    ) -> int:
        request_id = str_arg(request_id, "request_id")
        prompt = token_ids(prompt_token_ids)
        keys = RequestKeys(cache_salt, lora, mm_features)
        if request_id in self._by_id:
            raise KeyError(f"request id {request_id!r} already exists")
        self._check_model_len(len(prompt))
        if not prompt:
            raise ValueError("invalid prompt length (must be >= 1): 0")
        return self._insert(
            request_id, Request(TokenSequence._from_checked(prompt, self.hasher, keys))
        )

    def append_token_ids(self, request_id: RequestRef, token_ids: Any, /) -> None:
        request_id = _id_arg(request_id)
        tokens = one_or_many_token_ids(token_ids)
        request = self._request(request_id)
        self._check_model_len(request.seq.num_tokens + len(tokens))
        request.seq.append_token_ids(tokens)

    def remove_request(self, request_id: RequestRef, /) -> None:
        slot = self._slot(_id_arg(request_id))
        self._free_request(self._request_at(slot))
        entry = self._entries[slot]
        del self._by_id[entry.request_id]
        entry.request = None
        self._free_slots.append(slot)

    def _request_at(self, slot: int) -> Request:
        request = self._entries[slot].request
        assert request is not None
        return request

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_id in self._by_id

    def get_block_ids(self, request_id: RequestRef, /) -> list[int]:
        return [b.block_id for b in self._request(_id_arg(request_id)).blocks]

    def block_hashes(self, request_id: RequestRef, /) -> list[bytes]:
        return self._request(_id_arg(request_id)).seq.block_hashes

    def num_computed_tokens(self, request_id: RequestRef, /) -> int:
        return self._request(_id_arg(request_id)).num_computed_tokens

    def num_tokens(self, request_id: RequestRef, /) -> int:
        return self._request(_id_arg(request_id)).seq.num_tokens

    def get_token_ids(self, request_id: RequestRef, /) -> list[int]:
        return self._request(_id_arg(request_id)).seq.get_token_ids()

    # ---------------------------------------------------------------- lookup

    def _key(self, block_hash: bytes) -> bytes:
        n = self._debug_key_bytes
        if n is None:
            return block_hash
        return block_hash[:n] + bytes(max(len(block_hash) - n, 0))

    def _find_cached(
        self, seq: TokenSequence, index: int, parent: int | None
    ) -> KVCacheBlock | None:
        """The cached block that holds block ``index`` of ``seq`` after block ``parent`` (with
        verify_tokens, the one whose recorded tokens, parent and extra keys match)."""
        hashes = seq.block_hashes
        if index >= len(hashes):
            return None
        candidates = self.block_pool.cached_block_hash_to_block.get(self._key(hashes[index]))
        if not candidates:
            return None
        return self._verifier.find(candidates.values(), seq, index, parent)

    def get_computed_blocks(self, request_id: RequestRef, /) -> tuple[list[int], int]:
        request = self._request(_id_arg(request_id))
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.seq.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for index in range(max_blocks):
            parent = hits[-1].block_id if hits else None
            block = self._find_cached(request.seq, index, parent)
            # A block already in the hit is a key collision, possible only with keys cut
            # short for debugging: one block cannot hold two positions, the hit ends.
            if block is None or (self._debug_key_bytes is not None and block in hits):
                break
            hits.append(block)
        return [b.block_id for b in hits], len(hits) * self.block_size

    # ---------------------------------------------------------------- allocation

    def _check_hits(self, request: Request, hits: list[int], hit_tokens: int) -> None:
        if len(hits) * self.block_size != hit_tokens:
            raise ValueError(
                f"num_new_computed_tokens={hit_tokens} must equal len(new_computed_blocks) * "
                f"block_size = {len(hits) * self.block_size}"
            )
        hashes = request.seq.block_hashes
        parent = None
        for index, block_id in enumerate(hits):
            block = (
                self.block_pool.blocks[block_id]
                if 0 <= block_id < len(self.block_pool.blocks)
                else None
            )
            if (
                block is None
                or block.is_null
                or index >= len(hashes)
                or block.block_hash != self._key(hashes[index])
                or block_id in hits[:index]
                or not self._verifier.matches(request.seq, index, block, parent)
            ):
                raise ValueError(
                    f"new_computed_blocks[{index}] = {block_id} is not the request's cached "
                    f"block {index}; pass what get_computed_blocks returned"
                )
            parent = block_id

    def allocate_slots(
        self,
        request_id: RequestRef,
        num_new_tokens: int,
        /,
        *,
        num_new_computed_tokens: int | None = None,
        new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[int] | None:
        request_id = _id_arg(request_id)
        new = size_arg(num_new_tokens, "num_new_tokens", 0)
        computed = (
            0
            if num_new_computed_tokens is None
            else size_arg(num_new_computed_tokens, "num_new_computed_tokens", 0)
        )
        lookahead = (
            0
            if num_lookahead_tokens is None
            else size_arg(num_lookahead_tokens, "num_lookahead_tokens", 0)
        )
        hit_ids = (
            []
            if new_computed_blocks is None
            else [self._block_id_arg(b) for b in new_computed_blocks]
        )
        request = self._request(request_id)
        num_tokens = request.seq.num_tokens
        self._check_allocation(request, num_tokens, new, computed)
        self._check_hits(request, hit_ids, computed)
        local = request.num_computed_tokens + computed
        b = self.block_size
        pool = self.block_pool
        total = min(local, self.max_model_len)
        need = min(total + new + lookahead, self.max_model_len)
        target = -(-need // b)
        held = len(request.blocks)
        hits = [pool.blocks[i] for i in hit_ids]
        evictable_hits = sum(1 for h in hits if h.ref_cnt == 0)
        first_written = local // b
        last_written = min(-(-(local + new) // b), held)
        cow = [i for i in range(first_written, last_written) if request.blocks[i].ref_cnt > 1]
        # vLLM's watermark rule (docs/semantics.md §3.3): a waiting request is admitted only
        # with the watermark free when any request is scheduled; the embedded scheduler's
        # scheduled requests are exactly those holding blocks.
        has_scheduled_reqs = len(pool.blocks) - 1 > pool.get_num_free_blocks()
        watermark = self.watermark_blocks if has_scheduled_reqs and not request.running else 0
        needed = max(target - (len(hits) + held), 0) + evictable_hits + len(cow)
        if needed + watermark > pool.get_num_free_blocks():
            return None

        # The engine's order: adopt the hits, copy the shared blocks written, then new blocks.
        first_admission = not request.running
        if hits:
            pool.touch(hits)
            request.blocks.extend(hits)
            request.num_cached_blocks = len(request.blocks)
        for index in cow:
            (dst,) = pool.get_new_blocks(1)
            src = request.blocks[index]
            if index * b < local:
                self._copies.append((src.block_id, dst.block_id))
            src.ref_cnt -= 1
            request.blocks[index] = dst
        new_blocks = pool.get_new_blocks(max(target - len(request.blocks), 0))
        request.blocks.extend(new_blocks)
        request.num_computed_tokens = local + new
        request.running = True
        self._cache_blocks(request, min(total + new, num_tokens))
        if first_admission and self.enable_caching and self._stats is not None:
            self._stats.record(num_tokens, computed, request.num_preemptions > 0)
        return [blk.block_id for blk in new_blocks]

    def _check_allocation(
        self,
        request: Request,
        num_tokens: int,
        new: int,
        computed: int,
        *,
        may_be_empty: bool = False,
    ) -> None:
        """The rules every allocation obeys (``allocate_slots`` and the batched step):
        ``num_tokens`` is what the request holds once this call's tokens are appended."""
        if new == 0 and computed == 0 and not may_be_empty:
            raise ValueError("num_new_tokens and num_new_computed_tokens are both 0")
        if computed % self.block_size:
            raise ValueError("num_new_computed_tokens must be a multiple of block_size")
        if computed and (request.running or request.blocks):
            raise ValueError("prefix hits can only be added at a request's first allocation")
        local = request.num_computed_tokens + computed
        if local + new > num_tokens:
            raise ValueError(
                f"cannot schedule {new} new tokens after {local} computed ones: the request "
                f"has {num_tokens} tokens (append them first; drafts are lookahead)"
            )

    @staticmethod
    def _block_id_arg(value: Any) -> int:
        block_id = int_arg(value, "block id")
        if not 0 <= block_id < 2**32:
            raise ValueError(f"block id {block_id} is out of range")
        return block_id

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        hashes = request.seq.block_hashes
        b = self.block_size
        full = min(num_tokens, len(hashes) * b) // b
        done = request.num_cached_blocks
        if done >= full:
            return
        for index in range(done, full):
            block = request.blocks[index]
            if block.block_hash is None and self.verify_tokens:
                parent = request.blocks[index - 1].block_id if index else None
                self._verifier.record(block.block_id, request.seq, index, parent)
            self.block_pool.cache_block(block, self._key(hashes[index]))
        if self.block_pool.kv_event_queue is not None:
            self.block_pool.kv_event_queue.append(
                stored_event(request.seq, done, full, self.block_size, self.block_pool.external)
            )
        request.num_cached_blocks = full

    def free(self, request_id: RequestRef, /) -> None:
        self._free_request(self._request(_id_arg(request_id)))

    def _free_request(self, request: Request) -> None:
        if request.blocks:
            request.num_preemptions += 1
        blocks, request.blocks = request.blocks, []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        request.running = False
        self.block_pool.free_blocks(list(reversed(blocks)))

    def fork(self, parent_id: RequestRef, child_id: str, /) -> int:
        parent_id, child_id = _id_arg(parent_id), str_arg(child_id, "request_id")
        if child_id in self._by_id:
            raise KeyError(f"request id {child_id!r} already exists")
        parent = self._request(parent_id)
        child = Request(
            parent.seq._clone(),
            blocks=list(parent.blocks),
            num_cached_blocks=parent.num_cached_blocks,
            num_computed_tokens=parent.num_computed_tokens,
            running=parent.running,
        )
        handle = self._insert(child_id, child)
        self.block_pool.touch(child.blocks)
        return handle

    # ---------------------------------------------------------------- batched (in _step.py)

    lookup_batch = _step.lookup_batch
    schedule_step = _step.schedule_step

    # ---------------------------------------------------------------- pool-wide

    @property
    def num_blocks(self) -> int:
        return len(self.block_pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self._stats is None:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done:
            self._verifier.clear()
            if self._stats is not None:
                self._stats.reset = True
        return done

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def take_block_copies(self) -> npt.NDArray[np.int32]:
        copies, self._copies = self._copies, []
        return np.array(copies, dtype=np.int32).reshape(len(copies), 2)

    def debug_state(self) -> dict[str, Any]:
        pool = self.block_pool
        return {
            "free_block_ids": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref_counts": [b.ref_cnt for b in pool.blocks],
            "block_keys": [b.block_hash for b in pool.blocks],
            "cached": {k: list(v) for k, v in pool.cached_block_hash_to_block.items()},
            "block_tables": {
                e.request_id: [b.block_id for b in e.request.blocks]
                for e in self._entries
                if e.request is not None
            },
            "handles": {
                e.request_id: self._handle_of(slot)
                for slot, e in enumerate(self._entries)
                if e.request is not None
            },
        }

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_free_blocks={self.num_free_blocks}, num_requests={len(self)})"
        )


if TYPE_CHECKING:
    # The batched step's functions, bound above, take the manager as a StepManager.
    _STEP_MANAGER: type[_step.StepManager] = BlockManager
