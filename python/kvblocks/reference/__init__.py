"""The pure-Python reference for kvblocks' native API: the same classes, methods and results,
written plainly the way vLLM does the work. It is the reference for correctness tests and
the baseline for every benchmark. The vLLM algorithms need ``cbor2`` and ``xxhash``
(``pip install ".[reference]"`` in a kvblocks checkout)."""

from kvblocks.reference.hashing import HASH_ALGORITHMS, BlockHasher
from kvblocks.reference.manager import BlockManager
from kvblocks.reference.sequence import TokenSequence

__all__ = ["HASH_ALGORITHMS", "BlockHasher", "BlockManager", "TokenSequence"]
