"""Argument checks of the reference, raising what the native glue raises for the same input."""

from __future__ import annotations

import array
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_TOKEN_LIMIT = 2**32
# An array typecode holding exactly the token range (C unsigned int or long, whichever is 32-bit).
_U32 = next(code for code in "ILH" if array.array(code).itemsize == 4)


def int_arg(value: Any, what: str) -> int:
    """An int (not a bool) that fits 64 bits."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if not _I64_MIN <= number <= _I64_MAX:
        raise ValueError(f"{what} {number} is out of range")
    return number


def size_arg(value: Any, what: str, minimum: int) -> int:
    number = int_arg(value, what)
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def str_arg(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def _token(index: int, item: Any) -> int:
    if isinstance(item, bool | np.bool_):
        raise TypeError(f"token ids must be integers, got bool at index {index}")
    try:
        value = operator.index(item)
    except TypeError:
        raise TypeError(
            f"token ids must be integers, got {type(item).__name__} at index {index}"
        ) from None
    if not 0 <= value < _TOKEN_LIMIT:
        raise ValueError(f"token id {value} at index {index} is out of range [0, 2**32)")
    return value


def _from_ndarray(array: np.ndarray[Any, Any]) -> list[int]:
    if array.ndim != 1:
        raise ValueError(f"token ids must be a 1-D array, got a {array.ndim}-D array")
    if array.dtype.kind not in "iu":
        raise TypeError(f"token ids must have an integer dtype, got {array.dtype.str}")
    values: list[int] = array.tolist()
    return [_token(i, v) for i, v in enumerate(values)]


def _all_in_range(values: list[int] | tuple[int, ...]) -> bool:
    try:
        array.array(_U32, values)  # a C loop that rejects negative and too-large values
    except OverflowError:
        return False
    return True


def token_ids(obj: Any) -> list[int]:
    """Token ids as a list of ints in ``[0, 2**32)``; the same inputs and errors as native."""
    return token_ids_from(obj, 0)


def token_ids_from(obj: Any, start: int) -> list[int]:
    """The token ids of ``obj`` from position ``start`` on. A list or tuple is read from
    ``start`` only; ``start`` past the end is a ``ValueError``."""
    if isinstance(obj, list | tuple):
        if start > len(obj):
            raise ValueError(f"start position {start} is past the end ({len(obj)} tokens)")
        tail = obj[start:]
        # Fast path in C loops; the element-wise loop below finds and reports the bad token.
        if set(map(type, tail)) <= {int} and _all_in_range(tail):
            return list(tail)
        return [_token(start + i, v) for i, v in enumerate(tail)]
    values = _other_token_ids(obj)
    if start > len(values):
        raise ValueError(f"start position {start} is past the end ({len(values)} tokens)")
    return values[start:]


def _other_token_ids(obj: Any) -> list[int]:
    if isinstance(obj, np.ndarray):
        return _from_ndarray(obj)
    if isinstance(obj, str | bytes | bytearray):
        raise TypeError(f"token ids must be a sequence of integers, got {type(obj).__name__}")
    try:
        view = memoryview(obj)
    except TypeError:
        pass
    else:
        return _from_ndarray(np.asarray(view))
    if not isinstance(obj, Iterable):
        raise TypeError(f"token ids must be a sequence of integers, got {type(obj).__name__}")
    return [_token(i, v) for i, v in enumerate(obj)]


def one_or_many_token_ids(obj: Any) -> list[int]:
    if isinstance(obj, int | np.integer) and not isinstance(obj, bool):
        return [_token(0, obj)]
    return token_ids(obj)
