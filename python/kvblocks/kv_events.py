"""KV-cache events, shaped like vLLM's ``vllm.distributed.kv_events`` (one KV-cache group).

Block hashes are in vLLM's external form: by default the last 8 bytes of the hash as an
unsigned big-endian int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), else the raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ExternalBlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly registered in the prefix cache, in order, by one request."""

    block_hashes: list[ExternalBlockHash]
    #: The hash of the block before the first stored one, or ``None`` from the start.
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    #: Per block, its untagged extra keys (LoRA name, ``(mm_identifier, offset)``, salt,
    #: embeds digest) or ``None``; ``None`` for the whole field only when it would be empty.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """One cache key evicted (its last block was reused for other content)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
