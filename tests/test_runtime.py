"""The torch runtime on kvblocks' block tables: paged attention equals dense attention, the
model run step by step through the paged cache equals the model run densely, copy-on-write
branches read only their own blocks, and a Hugging Face directory loads exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the runtime needs the kvblocks[torch] extra")
F = torch.nn.functional

import kvblocks  # noqa: E402
from kvblocks.model import LlamaConfig, LlamaForCausalLM, load_pretrained  # noqa: E402
from kvblocks.runtime import AttentionMetadata, ModelRunner, PagedKVCache, paged_attention  # noqa: E402

DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("groups", [1, 4])
def test_paged_attention_matches_dense(device: str, block_size: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + groups)
    kv_heads, head_dim = 2, 8
    heads = kv_heads * groups
    # (context length after the step, new tokens): prefixes ending mid-block and on a boundary,
    # a pure prefill, a single decode token.
    shapes = [(37, 5), (2 * block_size, block_size), (9, 9), (70, 1)]
    num_blocks = sum(-(-n // block_size) for n, _ in shapes) + 3
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered, shuffled block ids
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, device=device)
    width = max(-(-n // block_size) for n, _ in shapes)
    table = np.zeros((len(shapes), width), dtype=np.int32)
    seq_lens, starts, slots, queries, expected = [], [0], [], [], []
    used = 0
    for r, (length, new) in enumerate(shapes):
        nb = -(-length // block_size)
        blocks = ids[used : used + nb]
        used += nb
        table[r, :nb] = blocks.numpy()
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        q = torch.randn(new, heads, head_dim, generator=gen)
        all_slots = torch.tensor(
            [int(blocks[p // block_size]) * block_size + p % block_size for p in range(length)]
        )
        cache.write(0, k.to(device), v.to(device), all_slots.to(device))
        slots += all_slots[length - new :].tolist()
        seq_lens.append(length)
        starts.append(starts[-1] + new)
        queries.append(q)
        # Dense reference: query j sits at position length - new + j.
        kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        qpos = torch.arange(length - new, length)[:, None]
        mask = torch.arange(length)[None, :] <= qpos
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), attn_mask=mask
        )
        expected.append(ref.transpose(0, 1))
    meta = AttentionMetadata.from_arrays(
        table,
        np.array(seq_lens, dtype=np.int32),
        np.array(starts, dtype=np.int32),
        np.array(slots, dtype=np.int32),
        device,
    )
    out = paged_attention(torch.cat(queries).to(device), cache.key[0], cache.value[0], meta)
    torch.testing.assert_close(out.cpu(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def _config(**overrides: object) -> LlamaConfig:
    base = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base.update(overrides)
    return LlamaConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_model_step_by_step_equals_dense(device: str, block_size: int) -> None:
    """Chunked prefill with prefix-cache hits, then greedy decode, through kvblocks' batched
    step and the paged cache; every request's logits equal the dense model's."""
    model = LlamaForCausalLM.random(_config(), seed=3, device=device)
    manager = kvblocks.BlockManager(64, block_size)
    runner = ModelRunner(model, 64, block_size, device=device)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 97, size=2 * block_size).tolist()
    prompts = [shared, [*shared, 5, 6, 7], rng.integers(0, 97, size=block_size + 3).tolist()]
    seqs = [list(p) for p in prompts]
    handles = [manager.add_request(f"r{i}", p) for i, p in enumerate(prompts)]
    # Admit r0 alone first so that r1 then hits its cached blocks.
    order = [[0], [1, 2]]
    chunk = 7
    for group in order:
        hs = [handles[i] for i in group]
        _, hit_tokens = manager.lookup_batch(hs)
        computed = dict(zip(group, hit_tokens.tolist(), strict=True))
        first = True
        while any(computed[i] < len(seqs[i]) for i in group):
            todo = [i for i in group if computed[i] < len(seqs[i])]
            new = [min(chunk, len(seqs[i]) - computed[i]) for i in todo]
            hits = [computed[i] if first else 0 for i in todo]
            step = manager.schedule_step(
                [handles[i] for i in todo], new, num_new_computed_tokens=hits
            )
            assert step.num_scheduled == len(todo)
            ids = [
                t
                for i, n in zip(todo, new, strict=True)
                for t in seqs[i][computed[i] : computed[i] + n]
            ]
            logits = runner.execute(step, np.array(ids))
            for row, (i, n) in enumerate(zip(todo, new, strict=True)):
                computed[i] += n
                dense = model.forward_dense(torch.tensor(seqs[i][: computed[i]], device=device))
                torch.testing.assert_close(logits[row], dense[-1], atol=1e-4, rtol=1e-4)
            first = False
    assert manager.get_computed_blocks("r1")[1] >= block_size  # r1 really hit r0's blocks
    for _ in range(5):  # greedy decode of all three
        tokens = [
            int(model.forward_dense(torch.tensor(s, device=device))[-1].argmax()) for s in seqs
        ]
        step = manager.schedule_step(
            handles, [1, 1, 1], new_token_ids=tokens, new_token_offsets=[0, 1, 2, 3]
        )
        logits = runner.execute(step, np.array(tokens))
        for row, t in enumerate(tokens):
            seqs[row].append(t)
            dense = model.forward_dense(torch.tensor(seqs[row], device=device))
            torch.testing.assert_close(logits[row], dense[-1], atol=1e-4, rtol=1e-4)
            assert int(logits[row].argmax()) == int(dense[-1].argmax())


@pytest.mark.parametrize("device", DEVICES)
def test_copy_on_write_branches_read_their_own_blocks(device: str) -> None:
    model = LlamaForCausalLM.random(_config(), seed=5, device=device)
    manager = kvblocks.BlockManager(32, 4)
    runner = ModelRunner(model, 32, 4, device=device)
    prompt = [3, 1, 4, 1, 5, 9]  # the last block holds two tokens: shared after the fork
    parent = manager.add_request("p", prompt)
    runner.execute(manager.schedule_step([parent], [6]), np.array(prompt))
    child = manager.fork("p", "c")
    branches = {parent: [*prompt, 11], child: [*prompt, 22]}
    step = manager.schedule_step(
        [parent, child], [1, 1], new_token_ids=[11, 22], new_token_offsets=[0, 1, 2]
    )
    assert step.block_copies.tolist() != []  # one branch got a private copy of the last block
    logits = runner.execute(step, np.array([11, 22]))
    for row, h in enumerate((parent, child)):
        dense = model.forward_dense(torch.tensor(branches[h], device=device))
        torch.testing.assert_close(logits[row], dense[-1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits[0], logits[1])


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
@pytest.mark.parametrize("tied", [True, False])
def test_load_hugging_face_directory(tmp_path: Path, layout: str, tied: bool) -> None:
    from safetensors.torch import save_file

    config = _config(tie_word_embeddings=tied, rope_theta=5000.0, attention_bias=True, head_dim=16)
    model = LlamaForCausalLM.random(config, seed=7)
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
    }
    if layout == "transformers4":
        raw |= {"rope_theta": 5000.0, "rope_scaling": None}
    else:
        raw |= {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_pretrained(tmp_path)
    ids = torch.tensor([1, 2, 3, 50, 96])
    torch.testing.assert_close(loaded.forward_dense(ids), model.forward_dense(ids))

    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path)


def test_config_refuses_what_it_does_not_implement() -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "architectures": ["LlamaForCausalLM"],
    }
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf_dict(base | {"rope_parameters": {"rope_type": "dynamic"}})
    with pytest.raises(ValueError, match="architecture"):
        LlamaConfig.from_hf_dict(
            base | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
        )
    linear = LlamaConfig.from_hf_dict(base | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (linear.rope_type, linear.rope_factor) == ("linear", 2.0)
    assert LlamaConfig.from_hf_dict(base).num_key_value_heads == 2


def test_half_precision_cache_runs() -> None:
    model = LlamaForCausalLM.random(_config(), seed=1, dtype=torch.bfloat16)
    manager = kvblocks.BlockManager(16, 4)
    runner = ModelRunner(model, 16, 4)
    h = manager.add_request("a", [1, 2, 3, 4, 5])
    logits = runner.execute(manager.schedule_step([h], [5]), np.array([1, 2, 3, 4, 5]))
    assert runner.cache.key[0].dtype == torch.bfloat16
    dense = model.forward_dense(torch.tensor([1, 2, 3, 4, 5]))
    torch.testing.assert_close(logits[0], dense[-1], atol=5e-2, rtol=5e-2)
