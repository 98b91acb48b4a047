"""The twin's KV cache events that the manager builds (the pool queues the removals and
clears itself): the ``BlockStored`` of newly cached blocks, with their extra keys untagged the
way vLLM reports them. ``stored_event`` takes the manager first and is bound as a
:class:`~kvblocks.reference.manager.BlockManager` method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks.kv_events import BlockStored
from kvblocks.reference.hashing import LORA, MM

if TYPE_CHECKING:
    from kvblocks.reference.manager import BlockManager
    from kvblocks.reference.sequence import TokenSequence


def _untagged(key: tuple[Any, ...]) -> Any:
    if key[0] == LORA:
        return key[1]
    if key[0] == MM:
        return (key[1], key[2])
    return key[1]  # cache salt or prompt-embeds digest


def stored_event(manager: BlockManager, seq: TokenSequence, done: int, full: int) -> BlockStored:
    hashes = seq.block_hashes
    external = manager.block_pool.external
    extra_keys: list[tuple[Any, ...] | None] = []
    for index in range(done, full):
        keys = manager._block_keys(seq, index)
        extra_keys.append(None if keys is None else tuple(_untagged(k) for k in keys))
    lora = seq._chain.keys.lora
    b = manager.block_size
    return BlockStored(
        block_hashes=[external(h) for h in hashes[done:full]],
        parent_block_hash=external(hashes[done - 1]) if done else None,
        token_ids=seq.get_token_ids()[done * b : full * b],
        block_size=b,
        lora_name=lora[0] if lora is not None else None,
        extra_keys=extra_keys or None,
    )
