"""Local ``config.json`` files for the Hugging Face models vLLM's scheduler tests name.

``tests/v1/core/utils.py::create_scheduler`` builds ``ModelConfig(model="facebook/opt-125m")``
(and one test ``facebook/opt-350m``), which reads the model's ``config.json`` from the Hub.
The tier has no Hub access, and the scheduler needs only the configuration (architecture,
``max_position_embeddings``, sizes), not weights or a tokenizer. vLLM's own
``VLLM_MODEL_REDIRECT_PATH`` maps a model name to a local directory; these directories hold a
``config.json`` written by transformers' ``OPTConfig`` with the published sizes of each model.

Not provided: multimodal models (llava, Qwen2.5-VL), whose tests also need a tokenizer and
processor files and more packages (mistral_common, torchvision), and Qwen3-Next (an MTP
speculative configuration, which kvblocks hands to vLLM's own manager anyway). Those tests
fail in both runs and so never count against kvblocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The published facebook/opt-* dimensions (OPTConfig's defaults are opt-125m's).
OPT_MODELS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {},
    "facebook/opt-350m": {
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
    },
}


def ensure_redirects(cache: Path) -> Path:
    """Writes the config directories and the redirect file (JSON: name -> directory)."""
    from transformers import OPTConfig

    models = cache / "models"
    redirects: dict[str, str] = {}
    for name, sizes in OPT_MODELS.items():
        directory = models / name.replace("/", "--")
        fields: dict[str, Any] = {"architectures": ["OPTForCausalLM"], "dtype": "float16"}
        config = OPTConfig(**fields, **sizes)
        config.save_pretrained(directory)
        redirects[name] = str(directory.resolve())
    path = models / "redirect.json"
    path.write_text(json.dumps(redirects, indent=1) + "\n")
    return path
