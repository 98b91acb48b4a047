"""What kvblocks adds to vLLM's block manager (copy-on-write forks, token-verified hits) and
how it refuses bad input; each test runs against the Rust manager and the reference."""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.manager_calls import admit


def test_fork_shares_blocks_and_copies_on_write(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    admit(m, "p", [1, 2, 3, 4, 5, 6])  # block 1 full, block 2 holds two tokens
    m.fork("p", "c")
    assert m.get_block_ids("c") == [1, 2]
    assert m.debug_state()["ref_counts"][1:3] == [2, 2]
    assert m.num_computed_tokens("c") == 6
    m.append_token_ids("c", 70)
    assert m.allocate_slots("c", 1) == []  # no new slot block, but a private copy of block 2
    assert m.get_block_ids("c") == [1, 3]
    copies = m.take_block_copies()
    assert copies.dtype == np.int32
    assert copies.tolist() == [[2, 3]]
    assert m.take_block_copies().shape == (0, 2)
    m.append_token_ids("p", 60)
    m.allocate_slots("p", 1)  # block 2 is no longer shared: written in place
    assert m.get_block_ids("p") == [1, 2]
    assert m.take_block_copies().tolist() == []
    assert m.debug_state()["ref_counts"][1:4] == [2, 1, 1]  # the full block stays shared
    for rid, t in (("p", 61), ("c", 71)):
        m.append_token_ids(rid, t)
        m.allocate_slots(rid, 1)
    assert m.block_hashes("p")[1] != m.block_hashes("c")[1]
    cached = m.debug_state()["cached"]
    assert cached[m.block_hashes("p")[1]] == [2]
    assert cached[m.block_hashes("c")[1]] == [3]
    m.remove_request("p")
    m.remove_request("c")
    assert m.num_free_blocks == 9


def test_fork_at_a_block_boundary_needs_no_copy(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    admit(m, "p", list(range(8)))
    m.fork("p", "c")
    m.append_token_ids("c", 9)
    assert m.allocate_slots("c", 1) == [3]
    assert m.take_block_copies().tolist() == []
    assert m.get_block_ids("c") == [1, 2, 3]


def test_fork_of_preallocated_lookahead_blocks(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    m.add_request("p", [1, 2, 3])
    m.allocate_slots("p", 3, num_lookahead_tokens=4)  # blocks 1, 2 (block 2 still empty)
    m.fork("p", "c")
    m.append_token_ids("c", [4, 5])
    assert m.allocate_slots("c", 2) == []
    # Block 1 holds three tokens (copied), block 2 holds none (replaced, not copied).
    assert m.take_block_copies().tolist() == [[1, 3]]
    assert m.get_block_ids("c") == [3, 4]


def test_fork_errors(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    m.add_request("p", [1])
    with pytest.raises(KeyError):
        m.fork("p", "p")
    with pytest.raises(KeyError):
        m.fork("nope", "c")
    assert "c" not in m
    assert len(m) == 1


def _colliding_prompt(m: Any, target: bytes, length: int, start: int) -> list[int]:
    """A prompt whose first block hash starts with the same byte as `target` (a collision
    under ``_debug_key_bytes=1``) while its tokens differ."""
    for salt in itertools.count(start):
        tokens = [salt, *range(1, length)]
        if m.hasher.hash_blocks(tokens)[0][:1] == target[:1]:
            return tokens
    raise AssertionError("unreachable")


@pytest.mark.parametrize("verify", [False, True])
def test_verify_tokens_refuses_a_colliding_hit(impl: ModuleType, verify: bool) -> None:
    m = impl.BlockManager(20, 4, _debug_key_bytes=1, verify_tokens=verify)
    admit(m, "a", [7, 7, 7, 7, 8])
    target = m.block_hashes("a")[0]
    tokens = _colliding_prompt(m, target, 5, 10_000)
    m.add_request("b", tokens)
    hits, n = m.get_computed_blocks("b")
    if verify:
        assert (hits, n) == ([], 0)
        with pytest.raises(ValueError):  # nor can the colliding block be forced in
            m.allocate_slots("b", 1, num_new_computed_tokens=4, new_computed_blocks=[1])
    else:
        assert (hits, n) == ([1], 4)  # the weak key alone would serve block 1's wrong KV


def test_a_hit_never_lists_a_block_twice(impl: ModuleType) -> None:
    """With one-byte keys a request's own second block can collide with its first (found by
    test_manager_stateful): the lookup must end the hit there (one block cannot hold two
    positions; ``allocate_slots`` refuses such a hit), and a step that looks the request up
    itself must schedule it, not raise."""
    m = impl.BlockManager(2, 1, _debug_key_bytes=1, hash_algo="sha256_cbor", hash_seed="stateful")
    m.add_request("r", [2, 3, 0], cache_salt="s")
    hashes = m.block_hashes("r")
    assert hashes[0][:1] == hashes[1][:1], "the example's first two keys collide"
    handle = m.handle("r")
    assert m.schedule_step([handle], [1]).num_scheduled == 1
    m.free("r")
    assert m.get_computed_blocks("r") == ([1], 1)
    with pytest.raises(ValueError, match="is not the request's cached block 1"):
        m.allocate_slots("r", 1, num_new_computed_tokens=2, new_computed_blocks=[1, 1])
    step = m.schedule_step([handle], [1], num_new_computed_tokens=[1])
    assert step.num_scheduled == 0  # the hit's block plus one new: the one-block pool is full


def test_verify_tokens_checks_the_parent_chain_and_extra_keys(impl: ModuleType) -> None:
    m = impl.BlockManager(30, 4, _debug_key_bytes=1, verify_tokens=True)
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    a0, a1 = m.block_hashes("a")
    # Same first block, then a second block whose key collides with a's but whose tokens differ.
    for x in itertools.count(100):
        tokens = [1, 2, 3, 4, x, 6, 7, 8, 9]
        if m.hasher.hash_blocks(tokens)[1][:1] == a1[:1]:
            break
    m.add_request("b", tokens)
    assert m.get_computed_blocks("b") == ([1], 4)
    # Same tokens as a, another adapter: every block's key differs, but collides here.
    for i in itertools.count():
        lora = (f"adapter-{i}", "/p")
        if m.hasher.hash_blocks([1, 2, 3, 4, 5], lora=lora)[0][:1] == a0[:1]:
            break
    m.add_request("c", [1, 2, 3, 4, 5], lora=lora)
    assert m.get_computed_blocks("c") == ([], 0)
    # The genuine prefix still hits.
    m.add_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert m.get_computed_blocks("d") == ([1, 2], 8)


def _state(m: Any) -> Any:
    return (m.debug_state(), {rid: m.num_computed_tokens(rid) for rid in ("a", "b") if rid in m})


def test_bad_input_raises_and_changes_nothing(impl: ModuleType) -> None:
    m = impl.BlockManager(8, 4)
    admit(m, "a", list(range(10)))
    m.add_request("b", list(range(50, 60)))
    before = _state(m)
    bad_calls: list[tuple[type[Exception], Any]] = [
        (KeyError, lambda: m.add_request("a", [1])),
        (KeyError, lambda: m.append_token_ids("zz", [1])),
        (KeyError, lambda: m.allocate_slots("zz", 1)),
        (KeyError, lambda: m.get_computed_blocks("zz")),
        (KeyError, lambda: m.free("zz")),
        (KeyError, lambda: m.remove_request("zz")),
        (KeyError, lambda: m.get_block_ids("zz")),
        (KeyError, lambda: m.block_hashes("zz")),
        (KeyError, lambda: m.num_computed_tokens("zz")),
        (TypeError, lambda: m.add_request(5, [1])),
        (TypeError, lambda: m.allocate_slots(b"a", 1)),
        (ValueError, lambda: m.add_request("c", [])),
        (ValueError, lambda: m.add_request("c", [-1])),
        (TypeError, lambda: m.add_request("c", [1.5])),
        (ValueError, lambda: m.append_token_ids("a", [2**32])),
        (ValueError, lambda: m.allocate_slots("a", 0)),
        (ValueError, lambda: m.allocate_slots("a", -1)),
        (TypeError, lambda: m.allocate_slots("a", 1.0)),
        (ValueError, lambda: m.allocate_slots("a", 1)),  # no token left to schedule
        (ValueError, lambda: m.allocate_slots("b", 11)),
        (ValueError, lambda: m.allocate_slots("b", 2, num_lookahead_tokens=-1)),
        (ValueError, lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4)),
        (
            ValueError,
            lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4, new_computed_blocks=[1]),
        ),
        (
            ValueError,
            lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4, new_computed_blocks=[0]),
        ),
        (
            ValueError,
            lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4, new_computed_blocks=[99]),
        ),
        (
            ValueError,
            lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4, new_computed_blocks=[-1]),
        ),
        (
            TypeError,
            lambda: m.allocate_slots("b", 2, num_new_computed_tokens=4, new_computed_blocks=5),
        ),
        (
            ValueError,
            lambda: m.allocate_slots("a", 1, num_new_computed_tokens=4, new_computed_blocks=[1]),
        ),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
        assert _state(m) == before
    m.free("a")
    m.free("a")  # freeing twice is a no-op, as in vLLM
    m.remove_request("a")
    with pytest.raises(KeyError):
        m.allocate_slots("a", 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((0, 16), {}, ValueError),
        ((8, 0), {}, ValueError),
        ((-1, 16), {}, ValueError),
        ((8.0, 16), {}, TypeError),
        ((8, 16), {"hash_algo": "md5"}, ValueError),
        ((8, 16), {"max_model_len": 0}, ValueError),
        ((8, 16), {"watermark": -0.5}, ValueError),
        ((8, 16), {"watermark": float("nan")}, ValueError),
        ((8, 16), {"watermark": float("inf")}, ValueError),
        ((8, 16), {"watermark": "x"}, TypeError),
        ((8, 16), {"hash_seed": 3}, TypeError),
        ((8, 16), {"enable_caching": 1}, TypeError),
    ],
)
def test_bad_constructor_arguments(
    impl: ModuleType, args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        impl.BlockManager(*args, **kwargs)


def test_sizes_by_keyword_or_by_position(impl: ModuleType) -> None:
    # The first call in docs/python-api.md, as vLLM and most Python APIs take sizes.
    by_keyword = impl.BlockManager(num_blocks=4096, block_size=16, enable_events=True)
    by_position = impl.BlockManager(4096, 16, enable_events=True)
    mixed = impl.BlockManager(4096, block_size=16)
    for m in (by_keyword, by_position, mixed):
        assert (m.num_blocks, m.block_size, m.num_free_blocks) == (4096, 16, 4095)
    with pytest.raises(TypeError):
        impl.BlockManager(4096, 16, True)  # the options stay keyword-only
    with pytest.raises(TypeError):
        impl.BlockManager(4096, num_blocks=4096, block_size=16)


@pytest.mark.parametrize("request_id", ["req-1", "it's", 'say "hi"', "tab\there", "ünï", ""])
def test_key_errors_quote_the_id_once_as_repr_does(impl: ModuleType, request_id: str) -> None:
    m = impl.BlockManager(8, 4)
    with pytest.raises(KeyError) as info:
        m.get_block_ids(request_id)
    assert info.value.args == (f"unknown request id {request_id!r}",)
    handle = m.add_request(request_id, [1, 2])
    for duplicate in (lambda: m.add_request(request_id, [3]), lambda: m.fork(handle, request_id)):
        with pytest.raises(KeyError) as info:
            duplicate()
        assert info.value.args == (f"request id {request_id!r} already exists",)
    m.remove_request(handle)
    with pytest.raises(KeyError) as info:
        m.get_block_ids(handle)
    assert info.value.args == (f"unknown request handle {handle}",)


def test_a_preempted_request_hits_its_own_blocks(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    admit(m, "a", list(range(10)))
    m.append_token_ids("a", [10, 11])
    m.allocate_slots("a", 2)
    m.free("a")  # preemption: tokens and hashes stay
    assert m.num_computed_tokens("a") == 0
    assert m.get_block_ids("a") == []
    assert m.get_computed_blocks("a") == ([1, 2], 8)  # 12 tokens: the cap keeps 11 -> 2 blocks
    assert m.get_token_ids("a") == list(range(12))
