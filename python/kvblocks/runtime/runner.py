"""Runs one forward pass for the requests of one batched ``BlockManager`` step."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvblocks.model.llama import LlamaForCausalLM
from kvblocks.runtime.attention import BACKENDS, AttentionMetadata, paged_attention
from kvblocks.runtime.kv_cache import PagedKVCache
from kvblocks.step import ScheduledStep


class ModelRunner:
    """Owns the paged KV cache of a model; ``execute`` runs a mixed batch of prefill chunks and
    decode tokens through it and returns each request's next-token logits."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        attention: str = "auto",
    ) -> None:
        """``dtype``: the KV cache's (default: the model's); ``attention``: the backend of
        :func:`paged_attention` (``"auto"``: Triton on CUDA when it imports, else torch)."""
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise TypeError(f"the KV cache dtype must be a floating-point dtype, got {dtype!r}")
        if attention not in BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(BACKENDS)}, got {attention!r}")
        c = model.config
        self.model = model
        self.attention = attention
        self.device = torch.device(device)
        self.cache = PagedKVCache(
            c.num_hidden_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_size,
            dtype=dtype or next(model.parameters()).dtype,
            device=self.device,
        )

    @torch.no_grad()
    def execute(
        self,
        step: ScheduledStep,
        input_ids: npt.NDArray[np.integer] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``: the step's new tokens, request after request (``num_scheduled_tokens``
        of them; default: the step's own ``input_ids``). Executes the step's copy-on-write
        copies first; returns ``[num_scheduled, vocab]`` float32 logits of each request's last
        new token."""
        self.cache.copy_blocks(step.block_copies)
        meta = AttentionMetadata.from_step(step, self.device)
        if input_ids is None:
            input_ids = step.input_ids
        ids = torch.as_tensor(input_ids, device=self.device).long()
        if len(ids) != step.num_scheduled_tokens:
            raise ValueError(
                f"got {len(ids)} input ids for a step of {step.num_scheduled_tokens} tokens"
            )
        cache = self.cache

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(layer, k, v, meta.slot_mapping)
            return paged_attention(
                q, cache.key[layer], cache.value[layer], meta, backend=self.attention
            )

        hidden = self.model.hidden_states(ids, meta.positions, attend)
        return self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
