"""Type stubs for the native module (checked against it by ``mypy.stubtest``)."""

from collections.abc import Iterable, Sequence
from typing import Final, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "HASH_ALGORITHMS",
    "BlockHasher",
    "KvBlocksError",
    "TokenSequence",
    "__version__",
]

__version__: Final[str]
HASH_ALGORITHMS: Final[tuple[str, str, str, str, str]]

#: A token-id sequence: list, tuple, range, array.array or a 1-D integer numpy array.
_TokenIds = Iterable[int] | npt.NDArray[np.integer]
#: ``("lora", name, path)``, ``("mm", identifier, offset)``, ``("cache_salt", salt)`` or
#: ``("prompt_embeds", digest)``.
_ExtraKey = tuple[str, str, str] | tuple[str, str, int] | tuple[str, str] | tuple[str, bytes]
_MmFeature = tuple[str, int, int]

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
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
    ) -> list[bytes]: ...
    def hash_blocks_array(
        self,
        token_ids: _TokenIds,
        /,
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[_MmFeature] | None = None,
    ) -> npt.NDArray[np.uint8]: ...

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
