"""The block-manager calls a scheduler makes, shared by the manager tests."""

from __future__ import annotations

from typing import Any


def admit(m: Any, rid: str, tokens: list[int], **kwargs: Any) -> list[int] | None:
    """The scheduler's admission of a new request: lookup, then one allocation."""
    m.add_request(rid, tokens, **kwargs)
    hits, num_hit = m.get_computed_blocks(rid)
    return m.allocate_slots(
        rid, len(tokens) - num_hit, num_new_computed_tokens=num_hit, new_computed_blocks=hits
    )


def free_queue(m: Any) -> list[int]:
    state: dict[str, Any] = m.debug_state()
    return list(state["free_block_ids"])
