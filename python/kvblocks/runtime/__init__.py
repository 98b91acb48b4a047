"""The torch runtime: a paged KV cache addressed by kvblocks' block ids, paged attention, and a
runner that executes one batched step (needs ``kvblocks[torch]``)."""

from kvblocks.runtime.attention import AttentionMetadata, paged_attention
from kvblocks.runtime.kv_cache import PagedKVCache
from kvblocks.runtime.runner import ModelRunner

__all__ = ["AttentionMetadata", "ModelRunner", "PagedKVCache", "paged_attention"]
