"""A Llama-style model that runs on kvblocks' paged KV cache (needs ``kvblocks[torch]``)."""

from kvblocks.model.config import LlamaConfig
from kvblocks.model.llama import LlamaForCausalLM
from kvblocks.model.loading import load_pretrained

__all__ = ["LlamaConfig", "LlamaForCausalLM", "load_pretrained"]
