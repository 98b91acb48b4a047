"""``kvblocks.router.openai`` against vLLM's own rendering of the same OpenAI bodies.

The oracle is vLLM's ``OnlineRenderer`` (``vllm.renderers.online_renderer``), built as the
API server builds it (``init_app_state``, and the CPU-only render server's
``init_render_app_state``): over ``renderer_from_config(VllmConfig)`` on a ``ModelConfig``
of the same model directory, so vLLM loads its own tokenizer from the files. Its
``render_completion(CompletionRequest)`` and ``render_chat(ChatCompletionRequest)`` are
the calls ``OpenAIServingCompletion`` and ``OpenAIServingChat`` make after checking the
model name, and return the ``EngineInput`` s whose ``prompt_token_ids`` the server hands to
``EngineClient.generate`` (the engine's input processor only validates them). That is the
lowest level that still includes everything between the request body and the engine:
pydantic validation of the request, the chat template's choice and content format, the
message parsing, the template arguments, tokenization and truncation.

Two tokenizer families are built here, with no download: a byte-level BPE with a
Llama-3-like template stored in ``tokenizer_config.json`` (content format "string", tools,
documents, no developer role) and a Unigram (SentencePiece-style) tokenizer with a
ChatML-like template in ``chat_template.jinja`` (content format "openai" through a macro,
developer role, reasoning, ``enable_thinking``). Every body is rendered by vLLM and by
:class:`~kvblocks.router.openai.Tokenizers`, and the token ids must be equal; bodies vLLM
refuses must give None. Template shapes set as the server's template (``SHAPES``) check the
content-format detection through the tokens in the same way.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvblocks.router.openai import CHAT_COMPLETIONS as CHAT
from kvblocks.router.openai import COMPLETIONS, Prompt, ServedModel, Tokenizers
from tests.vllm_driver.config import scheduler_only_cpu_platform

# vLLM's chat request reads its own deprecated max_tokens field when it builds the limits.
pytestmark = pytest.mark.filterwarnings("ignore:max_tokens is deprecated:DeprecationWarning")

MAX_MODEL_LEN = 512

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Bonjour le monde, ça va ? Grüße aus München, naïve café.",
    "数据 中文 日本語のテキスト 한국어 العربية",
    "def add(x, y):\n    return x + y  # a function",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "emoji 🙂 🚀 and symbols ∑ ≤ ≥",
]

# A Llama-3-like template: content read as a string (trimmed), tools dumped as JSON,
# documents, a date argument, and no developer role.
LLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if date_string is not defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Today Date: ' + date_string + '\n\n' }}
{%- if tools is not none %}
    {{- 'You may call these functions:\n' }}
    {%- for t in tools %}{{- t | tojson(indent=2) }}{{- '\n\n' }}{%- endfor %}
{%- endif %}
{%- if documents %}
    {%- for d in documents %}{{- 'Document: ' + d['title'] + '\n' + d['text'] + '\n' }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' and message.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' }}
            {{- call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# A ChatML-like template that takes content as a list of parts (through a macro, reading a
# part's extra field), knows the developer role, shows names and reasoning, and turns
# thinking off on request.
CHATML_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- else -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}
{%- if part.cache_control is defined %}{{ '<cache>' }}{% endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set roles = ['system', 'developer', 'user', 'assistant', 'tool'] -%}
{%- if tools -%}
{{- '<|im_start|>system\n# Tools\n' }}{%- for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor -%}
{{- '<|im_end|>\n' }}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role not in roles -%}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif -%}
{{- '<|im_start|>' + message.role }}
{%- if message.name is defined and message.name %}{{ ' (' + message.name + ')' }}{% endif -%}
{{- '\n' }}
{%- if message.role == 'assistant' and message.reasoning_content is defined
      and message.reasoning_content -%}
{{- '<think>' + message.reasoning_content + '</think>' }}
{%- endif -%}
{{- text(message.content) }}
{%- if message.tool_calls is defined -%}
{%- for call in message.tool_calls -%}
{{- '<tool_call>' }}{{ call | tojson }}{{ '</tool_call>' }}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif -%}
{%- endif -%}
"""

# The server's own --chat-template for the "llama-served" setup.
SERVER_TEMPLATE = r"""{%- for message in messages -%}
{{- '[' + message['role'] + '] ' + message['content'] + '\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '[assistant] ' }}{% endif -%}
{%- if greeting is defined %}{{ greeting }}{% endif -%}
"""


