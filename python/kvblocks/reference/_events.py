"""The reference's KV cache events that the manager builds (the pool queues the removals and
clears itself): the ``BlockStored`` of newly cached blocks, with their extra keys untagged the
way vLLM reports them. ``stored_event`` takes what it reads as arguments; nothing here knows
the manager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvblocks.kv_events import BlockStored
from kvblocks.reference._verify import block_keys
from kvblocks.reference.hashing import LORA, MM
from kvblocks.reference.sequence import TokenSequence


def _untagged(key: tuple[Any, ...]) -> Any:
    if key[0] == LORA:
        return key[1]
    if key[0] == MM:
        return (key[1], key[2])
    return key[1]  # cache salt or prompt-embeds digest


def stored_event(
    seq: TokenSequence, done: int, full: int, block_size: int, external: Callable[[bytes], Any]
) -> BlockStored:
    """The ``BlockStored`` of blocks ``done:full`` of ``seq``, newly cached; ``external``
    turns a block hash into the event's form of it (the pool's ``external``)."""
    hashes = seq.block_hashes
    extra_keys: list[tuple[Any, ...] | None] = []
    for index in range(done, full):
        keys = block_keys(seq, index, block_size)
        extra_keys.append(None if keys is None else tuple(_untagged(k) for k in keys))
    lora = seq._chain.keys.lora
    b = block_size
    return BlockStored(
        block_hashes=[external(h) for h in hashes[done:full]],
        parent_block_hash=external(hashes[done - 1]) if done else None,
        token_ids=seq.get_token_ids()[done * b : full * b],
        block_size=b,
        lora_name=lora[0] if lora is not None else None,
        extra_keys=extra_keys or None,
    )
