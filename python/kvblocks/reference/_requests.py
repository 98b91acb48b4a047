"""What the reference holds per request, and how a request is named: shared by the manager
(:mod:`.manager`, which owns the request table) and its batched step (:mod:`._step`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvblocks.reference.pool import KVCacheBlock
from kvblocks.reference.sequence import TokenSequence

#: A request, named by its str id or by its int handle.
RequestRef = str | int


@dataclass
class Request:
    """One request's state: its tokens, its block table and where its computation stands."""

    seq: TokenSequence
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_computed_tokens: int = 0
    running: bool = False
    num_preemptions: int = 0
