"""vLLM's CPU platform for the benchmark, and the tiny model's sizes.

vLLM picks its platform once, from ``VLLM_TARGET_DEVICE``, when ``vllm.config`` is first
imported; :func:`select_cpu_platform` runs before every first import of vLLM here.
"""

from __future__ import annotations

import functools
import os

VOCAB_SIZE = 32000
MAX_MODEL_LEN = 8192


@functools.cache
def select_cpu_platform() -> None:
    """Sets ``VLLM_TARGET_DEVICE=cpu`` for this process unless it is set already, before the
    benchmark's first import of vLLM. Raises RuntimeError where vLLM was imported earlier and
    found no platform: then no ``VllmConfig`` can be built, and the fix is to set
    ``VLLM_TARGET_DEVICE=cpu`` before anything imports vLLM."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():  # not cached: a later call checks again
        raise RuntimeError(
            "vLLM was imported before VLLM_TARGET_DEVICE=cpu was set and found no device; "
            "set VLLM_TARGET_DEVICE=cpu before anything imports vllm"
        )
