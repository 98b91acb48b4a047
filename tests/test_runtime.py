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


POISONS = {
    "clean": None,
    "nan": (float("nan"), float("nan")),
    "inf": (float("inf"), float("-inf")),
    "garbage": (1e30, -3e38),
}


def _attention_case(
    device: str,
    block_size: int,
    groups: int,
    poison: str,
    shapes: list[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, PagedKVCache, AttentionMetadata, torch.Tensor]:
    """Four requests on scattered, shuffled blocks, with their dense reference outputs; every
    slot that is not part of a request's context (the tail of its last block, unused blocks,
    the null block 0 that pads the block table) is filled with ``POISONS[poison]``."""
    gen = torch.Generator().manual_seed(block_size * 10 + groups)
    kv_heads, head_dim = 2, 8
    heads = kv_heads * groups
    # (context length after the step, new tokens): prefixes ending mid-block and on a boundary,
    # a pure prefill, a single decode token, a one-token context.
    shapes = shapes or [(37, 5), (2 * block_size, block_size), (9, 9), (70, 1), (1, 1)]
    num_blocks = sum(-(-n // block_size) for n, _ in shapes) + 3
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered, shuffled block ids
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, device=device)
    if POISONS[poison] is not None:
        cache.key[0].fill_(POISONS[poison][0])
        cache.value[0].fill_(POISONS[poison][1])
    width = max(-(-n // block_size) for n, _ in shapes) + 1  # a padding column of block 0
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
    return torch.cat(queries).to(device), cache, meta, torch.cat(expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("poison", list(POISONS))
def test_paged_attention_matches_dense(
    device: str, block_size: int, groups: int, poison: str
) -> None:
    """Paged equals dense, and NaN, Inf or garbage in any slot outside a request's context
    changes nothing."""
    query, cache, meta, expected = _attention_case(device, block_size, groups, poison)
    if poison != "clean":
        assert not (cache.key[0][0] == 0).any()  # the poison is really there (block 0 too)
    out = paged_attention(query, cache.key[0], cache.value[0], meta, backend="torch")
    assert out.isfinite().all()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_of_very_different_lengths(device: str) -> None:
    """Decodes from 1 to 700 tokens of context (several length buckets) around prefill chunks
    of 2 to 40 tokens, in an arbitrary order, on a poisoned cache: each equals dense."""
    rng = np.random.default_rng(1)
    decodes = [(int(n), 1) for n in rng.integers(1, 700, size=40)]
    prefills = [(int(n), int(q)) for n, q in ((300, 40), (2, 2), (65, 17))]
    shapes = decodes[:20] + prefills[:2] + decodes[20:] + prefills[2:]
    query, cache, meta, expected = _attention_case(device, 16, 4, "nan", shapes)
    plan = meta.plan(16)
    assert len(plan.decode) > 1
    assert len(plan.prefill) == 3
    # Padding stays bounded: no bucket holds more than 4/3 of its requests' real contexts.
    for bucket in plan.decode:
        real = int(bucket.mask.sum()) if bucket.mask is not None else bucket.slots.numel()
        assert bucket.slots.numel() <= 4 / 3 * real + 64 * len(bucket.slots)
    out = paged_attention(query, cache.key[0], cache.value[0], meta, backend="torch")
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_nan_in_the_tail_of_the_last_block_is_never_read() -> None:
    """A NaN left in the unused tail of a request's last block: one decode token at context
    21 over blocks [2, 3] of 16."""
    cache = PagedKVCache(1, 8, 16, 2, 8)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 21, 2, 8, generator=gen)
    slots = torch.tensor([2 * 16 + p if p < 16 else 3 * 16 + p - 16 for p in range(21)])
    cache.write(0, k, v, slots)
    cache.key[0][3, 5:] = float("nan")
    cache.value[0][3, 5:] = float("nan")
    cache.key[0][0] = float("nan")  # the null block too
    meta = AttentionMetadata.from_arrays(
        np.array([[2, 3]], dtype=np.int32),
        np.array([21], dtype=np.int32),
        np.array([0, 1], dtype=np.int32),
        slots[-1:].numpy().astype(np.int32),
    )
    q = torch.randn(1, 4, 8, generator=gen)
    out = paged_attention(q, cache.key[0], cache.value[0], meta)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1)
    ).transpose(0, 1)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_auto_backend_falls_back_to_torch_once_triton_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that passed its self-check (here: a check that passes) but raises on a real
    call: one warning, the torch path's result, and torch on that device from then on."""
    from kvblocks.runtime import attention, triton_attention, triton_selfcheck

    def broken(*args: object) -> None:
        raise RuntimeError("no kernel for this GPU")

    def passing_check(device: torch.device, *args: object, **kw: object) -> object:
        return triton_selfcheck.SelfCheck(str(device), None, ())  # type: ignore[arg-type]

    monkeypatch.setattr(triton_selfcheck, "_VERIFIED", set())
    monkeypatch.setattr(triton_selfcheck, "_TORCH_ONLY", set())
    monkeypatch.setattr(triton_selfcheck, "check_kernels", passing_check)
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    monkeypatch.setattr(attention, "_TRITON_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(triton_attention, "triton_paged_attention", broken)
    query, cache, meta, expected = _attention_case("cpu", 16, 4, "nan")
    k, v = cache.key[0], cache.value[0]
    with pytest.warns(RuntimeWarning, match="no kernel for this GPU"):
        out = paged_attention(query, k, v, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not attention._auto_triton(query, k, 1.0)  # "auto" stays on torch from now on
    with pytest.raises(RuntimeError, match="no kernel"):  # an explicit choice is not hidden
        paged_attention(query, cache.key[0], cache.value[0], meta, backend="triton")


def test_bad_attention_input_is_a_clear_error() -> None:
    query, cache, meta, _ = _attention_case("cpu", 16, 1, "clean")
    k, v = cache.key[0], cache.value[0]
    with pytest.raises(ValueError, match="query tokens"):
        paged_attention(query[:-1], k, v, meta)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(query[:, :1].expand(-1, 3, -1).contiguous(), k, v, meta)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(query[..., :4], k, v, meta)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(query, k, v, meta, backend="cudnn")
    with pytest.raises(TypeError, match="floating"):
        paged_attention(query.long(), k, v, meta)
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(query, k[:2], v[:2], meta)
    with pytest.raises(ValueError, match="columns"):
        paged_attention(query, k.view(-1, 8, 2, 8), v.view(-1, 8, 2, 8), meta)
    one = np.array([0], dtype=np.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        AttentionMetadata.from_arrays(np.zeros((1, 1), np.int32), one + 3, one, one)
    with pytest.raises(ValueError, match="slots"):
        AttentionMetadata.from_arrays(
            np.zeros((1, 1), np.int32), one + 3, np.array([0, 2], np.int32), one
        )
    with pytest.raises(ValueError, match="more new tokens"):
        AttentionMetadata.from_arrays(
            np.zeros((1, 1), np.int32), one + 1, np.array([0, 2], np.int32), np.zeros(2, np.int32)
        )
    with pytest.raises(TypeError, match="integers"):
        AttentionMetadata.from_arrays(
            np.zeros((1, 1), np.float32), one + 1, np.array([0, 1], np.int32), one
        )


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


#: An override that leaves its key out of the written ``config.json``.
OMIT = object()


def _save_hf_directory(
    directory: Path, model: LlamaForCausalLM, overrides: dict[str, object] | None = None
) -> dict[str, torch.Tensor]:
    """Writes ``model`` as a Llama Hugging Face directory (config.json + model.safetensors),
    with ``overrides`` merged into the config (``OMIT`` leaves a key out); returns the state
    dict it saved."""
    from safetensors.torch import save_file

    c = model.config
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    raw |= overrides or {}
    config = {k: v for k, v in raw.items() if v is not OMIT}
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(directory / "model.safetensors"))
    return state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_bench_with_a_local_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    from kvblocks.cli import main
    from kvblocks.engine import LLM

    _save_hf_directory(tmp_path, LlamaForCausalLM.random(_config(), seed=11))
    args = ["bench", "--model", str(tmp_path), "--device", "cpu", "--dtype", dtype]
    args += ["--num-requests", "2", "--prefix-len", "16", "--suffix-len", "3"]
    code = main([*args, "--output-len", "2", "--block-size", "8", "--backend", "rust"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"model {tmp_path} on cpu, {dtype} KV cache" in out
    assert "rust" in out
    llm = LLM(tmp_path, dtype=getattr(torch, dtype), num_blocks=8, block_size=4)
    assert llm.runner.cache.key[0].dtype == getattr(torch, dtype)  # the cache keeps the dtype
    assert next(llm.model.parameters()).dtype == getattr(torch, dtype)
    got = llm.generate([[1, 2, 3, 4, 5]])[0].outputs[0].token_ids
    assert len(got) == 16
    assert all(0 <= t < 97 for t in got)  # the model's own vocabulary, not the default 512


def test_cli_bench_refuses_bad_model_device_and_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvblocks.cli import main

    small = ["--num-requests", "1", "--prefix-len", "8", "--suffix-len", "1", "--output-len", "1"]
    assert main(["bench", "--model", str(tmp_path), *small]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["bench", "--model", str(tmp_path), *small]) == 2
    assert "config.json has no 'vocab_size'" in capsys.readouterr().err
    assert main(["bench", "--device", "warp-drive", *small]) == 2
    assert "not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda", *small]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert main(["bench", "--engine", "vllm", "--dtype", "float16"]) == 2
    assert "apply to --engine kvblocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--dtype", "float64"])


def test_engine_and_runner_refuse_bad_dtype_and_backend() -> None:
    from kvblocks.engine import LLM

    model = LlamaForCausalLM.random(_config(), seed=1)
    with pytest.raises(TypeError, match="floating"):
        LLM(model, dtype=torch.int32)
    with pytest.raises(TypeError, match="floating"):
        ModelRunner(model, 8, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="attention"):
        ModelRunner(model, 8, 4, attention="flash")
    with pytest.raises(ValueError, match="torch device"):
        LLM(model, device="nowhere")


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
@pytest.mark.parametrize("tied", [True, False])
def test_load_hugging_face_directory(tmp_path: Path, layout: str, tied: bool) -> None:
    from safetensors.torch import save_file

    config = _config(tie_word_embeddings=tied, rope_theta=5000.0, attention_bias=True, head_dim=16)
    model = LlamaForCausalLM.random(config, seed=7)
    # Qwen2 declares no attention_bias: its biases come from the model type.
    overrides: dict[str, object] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "head_dim": 16,
    }
    if layout == "transformers4":
        overrides |= {"rope_theta": 5000.0, "rope_scaling": None}
    else:
        overrides |= {
            "rope_theta": OMIT,
            "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        }
    state = _save_hf_directory(tmp_path, model, overrides)
    loaded = load_pretrained(tmp_path)
    ids = torch.tensor([1, 2, 3, 50, 96])
    torch.testing.assert_close(loaded.forward_dense(ids), model.forward_dense(ids))

    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "key",
    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"],
)
def test_a_missing_config_key_is_a_value_error_naming_it(tmp_path: Path, key: str) -> None:
    _save_hf_directory(tmp_path, LlamaForCausalLM.random(_config(), seed=2), {key: OMIT})
    with pytest.raises(ValueError, match=f"config.json has no '{key}'"):
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
