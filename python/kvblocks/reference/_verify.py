"""Token verification (``verify_tokens=True``): what the twin records of each cached block
(its tokens, its parent block and its extra keys) and the check a lookup makes with it, so
that blocks whose keys collide are told apart. The functions take the manager first and are
bound as :class:`~kvblocks.reference.manager.BlockManager` methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvblocks.reference.hashing import ExtraKeys

if TYPE_CHECKING:
    from kvblocks.reference.manager import BlockManager
    from kvblocks.reference.pool import KVCacheBlock
    from kvblocks.reference.sequence import TokenSequence


@dataclass
class _Provenance:
    tokens: tuple[int, ...]
    parent: int | None
    keys: ExtraKeys


def block_tokens(manager: BlockManager, seq: TokenSequence, index: int) -> tuple[int, ...]:
    b = manager.block_size
    return tuple(seq._all[index * b : (index + 1) * b])


def block_keys(manager: BlockManager, seq: TokenSequence, index: int) -> ExtraKeys:
    keys = seq._chain.keys
    if keys.is_empty():
        return None
    b = manager.block_size
    return keys.block_extra_keys(index * b, (index + 1) * b, 0)[0]


def provenance_matches(
    manager: BlockManager, seq: TokenSequence, index: int, block: KVCacheBlock, parent: int | None
) -> bool:
    if not manager.verify_tokens:
        return True
    p = manager._provenance.get(block.block_id)
    return (
        p is not None
        and p.parent == parent
        and p.tokens == manager._block_tokens(seq, index)
        and p.keys == manager._block_keys(seq, index)
    )


def find_cached(
    manager: BlockManager, seq: TokenSequence, index: int, parent: int | None
) -> KVCacheBlock | None:
    hashes = seq.block_hashes
    if index >= len(hashes):
        return None
    candidates = manager.block_pool.cached_block_hash_to_block.get(manager._key(hashes[index]))
    if not candidates:
        return None
    for block in candidates.values():
        if manager._provenance_matches(seq, index, block, parent):
            return block
    return None
