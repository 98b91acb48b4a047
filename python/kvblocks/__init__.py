"""kvblocks: prefix-cache bookkeeping for LLM inference engines, in Rust.

The native classes come from :mod:`kvblocks._core`; :mod:`kvblocks.reference` is their
pure-Python reference with the same API and results.
"""

from kvblocks._core import (
    HASH_ALGORITHMS,
    BlockHasher,
    BlockManager,
    KvBlocksError,
    TokenSequence,
    __version__,
)
from kvblocks.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.stats import PrefixCacheStats
from kvblocks.step import ScheduledStep, StepBuffers


def __getattr__(name: str) -> object:
    # The engine needs torch (the kvblocks[torch] extra); import it only when asked for.
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        try:
            from kvblocks import engine
        except ModuleNotFoundError as error:
            if error.name != "torch":
                raise
            from kvblocks._install import install_hint

            raise ModuleNotFoundError(
                f"kvblocks.{name} (the embedded engine) needs torch: {install_hint('torch')}",
                name="torch",
            ) from error
        return getattr(engine, name)
    raise AttributeError(f"module 'kvblocks' has no attribute {name!r}")


__all__ = [
    "HASH_ALGORITHMS",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "KvBlocksError",
    "PrefixCacheStats",
    "ScheduledStep",
    "StepBuffers",
    "TokenSequence",
    "__version__",
]
