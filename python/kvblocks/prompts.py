"""The prompts ``LLM.generate`` takes: token ids, checked before anything is scheduled.

The engine has no tokenizer, so text is refused rather than read as something else, and so
are floats and bools (``int(1.7)`` or ``int("12")`` would silently make up token ids). The
messages name the prompt and the position, as the core's token-id checks name the position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

#: One prompt: a list, tuple or range of ints, or a 1-D integer numpy array.
Prompt: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
#: What ``generate`` takes: one prompt, or a list of them (a 2-D integer array: one per row).
Prompts: TypeAlias = Prompt | Sequence[Prompt]

_TEXT = (str, bytes, bytearray)


def _is_prompt_container(obj: object) -> bool:
    return isinstance(obj, np.ndarray) or (isinstance(obj, Sequence) and not isinstance(obj, _TEXT))


def _text_hint(obj: object) -> str:
    return " (LLM.generate takes token ids, not text)" if isinstance(obj, _TEXT) else ""


def _checked_token(index: int, position: int, token: object) -> int:
    if isinstance(token, bool | np.bool_) or not isinstance(token, int | np.integer):
        raise TypeError(
            f"prompt {index}: token ids must be integers, "
            f"got {type(token).__name__} at index {position}{_text_hint(token)}"
        )
    return int(token)


def _checked_prompt(index: int, prompt: object, vocab_size: int) -> list[int]:
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise ValueError(
                f"prompt {index}: token ids must be a 1-D array, got a {prompt.ndim}-D array"
            )
        if prompt.dtype.kind not in "iu":
            raise TypeError(
                f"prompt {index}: token ids must have an integer dtype, got {prompt.dtype}"
            )
        tokens: list[int] = prompt.tolist()
    elif _is_prompt_container(prompt):
        tokens = list(prompt)  # type: ignore[call-overload]
        for position, token in enumerate(tokens):
            if type(token) is not int:  # the common case costs one check per token
                tokens[position] = _checked_token(index, position, token)
    else:
        raise TypeError(
            f"prompt {index} must be a list of token ids, "
            f"got {type(prompt).__name__}{_text_hint(prompt)}"
        )
    if not tokens:
        raise ValueError(f"prompt {index} is empty")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        position, token = next((p, t) for p, t in enumerate(tokens) if not 0 <= t < vocab_size)
        raise ValueError(
            f"prompt {index}: token id {token} at index {position} is outside the model's "
            f"vocabulary [0, {vocab_size})"
        )
    return tokens


def checked_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    """``prompts`` (one prompt or a list of them) as lists of token ids in
    ``[0, vocab_size)``; ``TypeError`` or ``ValueError`` naming the prompt and the position
    otherwise."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        batch: list[object] = list(prompts)
        if not batch:  # shape (0, n): no rows, as [] is no prompts
            raise ValueError("no prompts given")
    elif isinstance(prompts, np.ndarray):
        batch = [prompts]
    elif _is_prompt_container(prompts):
        items = list(prompts)  # type: ignore[call-overload]
        if not items:
            raise ValueError("no prompts given")
        # A batch when its first item is itself a prompt; else one prompt of token ids.
        batch = items if _is_prompt_container(items[0]) else [items]
    else:
        raise TypeError(
            "prompts must be token ids or a list of them, "
            f"got {type(prompts).__name__}{_text_hint(prompts)}"
        )
    return [_checked_prompt(i, prompt, vocab_size) for i, prompt in enumerate(batch)]
