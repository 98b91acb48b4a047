"""Token verification (``verify_tokens=True``): what the reference records of each cached block
(its tokens, its parent block and its extra keys) and the check a prefix hit must pass with
it, so that blocks whose keys collide are told apart. The manager owns a
:class:`TokenVerifier`; nothing here knows the manager."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvblocks.reference.hashing import ExtraKeys
from kvblocks.reference.pool import KVCacheBlock
from kvblocks.reference.sequence import TokenSequence


@dataclass
class _Provenance:
    tokens: tuple[int, ...]
    parent: int | None
    keys: ExtraKeys


def block_tokens(seq: TokenSequence, index: int, block_size: int) -> tuple[int, ...]:
    """The tokens of block ``index`` of ``seq``."""
    b = block_size
    return tuple(seq._all[index * b : (index + 1) * b])


def block_keys(seq: TokenSequence, index: int, block_size: int) -> ExtraKeys:
    """The extra keys (cache salt, LoRA, multimodal) of block ``index`` of ``seq``."""
    keys = seq._chain.keys
    if keys.is_empty():
        return None
    b = block_size
    return keys.block_extra_keys(index * b, (index + 1) * b, 0)[0]


class TokenVerifier:
    """The provenance of each cached block, by block id, and the check a prefix hit makes
    with it; with ``enabled`` False every hit passes."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._provenance: dict[int, _Provenance] = {}

    def record(self, block_id: int, seq: TokenSequence, index: int, parent: int | None) -> None:
        """Block ``block_id`` now caches block ``index`` of ``seq``, after block ``parent``."""
        self._provenance[block_id] = _Provenance(
            block_tokens(seq, index, self.block_size),
            parent,
            block_keys(seq, index, self.block_size),
        )

    def clear(self) -> None:
        """Forgets every block (the prefix cache was reset)."""
        self._provenance.clear()

    def matches(
        self, seq: TokenSequence, index: int, block: KVCacheBlock, parent: int | None
    ) -> bool:
        """Whether ``block`` (found after block ``parent``) holds block ``index`` of ``seq``."""
        if not self.enabled:
            return True
        p = self._provenance.get(block.block_id)
        return (
            p is not None
            and p.parent == parent
            and p.tokens == block_tokens(seq, index, self.block_size)
            and p.keys == block_keys(seq, index, self.block_size)
        )

    def find(
        self,
        candidates: Iterable[KVCacheBlock],
        seq: TokenSequence,
        index: int,
        parent: int | None,
    ) -> KVCacheBlock | None:
        """The first of the blocks cached under block ``index``'s key that holds it."""
        for block in candidates:
            if self.matches(seq, index, block, parent):
                return block
        return None
