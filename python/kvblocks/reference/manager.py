"""Pure-Python twin of :class:`kvblocks.BlockManager`, written the way vLLM 0.33's
``BlockPool``, ``FreeKVCacheBlockQueue`` and ``KVCacheManager`` work for one full-attention
group: a Python object per block, an intrusive linked list for the free queue, a dict from
hash to blocks. It makes the same decisions as the Rust manager and raises the same errors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvblocks.reference._args import int_arg, one_or_many_token_ids, size_arg, str_arg, token_ids
from kvblocks.reference.hashing import (
    LORA,
    MM,
    BlockHasher,
    ExtraKeys,
    RequestKeys,
)
from kvblocks.reference.sequence import TokenSequence
from kvblocks.stats import PrefixCacheStats
from kvblocks.step import ScheduledStep, StepBuffers

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One physical block: reference count, cache key and free-queue links."""

    __slots__ = (
        "block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail, in eviction order."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        previous = self.fake_head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is None or block is self.fake_tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in reversed(blocks):
            first = self.fake_head.next_free_block
            assert first is not None
            block.prev_free_block = self.fake_head
            block.next_free_block = first
            first.prev_free_block = block
            self.fake_head.next_free_block = block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Blocks, the free queue, the hash-to-blocks map and the event queue."""

    def __init__(self, num_blocks: int, enable_caching: bool, enable_events: bool) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Key -> {block_id: block}, earliest first; several blocks may share a key.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_caching = enable_caching
        self.kv_event_queue: list[KVCacheEvent] | None = [] if enable_events else None
        self.evicted: list[int] | None = None  # recorded during a batched step
        self.external: Any = None  # set by the manager: bytes -> external event hash

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        usable = len(self.blocks) - 1
        return 0.0 if usable == 0 else 1.0 - self.get_num_free_blocks() / usable

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is None:
            return
        block.block_hash = None
        entry = self.cached_block_hash_to_block.get(key)
        if entry is None or entry.pop(block.block_id, None) is None:
            return
        if not entry:
            del self.cached_block_hash_to_block[key]
        if self.evicted is not None:
            self.evicted.append(block.block_id)
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(BlockRemoved(block_hashes=[self.external(key)]))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        front, back = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_hash is not None:
                    back.append(block)
                else:
                    front.append(block)
        self.free_block_queue.prepend_n(front)
        for block in back:
            self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, key: bytes) -> None:
        if block.block_hash is not None or block.is_null:
            return
        block.block_hash = key
        self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        if len(self.blocks) - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if self.kv_event_queue is None:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events


@dataclass
class _Request:
    seq: TokenSequence
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_computed_tokens: int = 0
    running: bool = False
    num_preemptions: int = 0


@dataclass
class _Provenance:
    tokens: tuple[int, ...]
    parent: int | None
    keys: ExtraKeys


def _i64s(obj: Any, what: str) -> list[int]:
    """An int64-valued 1-D array argument as a list (the native glue's rules)."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 1:
            raise ValueError(f"{what} must be 1-D")
        if obj.dtype.kind not in "iu":
            raise TypeError(f"{what} must have an integer dtype")
        obj = obj.tolist()
    return [int_arg(v, what) for v in obj]


def _checked_buffers(buffers: Any) -> tuple[Any, Any, Any, Any]:
    arrays = (
        buffers.block_table,
        buffers.slot_mapping,
        buffers.seq_lens,
        buffers.query_start_loc,
    )
    names = ("block_table", "slot_mapping", "seq_lens", "query_start_loc")
    for array, name, ndim in zip(arrays, names, (2, 1, 1, 1), strict=True):
        if not isinstance(array, np.ndarray) or array.dtype != np.int32 or array.ndim != ndim:
            raise TypeError(f"out.{name} must be a {ndim}-D int32 numpy array")
    for array in arrays:
        if not array.flags.writeable:
            raise ValueError("output buffers must be writeable")
        if not array.flags.c_contiguous:
            raise ValueError("output buffers must be C-contiguous")
    return arrays


def _untagged(key: tuple[Any, ...]) -> Any:
    if key[0] == LORA:
        return key[1]
    if key[0] == MM:
        return (key[1], key[2])
    return key[1]  # cache salt or prompt-embeds digest


RequestRef = str | int


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
    request: _Request | None


class BlockManager:
    """The twin of :class:`kvblocks.BlockManager` (same constructor, methods and decisions)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        /,
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
        num_blocks = size_arg(num_blocks, "num_blocks", 1)
        block_size = size_arg(block_size, "block_size", 1)
        if hash_seed is not None:
            str_arg(hash_seed, "hash_seed")
        self.hasher = BlockHasher(hash_algo, block_size=block_size, seed=hash_seed)
        if max_model_len is not None:
            max_model_len = size_arg(max_model_len, "max_model_len", 1)
        if _debug_key_bytes is not None:
            _debug_key_bytes = size_arg(_debug_key_bytes, "_debug_key_bytes", 1)
        if num_blocks >= 2**32 - 1:
            raise ValueError(f"invalid num_blocks: {num_blocks}")
        if num_blocks * block_size > 2**31 - 1:
            raise ValueError(
                f"num_blocks * block_size = {num_blocks} * {block_size} exceeds the int32 "
                "slot range"
            )
        if not 0.0 <= watermark <= 1.0:
            raise ValueError(f"watermark must be in [0, 1], got {watermark}")
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
        self._provenance: dict[int, _Provenance] = {}

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

    def _request(self, ref: RequestRef) -> _Request:
        request = self._entries[self._slot(ref)].request
        assert request is not None
        return request

    def _insert(self, request_id: str, request: _Request) -> int:
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
            request_id, _Request(TokenSequence._from_checked(prompt, self.hasher, keys))
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

    def _request_at(self, slot: int) -> _Request:
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

    def _block_tokens(self, seq: TokenSequence, index: int) -> tuple[int, ...]:
        b = self.block_size
        return tuple(seq._all[index * b : (index + 1) * b])

    def _block_keys(self, seq: TokenSequence, index: int) -> ExtraKeys:
        keys = seq._chain.keys
        if keys.is_empty():
            return None
        b = self.block_size
        return keys.block_extra_keys(index * b, (index + 1) * b, 0)[0]

    def _provenance_matches(
        self, seq: TokenSequence, index: int, block: KVCacheBlock, parent: int | None
    ) -> bool:
        if not self.verify_tokens:
            return True
        p = self._provenance.get(block.block_id)
        return (
            p is not None
            and p.parent == parent
            and p.tokens == self._block_tokens(seq, index)
            and p.keys == self._block_keys(seq, index)
        )

    def _find_cached(
        self, seq: TokenSequence, index: int, parent: int | None
    ) -> KVCacheBlock | None:
        hashes = seq.block_hashes
        if index >= len(hashes):
            return None
        candidates = self.block_pool.cached_block_hash_to_block.get(self._key(hashes[index]))
        if not candidates:
            return None
        for block in candidates.values():
            if self._provenance_matches(seq, index, block, parent):
                return block
        return None

    def get_computed_blocks(self, request_id: RequestRef, /) -> tuple[list[int], int]:
        request = self._request(_id_arg(request_id))
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.seq.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for index in range(max_blocks):
            parent = hits[-1].block_id if hits else None
            block = self._find_cached(request.seq, index, parent)
            if block is None:
                break
            hits.append(block)
        return [b.block_id for b in hits], len(hits) * self.block_size

    # ---------------------------------------------------------------- allocation

    def _check_hits(self, request: _Request, hits: list[int], hit_tokens: int) -> None:
        if len(hits) * self.block_size != hit_tokens:
            raise ValueError(
                f"num_new_computed_tokens={hit_tokens} must equal len(new_computed_blocks) * "
                f"block_size = {len(hits) * self.block_size}"
            )
        if not hits:
            return
        if request.running or request.blocks:
            raise ValueError("prefix hits can only be added at a request's first allocation")
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
                or not self._provenance_matches(request.seq, index, block, parent)
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
        if new == 0 and computed == 0:
            raise ValueError("num_new_tokens and num_new_computed_tokens are both 0")
        self._check_hits(request, hit_ids, computed)
        local = request.num_computed_tokens + computed
        num_tokens = request.seq.num_tokens
        if local + new > num_tokens:
            raise ValueError(
                f"cannot schedule {new} new tokens after {local} computed ones: the request "
                f"has {num_tokens} tokens (append them first; drafts are lookahead)"
            )
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
        in_use = len(pool.blocks) - 1 - pool.get_num_free_blocks()
        watermark = self.watermark_blocks if not request.running and in_use > 0 else 0
        needed = max(target - (len(hits) + held), 0) + evictable_hits + len(cow)
        if needed + watermark > pool.get_num_free_blocks():
            return None

        first_admission = not request.running
        for index in cow:
            (dst,) = pool.get_new_blocks(1)
            src = request.blocks[index]
            if index * b < local:
                self._copies.append((src.block_id, dst.block_id))
            src.ref_cnt -= 1
            request.blocks[index] = dst
        if hits:
            pool.touch(hits)
            request.blocks.extend(hits)
            request.num_cached_blocks = len(request.blocks)
        new_blocks = pool.get_new_blocks(max(target - len(request.blocks), 0))
        request.blocks.extend(new_blocks)
        request.num_computed_tokens = local + new
        request.running = True
        self._cache_blocks(request, min(total + new, num_tokens))
        if first_admission and self.enable_caching and self._stats is not None:
            self._stats.record(num_tokens, computed, request.num_preemptions > 0)
        return [blk.block_id for blk in new_blocks]

    @staticmethod
    def _block_id_arg(value: Any) -> int:
        block_id = int_arg(value, "block id")
        if not 0 <= block_id < 2**32:
            raise ValueError(f"block id {block_id} is out of range")
        return block_id

    def _cache_blocks(self, request: _Request, num_tokens: int) -> None:
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
                self._provenance[block.block_id] = _Provenance(
                    self._block_tokens(request.seq, index),
                    parent,
                    self._block_keys(request.seq, index),
                )
            self.block_pool.cache_block(block, self._key(hashes[index]))
        if self.block_pool.kv_event_queue is not None:
            self.block_pool.kv_event_queue.append(self._stored_event(request.seq, done, full))
        request.num_cached_blocks = full

    def _stored_event(self, seq: TokenSequence, done: int, full: int) -> BlockStored:
        hashes = seq.block_hashes
        external = self.block_pool.external
        extra_keys: list[tuple[Any, ...] | None] = []
        for index in range(done, full):
            keys = self._block_keys(seq, index)
            extra_keys.append(None if keys is None else tuple(_untagged(k) for k in keys))
        lora = seq._chain.keys.lora
        b = self.block_size
        return BlockStored(
            block_hashes=[external(h) for h in hashes[done:full]],
            parent_block_hash=external(hashes[done - 1]) if done else None,
            token_ids=seq.get_token_ids()[done * b : full * b],
            block_size=b,
            lora_name=lora[0] if lora is not None else None,
            extra_keys=extra_keys or None,
        )

    def free(self, request_id: RequestRef, /) -> None:
        self._free_request(self._request(_id_arg(request_id)))

    def _free_request(self, request: _Request) -> None:
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
        child = _Request(
            parent.seq._clone(),
            blocks=list(parent.blocks),
            num_cached_blocks=parent.num_cached_blocks,
            num_computed_tokens=parent.num_computed_tokens,
            running=parent.running,
        )
        handle = self._insert(child_id, child)
        self.block_pool.touch(child.blocks)
        return handle

    # ---------------------------------------------------------------- batched

    def lookup_batch(self, handles: Any, /) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        found = [self.get_computed_blocks(h) for h in _i64s(handles, "handles")]
        return (
            np.array([len(blocks) for blocks, _ in found], dtype=np.int32),
            np.array([n for _, n in found], dtype=np.int32),
        )

    def _plan_step(
        self,
        handles: list[int],
        new: list[int],
        hits: list[int] | None,
        tokens: list[int],
        offsets: list[int] | None,
        lookahead: int,
        lookup: list[int] | None = None,
    ) -> tuple[list[int], int, int]:
        """The checks of the native ``plan_step``, in the same order; returns the slots, the
        widest block table after the step and the most tokens it can schedule."""
        n, b = len(handles), self.block_size
        for values, what in (
            (new, "num_new_tokens"),
            (hits, "num_new_computed_tokens"),
            (lookup, "prefix_lookup"),
        ):
            if values is not None and len(values) != n:
                raise ValueError(f"{what} has {len(values)} entries for {n} requests")
        if offsets is None:
            if tokens:
                raise ValueError("new_token_ids needs new_token_offsets")
        elif not (
            len(offsets) == n + 1
            and offsets[0] == 0
            and all(a <= c for a, c in itertools.pairwise(offsets))
            and offsets[-1] == len(tokens)
        ):
            raise ValueError(
                "new_token_offsets must have one entry per request plus one, start at 0, never "
                "decrease and end at len(new_token_ids)"
            )
        slots = [self._slot(h) for h in handles]
        if len(set(slots)) != len(slots):
            raise ValueError("a request appears twice in one step")
        max_blocks = max_tokens = 0
        for i, slot in enumerate(slots):
            request = self._request_at(slot)
            count, hit = new[i], hits[i] if hits is not None else 0
            if count < 0:
                raise ValueError(f"num_new_tokens must be >= 0, got {count}")
            if hit < 0:
                raise ValueError(f"num_new_computed_tokens must be >= 0, got {hit}")
            appended = offsets[i + 1] - offsets[i] if offsets is not None else 0
            num_tokens = request.seq.num_tokens + appended
            self._check_model_len(num_tokens)
            if count == 0 and hit == 0:
                raise ValueError("num_new_tokens and num_new_computed_tokens are both 0")
            if hit % b:
                raise ValueError("num_new_computed_tokens must be a multiple of block_size")
            if hit and (request.running or request.blocks):
                raise ValueError("prefix hits can only be added at a request's first allocation")
            looks_up = lookup is not None and lookup[i] != 0
            if looks_up and (hit or request.running or request.blocks):
                raise ValueError("prefix_lookup is for admissions without num_new_computed_tokens")
            if looks_up:
                count = min(count, num_tokens - request.num_computed_tokens)
            local = request.num_computed_tokens + hit
            if local + count > num_tokens:
                raise ValueError(
                    f"cannot schedule {count} new tokens after {local} computed ones: the "
                    f"request has {num_tokens} tokens (append them first; drafts are lookahead)"
                )
            reach = num_tokens if looks_up else min(local, self.max_model_len) + count
            need = min(reach + lookahead, self.max_model_len)
            max_blocks = max(max_blocks, -(-need // b), len(request.blocks) + hit // b)
            max_tokens += count
        return slots, max_blocks, max_tokens

    def schedule_step(
        self,
        handles: Any,
        num_new_tokens: Any,
        /,
        *,
        num_new_computed_tokens: Any = None,
        prefix_lookup: Any = None,
        num_lookahead_tokens: int | None = None,
        new_token_ids: Any = None,
        new_token_offsets: Any = None,
        out: StepBuffers | None = None,
    ) -> ScheduledStep:
        """The batched step, defined as the per-request calls it stands for: append each
        request's accepted tokens, then in order look up (for admissions with hits) and
        allocate, stopping at the first request that does not fit."""
        handle_list = _i64s(handles, "handles")
        new = _i64s(num_new_tokens, "num_new_tokens")
        hits = (
            None
            if num_new_computed_tokens is None
            else _i64s(num_new_computed_tokens, "num_new_computed_tokens")
        )
        lookahead = (
            0
            if num_lookahead_tokens is None
            else size_arg(num_lookahead_tokens, "num_lookahead_tokens", 0)
        )
        lookup = None
        if prefix_lookup is not None:
            mask = np.asarray(prefix_lookup)
            lookup = _i64s(
                mask.astype(np.int64) if mask.dtype.kind == "b" else mask, "prefix_lookup"
            )
        tokens = [] if new_token_ids is None else token_ids(new_token_ids)
        offsets = (
            None if new_token_offsets is None else _i64s(new_token_offsets, "new_token_offsets")
        )
        slots, max_blocks, max_tokens = self._plan_step(
            handle_list, new, hits, tokens, offsets, lookahead, lookup
        )
        n, b = len(slots), self.block_size
        buffers = out if out is not None else StepBuffers.allocate(n, max_tokens, max_blocks)
        table, slot_mapping, seq_lens, starts = _checked_buffers(buffers)
        if not (
            table.shape[1] >= max_blocks
            and table.shape[0] >= n
            and len(slot_mapping) >= max_tokens
            and len(seq_lens) >= n
            and len(starts) > n
        ):
            raise ValueError(
                f"output buffers too small: this step needs {n} block-table rows of {max_blocks} "
                f"columns, {max_tokens} slots, {n} seq_lens and {n + 1} query_start_loc entries"
            )
        refs = [self._handle_of(slot) for slot in slots]
        if offsets is not None:
            for i, ref in enumerate(refs):
                self._request(ref).seq.append_token_ids(tokens[offsets[i] : offsets[i + 1]])
        copies_before = len(self._copies)
        self.block_pool.evicted = []
        scheduled = cursor = 0
        starts[0] = 0
        for i, ref in enumerate(refs):
            hit = hits[i] if hits is not None else 0
            count = new[i]
            blocks_hit: list[int] = []
            if lookup is not None and lookup[i]:
                blocks_hit, hit = self.get_computed_blocks(ref)
                count = min(count, self.num_tokens(ref) - self.num_computed_tokens(ref) - hit)
            elif hit:
                blocks_hit = self.get_computed_blocks(ref)[0]
                if len(blocks_hit) < hit // b:
                    break
                blocks_hit = blocks_hit[: hit // b]
            allocated = self.allocate_slots(
                ref,
                count,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks_hit,
                num_lookahead_tokens=lookahead,
            )
            if allocated is None:
                break
            blocks = self.get_block_ids(ref)
            table[i, :] = 0
            table[i, : len(blocks)] = blocks
            end = self.num_computed_tokens(ref)
            for position in range(end - count, end):
                slot_mapping[cursor] = blocks[position // b] * b + position % b
                cursor += 1
            seq_lens[i] = end
            starts[i + 1] = cursor
            scheduled += 1
        copies, self._copies = self._copies[copies_before:], self._copies[:copies_before]
        evicted, self.block_pool.evicted = self.block_pool.evicted, None
        return ScheduledStep(
            num_scheduled=scheduled,
            num_scheduled_tokens=cursor,
            block_table=table[:scheduled],
            slot_mapping=slot_mapping[:cursor],
            seq_lens=seq_lens[:scheduled],
            query_start_loc=starts[: scheduled + 1],
            block_copies=np.array(copies, dtype=np.int32).reshape(len(copies), 2),
            evicted_block_ids=np.array(evicted, dtype=np.int32),
        )

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
            self._provenance.clear()
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
