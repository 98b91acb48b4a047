"""kvblocks: prefix-cache bookkeeping for LLM inference engines, in Rust.

The native classes come from :mod:`kvblocks._core`; :mod:`kvblocks.reference` is their
pure-Python twin with the same API and results.
"""

from kvblocks._core import (
    HASH_ALGORITHMS,
    BlockHasher,
    KvBlocksError,
    TokenSequence,
    __version__,
)

__all__ = [
    "HASH_ALGORITHMS",
    "BlockHasher",
    "KvBlocksError",
    "TokenSequence",
    "__version__",
]
