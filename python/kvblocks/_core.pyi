"""Type stubs for the native module (checked against it by ``mypy.stubtest``)."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Final, final

import numpy as np
import numpy.typing as npt

from kvblocks.kv_events import KVCacheEvent
from kvblocks.stats import PrefixCacheStats
from kvblocks.step import ScheduledStep, StepBuffers

__all__ = [
    "BUILD_PROFILE",
    "HASH_ALGORITHMS",
    "BlockHasher",
    "BlockManager",
    "HitRule",
    "KVCacheBlockIds",
    "KVCacheBlockView",
    "KVCacheGroup",
    "KVCacheManager",
    "KvBlocksError",
    "RouterIndex",
    "TokenSequence",
    "__version__",
]

__version__: Final[str]
HASH_ALGORITHMS: Final[tuple[str, str, str, str, str]]
#: "release" (``pip install .``) or "dev" (a debug-assertion build, as ``.ci/run`` makes).
BUILD_PROFILE: Final[str]

#: A token-id sequence: list, tuple, range, array.array or a 1-D integer numpy array.
_TokenIds = Iterable[int] | npt.NDArray[np.integer]
#: ``("lora", name, path)``, ``("mm", identifier, offset)``, ``("cache_salt", salt)`` or
#: ``("prompt_embeds", digest)``.
_ExtraKey = tuple[str, str, str] | tuple[str, str, int] | tuple[str, str] | tuple[str, bytes]
_MmFeature = tuple[str, int, int]
#: A request: its str id or the int handle ``add_request`` returned.
_Request = str | int
_IntArray = Iterable[int] | npt.NDArray[np.integer]

class KvBlocksError(Exception): ...

@final
class BlockHasher:
    def __new__(
        cls,
        algo: str = "sha256_cbor",
        *,
        block_size: int | None = None,
        seed: str | None = None,
    ) -> BlockHasher: ...
    @staticmethod
    def engine_seed(algo: str, python_hash_seed: str | None = None) -> str | None: ...
    @property
    def algo(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def seed(self) -> str: ...
    @property
    def none_hash(self) -> bytes: ...
    @property
    def digest_size(self) -> int: ...
    def hash_block(
        self,
        parent: bytes | None,
        token_ids: _TokenIds,
        extra_keys: tuple[_ExtraKey, ...] | None = None,
        /,
    ) -> bytes: ...
    def hash_blocks(
        self,
        token_ids: _TokenIds,
        /,
        *,
        parent: bytes | None = None,
        start_block: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[bytes]: ...
    def hash_blocks_array(
        self,
        token_ids: _TokenIds,
        /,
        *,
        parent: bytes | None = None,
        start_block: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> npt.NDArray[np.uint8]: ...

# ``_HashingFloor`` (benchmark-only, benches/bench_hashing.py) exists only in builds with the
# cargo feature ``bench-floor`` (off by default), so it is not declared here; nor is
# ``KVCacheManager._plant_fault`` (test-only, the cargo feature ``test-faults``).

@final
class TokenSequence:
    def __new__(
        cls,
        prompt_token_ids: _TokenIds,
        /,
        *,
        hasher: BlockHasher,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
    ) -> TokenSequence: ...
    def append_token_ids(self, token_ids: int | _TokenIds, /) -> None: ...
    def __len__(self) -> int: ...
    @property
    def hasher(self) -> BlockHasher: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def last_token_id(self) -> int: ...
    @property
    def block_hashes(self) -> list[bytes]: ...
    @property
    def num_blocks(self) -> int: ...
    def get_token_ids(self) -> list[int]: ...
    def get_prefix_token_ids(
        self, num_tokens: int, /
    ) -> tuple[tuple[int, ...], tuple[int, ...] | None]: ...
    @property
    def prompt_token_ids(self) -> npt.NDArray[np.uint32]: ...
    @property
    def output_token_ids(self) -> npt.NDArray[np.uint32]: ...

@final
class BlockManager:
    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.0,
        log_stats: bool = True,
        enable_events: bool = False,
        verify_tokens: bool = False,
        events_use_int_block_hashes: bool = True,
        _debug_key_bytes: int | None = None,
    ) -> BlockManager: ...
    @property
    def hasher(self) -> BlockHasher: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enable_caching(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def __len__(self) -> int: ...
    def __contains__(self, request_id: object, /) -> bool: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _TokenIds,
        /,
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
    ) -> int: ...
    def append_token_ids(self, request_id: _Request, token_ids: int | _TokenIds, /) -> None: ...
    def remove_request(self, request_id: _Request, /) -> None: ...
    def get_computed_blocks(self, request_id: _Request, /) -> tuple[list[int], int]: ...
    def allocate_slots(
        self,
        request_id: _Request,
        num_new_tokens: int,
        /,
        *,
        num_new_computed_tokens: int | None = None,
        new_computed_blocks: Iterable[int] | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[int] | None: ...
    def free(self, request_id: _Request, /) -> None: ...
    def fork(self, parent_id: _Request, child_id: str, /) -> int: ...
    def handle(self, request_id: _Request, /) -> int: ...
    def lookup_batch(
        self, handles: _IntArray, /
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
    def schedule_step(
        self,
        handles: _IntArray,
        num_new_tokens: _IntArray | None = None,
        /,
        *,
        num_new_computed_tokens: _IntArray | None = None,
        prefix_lookup: Iterable[bool | int] | npt.NDArray[np.bool_ | np.integer] | None = None,
        num_lookahead_tokens: int | None = None,
        new_token_ids: _TokenIds | None = None,
        new_token_offsets: _IntArray | None = None,
        sampled_token_ids: _IntArray | None = None,
        token_budget: int | None = None,
        preempt: bool = False,
        out: StepBuffers | None = None,
    ) -> ScheduledStep: ...
    def get_block_ids(self, request_id: _Request, /) -> list[int]: ...
    def block_hashes(self, request_id: _Request, /) -> list[bytes]: ...
    def num_computed_tokens(self, request_id: _Request, /) -> int: ...
    def num_tokens(self, request_id: _Request, /) -> int: ...
    def get_token_ids(self, request_id: _Request, /) -> list[int]: ...
    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[KVCacheEvent]: ...
    def take_block_copies(self) -> npt.NDArray[np.int32]: ...
    def debug_state(self) -> dict[str, Any]: ...

@final
class KVCacheManager:
    """The Rust half of ``kvblocks.vllm.KVCacheManager``: vLLM's KV-cache manager over one
    or more groups, keyed by request id, reading vLLM ``Request`` fields in place."""

    def __new__(
        cls,
        num_blocks: int,
        groups: Sequence[KVCacheGroup],
        *,
        lookup_sets: Sequence[Sequence[int]],
        max_model_len: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        watermark_blocks: int = 0,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        num_hash_lookahead_tokens: int = 0,
        retention_interval: int | None = None,
        needs_kv_cache_zeroing: bool = False,
        waiting_statuses: list[Any] = ...,
    ) -> KVCacheManager: ...
    @property
    def empty_kv_cache_blocks(self) -> KVCacheBlockIds: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def __len__(self) -> int: ...
    def request_ids(self) -> list[str]: ...
    def lookup(
        self, block_hashes: list[bytes], max_length: int, /, request_id: str | None = None
    ) -> tuple[KVCacheBlockIds, int, int]: ...
    def probe_request(self, request: Any, /) -> int: ...
    def lookup_per_group(
        self, block_hashes: list[bytes], max_length: int, /
    ) -> tuple[KVCacheBlockIds, list[int]]: ...
    def allocate_for_request(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlockIds | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Any = None,
    ) -> KVCacheBlockIds | None: ...
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None: ...
    def remove_skipped_blocks(self, request_id: str, num_processed: int, /) -> None: ...
    def free(self, request_id: str, /) -> None: ...
    def get_block_ids(self, request_id: str, /) -> tuple[list[int], ...]: ...
    def get_blocks(self, request_id: str, with_keys: bool = False, /) -> KVCacheBlockIds: ...
    def pop_blocks_for_free(self, request_id: str, /) -> list[int]: ...
    def free_blocks(self, block_ids: Iterable[int], /) -> None: ...
    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
    ) -> int: ...
    def estimate_cached_tokens(self, request_id: str, /) -> int: ...
    def reset_prefix_cache(self) -> bool: ...
    def new_step_starts(self) -> int: ...
    def contain_errors(self, handler: Callable[[str, str], object] | None, /) -> None: ...
    def _check_allocations(self, enabled: bool, /) -> None: ...
    def record_blocks_for_zeroing(self, request_id: str, start_token: int, /) -> None: ...
    def evict_blocks(self, block_ids: Iterable[int], /) -> None: ...
    def take_new_block_ids(self) -> list[int]: ...
    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]: ...
    def take_events(
        self,
    ) -> list[
        tuple[str] | tuple[str, bytes, int] | tuple[str, str, int, int, int, tuple[int, ...]]
    ]: ...

@final
class KVCacheGroup:
    """One KV-cache group for ``KVCacheManager``: ``kind`` is ``"full"``, ``"sliding_window"``
    (with ``sliding_window``), ``"chunked_local"`` (with ``attention_chunk_size``) or
    ``"mamba"`` (optionally with ``num_speculative_blocks``, and with prefix caching
    ``prefill_checkpoint_alignment`` where the layer exports prefill checkpoints)."""

    def __new__(
        cls,
        kind: str,
        block_size: int,
        *,
        sliding_window: int | None = None,
        extra_retained_tokens: int = 0,
        attention_chunk_size: int | None = None,
        num_speculative_blocks: int = 0,
        max_admission_blocks: int | None = None,
        is_eagle_group: bool = False,
        prefill_checkpoint_alignment: int | None = None,
    ) -> KVCacheGroup: ...
    @property
    def kind(self) -> str: ...
    @property
    def block_size(self) -> int: ...

@final
class KVCacheBlockIds:
    """Block ids per KV-cache group, where vLLM's manager returns ``KVCacheBlocks``."""

    def __new__(cls, block_ids: Iterable[Iterable[int]], /) -> KVCacheBlockIds: ...
    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...
    @property
    def blocks(self) -> tuple[tuple[KVCacheBlockView, ...], ...]: ...
    def get_unhashed_block_ids(self) -> list[int]: ...
    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]: ...
    def __len__(self) -> int: ...

