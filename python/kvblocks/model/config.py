"""Llama-style model configuration, read from a Hugging Face ``config.json`` (transformers 4.x
and 5.x layouts) or built in code (the tiny default runs fast on a CPU)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear")
#: The ``config.json`` keys without a default here.
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    #: ``"default"`` or ``"linear"`` (positions divided by ``rope_factor``).
    rope_type: str = "default"
    rope_factor: float = 1.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; kvblocks supports "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.rope_factor <= 0:
            raise ValueError("rope factor must be positive")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Reads a ``config.json`` as transformers 4.x (``rope_theta``, ``rope_scaling``) or
        5.x (``rope_parameters``) writes it; refuses architectures and RoPE types it does not
        implement instead of computing something else."""
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if not any(a in SUPPORTED_ARCHITECTURES for a in architectures) and model_type not in (
            "llama",
            "qwen2",
            "mistral",
        ):
            raise ValueError(
                f"unsupported architecture {architectures or model_type!r}; kvblocks runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
        for key in _REQUIRED_KEYS:
            if key not in raw:
                raise ValueError(f"config.json has no {key!r}")
        num_heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases without declaring them.
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))