def _llama_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }


def _write_bpe(path: Path) -> Path:
    """A byte-level BPE (GPT-2 / Llama 3 style) that adds a BOS token, its chat template in
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA_TEMPLATE
    fast.save_pretrained(path, save_jinja_files=False)
    assert not (path / "chat_template.jinja").exists()
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    (path / "config.json").write_text(json.dumps(_llama_config(tok.get_vocab_size())))
    return path


def _write_unigram(path: Path) -> Path:
    """A Unigram tokenizer (SentencePiece style: NFKC, metaspace) that appends an EOS
    token, its chat template in chat_template.jinja."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(CORPUS * 10, trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    config = _llama_config(tok.get_vocab_size())
    config.update(architectures=["GraniteForCausalLM"], model_type="granite")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "bpe": _write_bpe(tmp_path_factory.mktemp("bpe")),
        "unigram": _write_unigram(tmp_path_factory.mktemp("unigram")),
    }


# The setups: a served name, its directory, and the server's options.
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("bpe", {}),
    "chatml": ("unigram", {}),
    "llama-served": (
        "bpe",
        {"chat_template": SERVER_TEMPLATE, "default_chat_template_kwargs": {"greeting": "Hi!"}},
    ),
}


@pytest.fixture(scope="module")
def tokenizers(model_dirs: dict[str, Path]) -> Tokenizers:
    models = {
        name: ServedModel(model_dirs[family], max_model_len=MAX_MODEL_LEN, **options)
        for name, (family, options) in SETUPS.items()
    }
    return Tokenizers(models, lora_adapters={"llama-sql": "llama"})


