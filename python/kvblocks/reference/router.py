"""The pure-Python reference of ``kvblocks._core.RouterIndex`` (the cluster-wide block table
of :mod:`kvblocks.router`): the same keys, the same answers and counts, in a dict of replica
bit sets. The baseline of ``benches/bench_router.py`` and the oracle of its tests."""

from __future__ import annotations

import struct
from collections.abc import Iterable

__all__ = ["MAX_REPLICAS", "RouterIndex", "block_key"]

MAX_REPLICAS = 64
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_key(block_hash: bytes | int, group: int, medium: int) -> int:
    """The index key of a block hash: its last 8 bytes big-endian (vLLM's int form of the
    hash), mixed with the group and medium."""
    if isinstance(block_hash, bytes):
        value = int.from_bytes(block_hash[-8:], "big")
    elif isinstance(block_hash, int) and not isinstance(block_hash, bool):
        if not 0 <= block_hash <= _MASK:
            raise ValueError(f"a block hash int must be in [0, 2**64), got {block_hash}")
        value = block_hash
    else:
        raise TypeError(f"a block hash must be bytes or an int, got {type(block_hash).__name__}")
    return value ^ _mix((group << 32) | medium)


class RouterIndex:
    """See ``kvblocks._core.RouterIndex``."""

    MAX_REPLICAS = MAX_REPLICAS

    def __init__(self, seed: int = 0) -> None:
        self._table: dict[int, int] = {}
        self._live = 0
        self._held = [0] * MAX_REPLICAS
        # (key, replica) -> copies of the block beyond the first
        self._copies: dict[tuple[int, int], int] = {}
        self._counts = dict.fromkeys(
            (
                "stored",
                "removed",
                "repeated_stores",
                "repeated_removals",
                "unknown_removals",
                "cleared",
            ),
            0,
        )

    def _bit(self, replica: int, *, live: bool = True) -> int:
        if not 0 <= replica < MAX_REPLICAS:
            raise ValueError(f"replica {replica} is out of range (at most {MAX_REPLICAS - 1})")
        bit = 1 << replica
        if live and not self._live & bit:
            raise ValueError(f"no replica {replica} in the index")
        return bit

    def add_replica(self, replica: int) -> None:
        bit = self._bit(replica, live=False)
        if self._live & bit:
            raise ValueError(f"replica {replica} is already in the index")
        self._live |= bit

    def clear_replica(self, replica: int) -> int:
        bit = self._bit(replica)
        dropped = self._held[replica]
        if dropped:
            for key in [k for k, holders in self._table.items() if holders & bit]:
                holders = self._table[key] & ~bit
                if holders:
                    self._table[key] = holders
                else:
                    del self._table[key]
        self._held[replica] = 0
        self._copies = {k: n for k, n in self._copies.items() if k[1] != replica}
        self._counts["cleared"] += dropped
        return dropped

    def remove_replica(self, replica: int) -> int:
        dropped = self.clear_replica(replica)
        self._live &= ~(1 << replica)
        return dropped

    def store(self, replica: int, hashes: Iterable[bytes | int], group: int, medium: int) -> int:
        bit = self._bit(replica)
        keys = [block_key(h, group, medium) for h in hashes]
        new = 0
        table = self._table
        for key in keys:
            holders = table.get(key, 0)
            if not holders & bit:
                table[key] = holders | bit
                new += 1
            else:
                self._copies[key, replica] = self._copies.get((key, replica), 0) + 1
        self._held[replica] += new
        self._counts["stored"] += new
        self._counts["repeated_stores"] += len(keys) - new
        return new

    def replica_blocks(self, replica: int) -> tuple[bytes, bytes]:
        bit = self._bit(replica)
        held = [k for k, holders in self._table.items() if holders & bit]
        keys = struct.pack(f"<{len(held)}Q", *held)
        copies = [1 + self._copies.get((k, replica), 0) for k in held]
        return keys, struct.pack(f"<{len(held)}I", *copies)

    def restore_replica(self, replica: int, keys: bytes, copies: bytes) -> int:
        bit = self._bit(replica)
        if len(keys) % 8 or len(copies) % 4 or len(keys) // 8 != len(copies) // 4:
            raise ValueError(
                f"keys and copies must be 8 and 4 bytes per block, got {len(keys)} and "
                f"{len(copies)} bytes"
            )
        if self._held[replica]:
            raise ValueError(f"replica {replica} holds blocks: only an empty replica is restored")
        n = len(keys) // 8
        counts = struct.unpack(f"<{n}I", copies)
        blocks = list(zip(struct.unpack(f"<{n}Q", keys), counts, strict=True))
        if any(c == 0 for _, c in blocks):
            raise ValueError("a block restored with 0 copies")
        new = 0
        for key, count in blocks:
            holders = self._table.get(key, 0)
            extra = count
            if not holders & bit:
                self._table[key] = holders | bit
                new += 1
                extra -= 1
            if extra:
                self._copies[key, replica] = self._copies.get((key, replica), 0) + extra
        self._held[replica] = new
        return new

    def remove(self, replica: int, hashes: Iterable[bytes | int], group: int, medium: int) -> int:
        bit = self._bit(replica)
        keys = [block_key(h, group, medium) for h in hashes]
        gone = copies = 0
        table = self._table
        for key in keys:
            extra = self._copies.get((key, replica), 0)
            holders = table.get(key, 0)
            if extra:
                copies += 1
                if extra > 1:
                    self._copies[key, replica] = extra - 1
                else:
                    del self._copies[key, replica]
            elif holders & bit:
                gone += 1
                if holders & ~bit:
                    table[key] = holders & ~bit
                else:
                    del table[key]
        self._held[replica] -= gone
        self._counts["removed"] += gone
        self._counts["repeated_removals"] += copies
        self._counts["unknown_removals"] += len(keys) - gone - copies
        return gone

    def prefix_blocks(
        self, hashes: Iterable[bytes | int], group: int, medium: int
    ) -> dict[int, int]:
        alive = self._live
        out = {r: 0 for r in range(MAX_REPLICAS) if alive >> r & 1}
        depth = 0
        for h in hashes:
            if not alive:
                break
            holders = self._table.get(block_key(h, group, medium), 0) & alive
            ended = alive & ~holders
            for r in out:
                if ended >> r & 1:
                    out[r] = depth
            alive = holders
            depth += 1
        for r in out:
            if alive >> r & 1:
                out[r] = depth
        return out

    def holds(self, replica: int, block_hash: bytes | int, group: int, medium: int) -> bool:
        if not 0 <= replica < MAX_REPLICAS:
            return False
        return bool(self._table.get(block_key(block_hash, group, medium), 0) >> replica & 1)

    def held(self, replica: int) -> int:
        return self._held[replica] if 0 <= replica < MAX_REPLICAS else 0

    @property
    def replicas(self) -> list[int]:
        return [r for r in range(MAX_REPLICAS) if self._live >> r & 1]

    @property
    def num_keys(self) -> int:
        return len(self._table)

    @property
    def num_copied(self) -> int:
        return len(self._copies)

    def reserve(self, keys: int) -> None:
        """A dict sizes itself: only the argument is checked, as the native index checks it."""
        if not isinstance(keys, int) or isinstance(keys, bool) or keys < 0:
            raise TypeError(f"keys must be a non-negative int, got {keys!r}")

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
