"""The reference's block pool, written the way vLLM 0.33's ``KVCacheBlock``,
``FreeKVCacheBlockQueue`` and ``BlockPool`` work: a Python object per block, an intrusive
linked list for the free queue, a dict from hash to blocks."""

from __future__ import annotations

from typing import Any

from kvblocks.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent

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