@final
class KVCacheBlockView:
    """One block of a ``KVCacheBlockIds`` result as KV connectors read vLLM's blocks."""

    @property
    def block_id(self) -> int: ...
    @property
    def block_hash(self) -> bytes | None: ...
    @property
    def is_null(self) -> bool: ...

@final
class HitRule:
    """A replica's prefix-hit rule for ``RouterIndex.hit_tokens``: its KV-cache groups (one
    block size, the hash block size), the sets of groups its coordinator looks up together
    (every group in one set; vLLM's order, full attention first) and the EAGLE block drop.
    Refuses (``ValueError``) what ``KVCacheManager`` refuses of the same groups."""

    def __new__(
        cls,
        groups: Sequence[KVCacheGroup],
        /,
        *,
        lookup_sets: Sequence[Sequence[int]],
        use_eagle: bool = False,
    ) -> HitRule: ...
    @property
    def is_plain_prefix(self) -> bool:
        """The hit is the longest prefix every group holds (full attention only, no EAGLE
        drop): ``RouterIndex.prefix_blocks`` answers it for every replica at once."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_groups(self) -> int: ...

@final
class RouterIndex:
    """The cluster-wide block table of ``kvblocks.router``: for each (block hash, group,
    medium) key, the replicas (ids ``0`` to ``MAX_REPLICAS - 1``) that hold it. Block hashes
    are ``bytes`` (vLLM's) or ints (the last 8 bytes big-endian, as vLLM's KV events publish
    them by default). A key takes one 12-byte slot (16 once a replica id is 32 or more) in a
    table at most 7/8 full, which grows by an eighth; ``reserve(n)`` sizes it for ``n`` keys."""

    MAX_REPLICAS: ClassVar[int]
    def __new__(cls, seed: int = 0) -> RouterIndex: ...
    def add_replica(self, replica: int) -> None: ...
    def clear_replica(self, replica: int) -> int: ...
    def remove_replica(self, replica: int) -> int: ...
    def store(
        self, replica: int, hashes: Iterable[bytes | int], group: int, medium: int
    ) -> int: ...
    def remove(
        self, replica: int, hashes: Iterable[bytes | int], group: int, medium: int
    ) -> int: ...
    def prefix_blocks(
        self, hashes: Iterable[bytes | int], group: int, medium: int
    ) -> dict[int, int]: ...
    def hit_tokens(
        self,
        replicas: Sequence[int],
        block_hashes: list[bytes],
        rule: HitRule,
        medium: int,
        max_length: int,
        /,
    ) -> list[int]:
        """For each of ``replicas``, the prefix tokens its scheduler would find cached in
        ``medium`` for a request whose full blocks have ``block_hashes``, in a lookup of at
        most ``max_length`` tokens: its coordinator's search under ``rule``, over the blocks
        the index says it holds (an unknown replica is a ``ValueError``)."""
    def holds(self, replica: int, hash: bytes | int, group: int, medium: int) -> bool: ...
    def replica_blocks(self, replica: int) -> tuple[bytes, bytes]:
        """The blocks ``replica`` holds, for a snapshot: their keys (8 bytes each,
        little-endian) and copies (4 bytes each), in the same order."""
    def restore_replica(self, replica: int, keys: bytes, copies: bytes) -> int:
        """Gives ``replica`` (registered, holding nothing) the blocks ``replica_blocks``
        gave; how many. A ValueError, changing nothing, for malformed input."""
    def held(self, replica: int) -> int: ...
    @property
    def replicas(self) -> list[int]: ...
    @property
    def num_keys(self) -> int: ...
    @property
    def num_copied(self) -> int:
        """(replica, block) pairs held in more than one copy (a replica caches a block twice
        when it computes it again; each copy is stored and removed on its own)."""
    def reserve(self, keys: int) -> None: ...
    @property
    def table_bytes(self) -> int: ...
    def counts(self) -> dict[str, int]: ...