class Oracle:
    """vLLM's server-side rendering of OpenAI bodies for one model directory."""

    def __init__(self, model_dir: Path, options: dict[str, Any]) -> None:
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        model_config = ModelConfig(
            model=str(model_dir), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN
        )
        with scheduler_only_cpu_platform():  # vLLM 0.34's CPU check wants Triton: no model runs
            vllm_config = VllmConfig(model_config=model_config)
        renderer = renderer_from_config(vllm_config)
        self.online = OnlineRenderer(
            model_config,
            renderer,
            request_logger=None,
            chat_template=options.get("chat_template"),
            chat_template_content_format="auto",
            default_chat_template_kwargs=options.get("default_chat_template_kwargs"),
        )

    def prompts(self, path: str, body: dict[str, Any]) -> list[list[int]] | None:
        """The prompt token ids vLLM's server would feed its engine, or None where it
        refuses the body."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMValidationError

        body = copy.deepcopy(body)
        try:
            if path == COMPLETIONS:
                result: Any = asyncio.run(self.online.render_completion(CompletionRequest(**body)))
            else:
                result = asyncio.run(self.online.render_chat(ChatCompletionRequest(**body)))
                if not isinstance(result, ErrorResponse):
                    result = result[1]
        except (ValidationError, VLLMValidationError, ValueError):
            return None
        if isinstance(result, ErrorResponse):
            return None
        return [list(engine_input["prompt_token_ids"]) for engine_input in result]


@pytest.fixture(scope="module")
def oracles(model_dirs: dict[str, Path]) -> dict[str, Oracle]:
    return {name: Oracle(model_dirs[family], options) for name, (family, options) in SETUPS.items()}


def _vllm_version() -> tuple[int, ...]:
    from kvblocks.vllm.versions import installed_vllm_version

    return tuple(int(p) for p in installed_vllm_version().split(".")[:2])


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [
    SYSTEM,
    user("Hello, how are you today?"),
    {"role": "assistant", "content": "I am fine, thank you."},
    user("What is the quick brown fox doing?"),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
TOOL_TURNS = [
    user("Weather in Paris?"),
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": parts("sunny", "21 C")},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]
UNICODE = "Grüße 🙂 数据 日本語 العربية naïve café ∑≤≥ \u200b\u00a0end"

# Chat bodies every setup renders (the model is filled in per setup).
CHAT_BODIES: dict[str, dict[str, Any]] = {
    "one-turn": {"messages": [user("Hello, world!")]},
    "multi-turn": {"messages": TURNS},
    "parts": {
        "messages": [
            {"role": "system", "content": parts("You are a helpful", "assistant.")},
            user(parts("Hello,", "world!", "How are you?")),
        ]
    },
    "mixed-parts": {
        "messages": [
            user(
                [
                    {"type": "text", "text": "first", "cache_control": {"type": "ephemeral"}},
                    "plain string part",
                    {"type": "text", "text": ""},
                    {"type": "input_text", "text": "input text"},
                    {"type": "refusal", "refusal": "I refuse"},
                    {"type": "thinking", "thinking": "hmm", "closed": True},
                ]
            )
        ]
    },
    "empty-content": {"messages": [SYSTEM, user(""), {"role": "assistant", "content": None}]},
    "no-generation-prompt": {"messages": TURNS, "add_generation_prompt": False},
    "continue-final": {
        "messages": [*TURNS, {"role": "assistant", "content": "The fox is "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "kwargs": {
        "messages": TURNS,
        "chat_template_kwargs": {
            "date_string": "1 Jan 2025",
            "enable_thinking": False,
            "greeting": "Hello there",
            "not_a_template_variable": 1,
            "add_generation_prompt": False,  # the request field wins
        },
    },
    "kwargs-none": {"messages": TURNS, "chat_template_kwargs": {"date_string": None}},
    "reasoning-effort": {"messages": TURNS, "reasoning_effort": "none"},
    "special-tokens": {"messages": TURNS, "add_special_tokens": True},
    "unicode": {"messages": [SYSTEM, user(UNICODE), {"role": "assistant", "content": UNICODE}]},
    "names": {"messages": [SYSTEM, {"role": "user", "content": "Hi", "name": "bob"}]},
    "reasoning": {
        "messages": [
            user("2+2?"),
            {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"},
            user("3+3?"),
            {"role": "assistant", "content": "6", "reasoning": "3 and 3 make 6"},
            user("Thanks"),
        ]
    },
    "developer": {
        "messages": [
            SYSTEM,
            user("Hello"),
            {"role": "developer", "content": "Be terse."},
            {"role": "developer", "content": parts("Answer", "in French.")},
            user("Bye"),
        ]
    },
    "billing-header": {
        "messages": [
            {
                "role": "system",
                "content": parts(
                    "x-anthropic-billing-header: cc_version=1.0; cch=abc123\nYou are helpful.",
                    "x-anthropic-billing-header: cch=only",
                ),
            },
            user("Hello"),
        ]
    },
    "tools": {"messages": TOOL_TURNS, "tools": TOOLS, "tool_choice": "none"},
    "tool-history": {"messages": TOOL_TURNS},
    "documents": {
        "messages": [user("Summarize.")],
        "documents": [{"title": "Fox", "text": "The quick brown fox."}],
    },
    "truncate": {"messages": TURNS, "truncate_prompt_tokens": 20},
    "truncate-left": {"messages": TURNS, "truncate_prompt_tokens": 20, "truncation_side": "left"},
    "truncate-right": {
        "messages": TURNS,
        "truncate_prompt_tokens": 20,
        "truncation_side": "right",
    },
    "truncate-max": {"messages": TURNS, "truncate_prompt_tokens": -1},
    "cache-salt": {"messages": TURNS, "cache_salt": "s3cr3t-salt"},
    "forwarded-ids": {
        "messages": TURNS,
        "kv_transfer_params": {"prompt_token_ids": [5, 6, 7, 8], "do_remote_prefill": False},
    },
}

# Completion bodies.
COMPLETION_BODIES: dict[str, dict[str, Any]] = {
    "text": {"prompt": "The quick brown fox jumps over the lazy dog."},
    "token-ids": {"prompt": [5, 17, 42, 99, 3]},
    "batch-text": {"prompt": ["Hello, world!", "", UNICODE]},
    "batch-ids": {"prompt": [[1, 2, 3], [4, 5], [6]]},
    "no-special-tokens": {"prompt": "Hello, world!", "add_special_tokens": False},
    "unicode": {"prompt": UNICODE},
    "whitespace": {"prompt": "  leading and trailing spaces  \n\ttab"},
    "truncate": {"prompt": " ".join(CORPUS), "truncate_prompt_tokens": 12},
    "truncate-right": {
        "prompt": " ".join(CORPUS),
        "truncate_prompt_tokens": 12,
        "truncation_side": "right",
    },
    "truncate-ids": {"prompt": list(range(1, 40)), "truncate_prompt_tokens": 7},
    "truncate-max": {"prompt": " ".join(CORPUS), "truncate_prompt_tokens": -1, "max_tokens": 0},
    "cache-salt": {"prompt": "Hello", "cache_salt": "salt"},
}

# Bodies vLLM refuses, with the reason counted here.
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "empty-prompt": (COMPLETIONS, {"prompt": ""}, "invalid"),
    "no-prompt": (COMPLETIONS, {}, "invalid"),
    "mixed-batch": (COMPLETIONS, {"prompt": ["text", [1, 2]]}, "invalid"),
    "suffix": (COMPLETIONS, {"prompt": "def f(", "suffix": "return x"}, "suffix"),
    "bad-salt": (COMPLETIONS, {"prompt": "x", "cache_salt": "a/b"}, "invalid"),
    "empty-salt": (COMPLETIONS, {"prompt": "x", "cache_salt": ""}, "invalid"),
    "too-long": (COMPLETIONS, {"prompt": list(range(1, MAX_MODEL_LEN + 2))}, "too_long"),
    "too-long-text": (COMPLETIONS, {"prompt": " ".join(CORPUS) * 20}, "too_long"),
    "max-tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, "invalid"),
    "no-messages": (CHAT, {}, "invalid"),
    "both-prompts": (
        CHAT,
        {"messages": TURNS, "continue_final_message": True, "add_generation_prompt": True},
        "invalid",
    ),
    "request-template": (CHAT, {"messages": TURNS, "chat_template": "{{ 1 }}"}, "chat_template"),
    "kwargs-template": (
        CHAT,
        {"messages": TURNS, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        "chat_template",
    ),
    "tool-choice-without-tools": (CHAT, {"messages": TURNS, "tool_choice": "auto"}, "invalid"),
}


def _check(
    tokenizers: Tokenizers, oracle: Oracle, model: str, path: str, body: dict[str, Any]
) -> list[Prompt] | None:
    body = {"model": model, **body}
    before = copy.deepcopy(body)
    expected = oracle.prompts(path, body)
    got = tokenizers.prompts(path, body)
    assert body == before, "the body was changed"
    assert expected is not None, "vLLM refused a body this test means to be valid"
    assert got is not None, tokenizers.counts
    assert [p.token_ids for p in got] == expected
    return got


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("case", list(CHAT_BODIES))
def test_chat_matches_vllm(
    tokenizers: Tokenizers, oracles: dict[str, Oracle], setup: str, case: str
) -> None:
    got = _check(tokenizers, oracles[setup], setup, CHAT, CHAT_BODIES[case])
    assert got is not None
    [prompt] = got
    assert prompt.model == setup
    assert prompt.cache_salt == CHAT_BODIES[case].get("cache_salt")
    assert prompt.lora_name is None


@pytest.mark.parametrize("setup", ["llama", "chatml"])
@pytest.mark.parametrize("case", list(COMPLETION_BODIES))
def test_completion_matches_vllm(
    tokenizers: Tokenizers, oracles: dict[str, Oracle], setup: str, case: str
) -> None:
    got = _check(tokenizers, oracles[setup], setup, COMPLETIONS, COMPLETION_BODIES[case])
    assert got is not None
    assert all(p.cache_salt == COMPLETION_BODIES[case].get("cache_salt") for p in got)


@pytest.mark.parametrize("setup", ["llama", "chatml"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_by_vllm_gives_none(
    tokenizers: Tokenizers, oracles: dict[str, Oracle], setup: str, case: str
) -> None:
    path, body, reason = REFUSED[case]
    body = {"model": setup, **body}
    assert oracles[setup].prompts(path, body) is None, "vLLM accepted a body meant to be refused"
    before = dict(tokenizers.counts)
    assert tokenizers.prompts(path, body) is None
    assert tokenizers.counts.get(reason, 0) == before.get(reason, 0) + 1, tokenizers.counts


def test_template_error(tokenizers: Tokenizers, oracles: dict[str, Oracle]) -> None:
    """The ChatML template raises on an unknown role; vLLM answers 400."""
    body = {"model": "chatml", "messages": [{"role": "narrator", "content": "Once upon"}]}
    assert oracles["chatml"].prompts(CHAT, body) is None
    before = tokenizers.counts.get("template_error", 0)
    assert tokenizers.prompt_of(CHAT, body) is None
    assert tokenizers.counts["template_error"] == before + 1
    # The Llama-like template takes any role.
    _check(tokenizers, oracles["llama"], "llama", CHAT, {"messages": [body["messages"][0]]})


def test_empty_tools(tokenizers: Tokenizers, oracles: dict[str, Oracle]) -> None:
    """``tools: []``: vLLM 0.34 renders without tools, 0.33 refuses; this module renders
    as 0.34 does (routing a request its replica refuses costs nothing)."""
    body = {"model": "llama", "messages": TURNS, "tools": [], "tool_choice": "auto"}
    expected = oracles["llama"].prompts(CHAT, body)
    got = tokenizers.prompt_of(CHAT, body)
    assert got is not None
    if _vllm_version() >= (0, 34):
        assert expected == [got.token_ids]
    else:
        assert expected is None
        assert oracles["llama"].prompts(CHAT, {**body, "tools": None, "tool_choice": "none"}) == [
            got.token_ids
        ]


def test_unhandled_bodies(tokenizers: Tokenizers) -> None:
    """Bodies this module does not reproduce (vLLM would fetch media, load prompt
    embeddings or check the model name first): None, counted by reason, never raised."""
    cases: list[tuple[str, Any, str]] = [
        (CHAT, {"model": "nope", "messages": TURNS}, "unknown_model"),
        (CHAT, {"messages": TURNS}, "unknown_model"),  # several models: model is needed
        (
            CHAT,
            {
                "model": "llama",
                "messages": [
                    user(
                        [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}},
                        ]
                    )
                ],
            },
            "multimodal",
        ),
        (CHAT, {"model": "llama", "messages": [user([{"type": "input_audio"}])]}, "multimodal"),
        (
            CHAT,
            {"model": "llama", "messages": [user([{"type": "prompt_embeds", "data": "AAAA"}])]},
            "prompt_embeds",
        ),
        (COMPLETIONS, {"model": "llama", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        (COMPLETIONS, {"model": "llama", "prompt": ["a", "b"]}, "batch"),
        ("/v1/embeddings", {"model": "llama", "input": "x"}, "unknown_path"),
        (CHAT, {"model": "llama", "messages": "Hello"}, "invalid"),
        (CHAT, {"model": "llama", "messages": [{"content": "no role"}]}, "invalid"),
        (CHAT, {"model": "llama", "messages": [user(42)]}, "invalid"),
        (CHAT, {"model": "llama", "messages": TURNS, "add_generation_prompt": None}, "invalid"),
        (CHAT, {"model": ["llama"], "messages": TURNS}, "invalid"),
        (CHAT, None, "invalid"),
        (
            CHAT,
            {"model": "llama", "messages": TURNS, "chat_template_kwargs": {"tokenize": True}},
            "chat_template",
        ),
    ]
    for path, body, reason in cases:
        before = tokenizers.counts.get(reason, 0)
        assert tokenizers.prompt_of(path, body) is None, (path, body)
        assert tokenizers.counts.get(reason, 0) == before + 1, (body, reason, tokenizers.counts)


def test_lora_adapter_uses_its_base_tokenizer(tokenizers: Tokenizers) -> None:
    """vLLM renders a LoRA request with the base model's tokenizer; the prompt names both."""
    body = {"messages": TURNS, "cache_salt": "salt"}
    base = tokenizers.prompt_of(CHAT, {"model": "llama", **body})
    adapted = tokenizers.prompt_of(CHAT, {"model": "llama-sql", **body})
    assert base is not None
    assert adapted == Prompt("llama", base.token_ids, "salt", "llama-sql")


