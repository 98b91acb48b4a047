"""Loading a local Hugging Face-format directory (``config.json`` and ``*.safetensors``), with
no network access."""

from __future__ import annotations

from pathlib import Path

import torch

from kvblocks.model.config import LlamaConfig
from kvblocks.model.llama import LlamaForCausalLM


def load_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """A Llama/Qwen2/Mistral checkpoint from a local directory. Missing or unexpected tensors
    are an error, not silently random weights."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{path}: no such directory; kvblocks loads a checkpoint from a local directory "
            "(config.json and *.safetensors), never from a hub: download it first"
        )
    config = LlamaConfig.from_json(directory / "config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {config}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype).eval()
