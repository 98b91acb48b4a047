"""The paged KV cache: per layer, K and V tensors of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` addressed only by kvblocks' block ids."""

from __future__ import annotations

from typing import Any

import torch


class PagedKVCache:
    """K/V storage for every layer, on any device and dtype."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self.key[0].device

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Stores the new tokens' K/V (``[T, num_kv_heads, head_dim]``) at their slots
        (``block_id * block_size + offset``, from the batched step's slot mapping)."""
        k, v = self.key[layer], self.value[layer]
        k.view(-1, *k.shape[2:]).index_copy_(0, slots, key.to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, slots, value.to(v.dtype))

    def copy_blocks(self, pairs: Any) -> None:
        """Executes copy-on-write pairs (``(N, 2)`` ``(src, dst)`` block ids, as
        ``take_block_copies()`` or ``ScheduledStep.block_copies`` return them)."""
        if len(pairs) == 0:
            return  # (the shared empty result is read-only: torch would warn on wrapping it)
        pairs = torch.as_tensor(pairs, dtype=torch.long, device=self.device).reshape(-1, 2)
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in (*self.key, *self.value):
            cache[dst] = cache[src]