def test_single_model_needs_no_name(model_dirs: dict[str, Path]) -> None:
    """vLLM serves a request without ``model`` with its model."""
    tokenizers = Tokenizers({"only": model_dirs["unigram"]})
    prompt = tokenizers.prompt_of(COMPLETIONS, {"prompt": "Hello"})
    assert prompt is not None
    assert prompt.model == "only"
    assert prompt.token_ids == tokenizers.tokenizer("only")("Hello")["input_ids"]


def test_unsupported_models_are_listed(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    """Models vLLM renders with something else than their Hugging Face tokenizer and chat
    template are not loaded; their requests give None."""
    harmony = tmp_path / "gpt-oss"
    harmony.mkdir()
    (harmony / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "consolidated.safetensors").write_bytes(b"")
    (mistral / "tekken.json").write_text("{}")
    tokenizers = Tokenizers({"gpt-oss": harmony, "mistral": mistral, "ok": model_dirs["bpe"]})
    assert set(tokenizers.unsupported) == {"gpt-oss", "mistral"}
    assert tokenizers.prompt_of(COMPLETIONS, {"model": "gpt-oss", "prompt": "x"}) is None
    assert tokenizers.counts == {"unsupported_model": 1}
    with pytest.raises(FileNotFoundError):
        Tokenizers({"missing": tmp_path / "missing"})
    with pytest.raises(ValueError, match="not a served model"):
        Tokenizers({"ok": model_dirs["bpe"]}, lora_adapters={"a": "nope"})


# Template shapes for vLLM's content-format detection: each prints a message's content as
# it gets it (a list of parts prints unlike the joined text) and may loop over it.
SHAPES: dict[str, str] = {
    "plain": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "loop": "{% for m in messages %}{{ m.content }}{% for p in m.content %}.{% endfor %}"
    "{% endfor %}",
    "alias": "{% set msgs = messages[1:] %}{% for m in msgs %}{{ m['content'] }}"
    "{% for p in m['content'] %}.{% endfor %}{% endfor %}",
    "namespace": "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{{ m.content }}"
    "{% for p in m.content %}.{% endfor %}{% endfor %}",
    "namespace-set": "{% set ns = namespace(x=[]) %}{% set ns.x = messages %}"
    "{% for m in ns.x %}{{ m.content }}{% for p in m.content %}.{% endfor %}{% endfor %}",
    "filtered": "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ m.content }}"
    "{% for p in m.content | list %}.{% endfor %}{% endfor %}",
    "macro-kwarg": "{% macro r(c) %}{% for p in c %}.{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{{ r(c=m.content) }}{% endfor %}",
    "macro-unrelated": "{% macro r(c) %}{% for p in c %}.{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{{ r(m.role) }}{% endfor %}",
    "content-variable": "{% for m in messages %}{% set content = m.content %}"
    "{% for x in content %}.{% endfor %}{{ content }}{% endfor %}",
    "tuple-target": "{% for m in messages %}{{ m.content }}{% for p in m.content %}.{% endfor %}"
    "{% endfor %}{% if false %}{% for a, b in messages %}{% endfor %}{% endif %}",
    "indexed": "{% for m in messages %}{{ m.content }}{{ m.content[0] }}{% endfor %}",
    "conditional": "{% for m in messages %}{{ m.content }}"
    "{% for p in (m.content if m.content is string else []) %}.{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_content_format_matches_vllm(model_dirs: dict[str, Path], shape: str) -> None:
    """The content format vLLM detects in a template, seen through the tokens: the template
    is the server's ``--chat-template`` on both sides."""
    options = {"chat_template": SHAPES[shape]}
    oracle = Oracle(model_dirs["bpe"], options)
    tokenizers = Tokenizers(
        {"m": ServedModel(model_dirs["bpe"], max_model_len=MAX_MODEL_LEN, **options)}
    )
    body = {"messages": [SYSTEM, user(parts("one", "two")), user("three")]}
    _check(tokenizers, oracle, "m", CHAT, body)


@functools.cache
def _repo() -> Path:
    return Path(__file__).resolve().parents[2]


def test_imports_without_transformers_or_vllm(model_dirs: dict[str, Path]) -> None:
    """The module imports where neither is installed; building Tokenizers then says what
    to install."""
    script = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "sys.modules['vllm'] = None\n"
        "from kvblocks.router.openai import Prompt, Tokenizers\n"
        "Prompt('m', [1])\n"
        "try:\n"
        f"    Tokenizers({{'m': {str(model_dirs['bpe'])!r}}})\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=_repo()
    )
    assert 'pip install "kvblocks[gateway]"' in out.stdout, out.stderr


def test_the_picker_scores_chats_on_vllms_rendering(
    tokenizers: Tokenizers, oracles: dict[str, Oracle]
) -> None:
    """The endpoint picker with these tokenizers: a chat goes to the replica holding the
    leading blocks of the token ids vLLM's own renderer makes of it, with that many tokens
    predicted cached; a chat of another system prompt scores no hit anywhere."""
    pytest.importorskip("grpc")
    pytest.importorskip("prometheus_client")
    from kvblocks._core import BlockHasher
    from kvblocks.router.fleet import load_fleet
    from kvblocks.router.picker import EndpointPicker, LoadBoard, Settings, parse_vllm_metrics
    from kvblocks.router.scorer import RouteService

    idle = parse_vllm_metrics(
        'vllm:num_requests_running{model_name="llama"} 0\n'
        'vllm:num_requests_waiting{model_name="llama"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="llama"} 0.1\n'
    )

    class IdleBoard(LoadBoard):
        """Every replica idle as of now (no replica process in this test)."""

        def scrape(self, name: str) -> None:
            with self._lock:
                slot = self._slots[name]
                slot.load, slot.scraped_at, slot.inflight = idle, time.monotonic(), 0

    replicas = [{"name": n, "url": f"http://127.0.0.{i + 1}:8000"} for i, n in enumerate("ab")]
    fleet = load_fleet({"replicas": [{**r, "models": ["llama", "chatml"]} for r in replicas]})
    service = RouteService(fleet)
    try:
        settings = Settings(scrape_interval=60)
        board = IdleBoard({r["name"]: r["url"] for r in replicas}, 60, settings.stale_after)
        for name in board.urls:
            board.scrape(name)
        picker = EndpointPicker(
            fleet, service, tokenize=tokenizers.prompt_of, settings=settings, board=board
        )
        system = {"role": "system", "content": "You answer questions about the sea. " * 12}
        body = {"model": "llama", "messages": [system, user("How deep is it?")]}
        expected = oracles["llama"].prompts(CHAT, body)
        assert expected is not None
        ids = expected[0]
        assert len(ids) >= 64, len(ids)
        # the fleet's replicas: SHA-256 engines without PYTHONHASHSEED (vLLM's fixed seed)
        none_hash = BlockHasher("sha256", seed=BlockHasher.engine_seed("sha256")).none_hash
        hashes = BlockHasher("sha256", block_size=16).hash_blocks(ids, parent=none_hash)
        held = [int.from_bytes(h[-8:], "big") for h in hashes[:3]]
        event = type("BlockStored", (), {"block_hashes": held, "medium": "GPU", "group_idx": 0})
        service.index.apply_events("b", [event()])
        decision = picker.decide(CHAT, json.dumps(body).encode())
        assert (decision.outcome, decision.unscored) == ("routed", None), decision
        assert (decision.replica, decision.hit_tokens) == ("b", 48), decision
        assert decision.prompt_tokens == len(ids)
        other = {"model": "chatml", "messages": [system, user("How deep is it?")]}
        decision = picker.decide(CHAT, json.dumps(other).encode())
        assert (decision.unscored, decision.hit_tokens) == (None, 0), decision
    finally:
        service.close()


def test_chats_are_tokenized_by_pieces_and_checked(
    tokenizers: Tokenizers, oracles: dict[str, Oracle], model_dirs: dict[str, Path]
) -> None:
    """A rendered chat is tokenized by its pieces between the template's special tokens, each
    piece's ids kept: a chat sent again (its history, its system prompt) reuses them, and the
    ids stay vLLM's. A tokenizer whose pieces would not add up is never tokenized that way,
    and a difference found by the check turns the pieces off, the whole text's ids used."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvblocks.router.openai import _Segments

    for name in ("llama", "chatml"):
        pieces = tokenizers._served[name].tokenizer.segments
        assert pieces is not None, name
        system = {"role": "system", "content": "You answer questions about the sea. " * 9}
        body = {"model": name, "messages": [system, user("How deep is it?")]}
        expected = oracles[name].prompts(CHAT, body)
        assert expected is not None
        hits = pieces.hits
        for _ in range(3):
            prompt = tokenizers.prompt_of(CHAT, body)
            assert prompt is not None
            assert prompt.token_ids == expected[0]
        assert pieces.hits > hits
        assert pieces.mismatches == 0
    # Metaspace prepending to the text's first piece alone: pieces would not add up
    first_only = Tokenizer.from_file(str(model_dirs["unigram"] / "tokenizer.json"))
    first_only.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert _Segments.of(PreTrainedTokenizerFast(tokenizer_object=first_only)) is None
    # pieces split where no added token is: the check finds the difference
    llama = tokenizers._served["llama"].tokenizer
    assert llama.segments is not None
    backend = llama.hf._tokenizer
    wrong = _Segments(backend, {**llama.segments.added, "ea": 7})
    text = "You answer questions about the sea."
    whole = backend.encode(text, add_special_tokens=False).ids
    assert wrong.encode(text) == whole
    assert (wrong.mismatches, wrong.enabled) == (1, False)
    assert wrong.encode(text) is None
