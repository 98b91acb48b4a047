"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP,
tied or untied embeddings) whose attention goes through a pluggable backend: the paged KV
cache for serving, or plain causal attention over the whole sequence as the reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvblocks.model.config import LlamaConfig

#: ``(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]``
AttentionBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """Rotary embedding of ``x`` (``[T, heads, D]``) at ``positions``, half-split layout."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    )
    angles = (positions.float() / config.rope_factor)[:, None] * inv_freq[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[:, None, :]
    x32 = x.float()
    half = dim // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attend: AttentionBackend
    ) -> torch.Tensor:
        c = self.config
        q = self.q_proj(x).view(-1, c.num_attention_heads, c.head_size)
        k = self.k_proj(x).view(-1, c.num_key_value_heads, c.head_size)
        v = self.v_proj(x).view(-1, c.num_key_value_heads, c.head_size)
        q, k = rotate(q, positions, c), rotate(k, positions, c)
        out = attend(self.layer, q, k, v)
        projected: torch.Tensor = self.o_proj(out.reshape(len(x), -1))
        return projected


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attend: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attend)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight``...),
    so a checkpoint's state dict loads as it is."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def random(
        cls,
        config: LlamaConfig | None = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LlamaForCausalLM:
        """Deterministic random weights from ``seed`` (the default config is tiny)."""
        config = config or LlamaConfig()
        generator = torch.Generator().manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        return model.to(device=device, dtype=dtype).eval()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttentionBackend
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, attend)
        normed: torch.Tensor = self.model.norm(x)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The reference: one sequence, no cache, plain causal attention; logits ``[S, V]``."""
        c = self.config

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            groups = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            return out.transpose(0, 1)

        positions = torch.arange(len(input_ids), device=input_ids.device)
        return self.compute_logits(self.hidden_states(input_ids, positions, attend))
