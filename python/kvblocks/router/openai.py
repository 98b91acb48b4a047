"""OpenAI request bodies to the token ids a vLLM server feeds its engine, for routing.

The router predicts each replica's prefix-cache hit from a prompt's token ids
(:meth:`kvblocks.router.index.RoutingIndex.score`), but clients send OpenAI requests: a
``/v1/completions`` body with a ``prompt``, or a ``/v1/chat/completions`` body with
``messages`` that the server renders through the model's chat template. :class:`Tokenizers`
does what vLLM's OpenAI server does to such a body before the engine sees it, with the same
Hugging Face tokenizer loaded the way vLLM loads it, and returns :class:`Prompt` s.

What is reproduced (vLLM 0.33 and 0.34 render alike here but for two cases, where this
module follows 0.34: ``tools: []``, which 0.33 refuses, and a processor with several named
chat templates, whose ``"default"`` 0.34 takes and 0.33 fails on):

- the tokenizer: ``AutoTokenizer.from_pretrained`` on the model directory with the arguments
  vLLM passes (left truncation side, Mistral format off, the model's config), and the model
  types vLLM loads with the generic fast tokenizer instead;
- completions: a string, a list of token ids, or a batch of either; ``add_special_tokens``
  (default true), ``truncate_prompt_tokens`` with ``truncation_side``;
- chat: the chat template chosen as vLLM chooses it (the server's ``--chat-template``, else
  a processor's template when the request has no tools, else the tokenizer's, which
  transformers reads from ``tokenizer_config.json`` or ``chat_template.jinja``), the content
  format vLLM detects in the template (``"string"``: text parts joined by newlines;
  ``"openai"``: a list of ``{"type": "text", ...}`` parts), the template arguments vLLM
  passes (``add_generation_prompt`` default true, ``continue_final_message``,
  ``documents``, ``reasoning_effort``, ``chat_template_kwargs`` with the server's defaults,
  the request's ``tools``), the message clean-ups vLLM makes (tool-call arguments parsed
  from JSON, tool results flattened, ``developer`` messages made ``system`` ones for
  templates that do not know the role, ...), and the tokenization of the rendered text
  (``add_special_tokens`` default false), truncation included; prompt token ids forwarded
  in ``kv_transfer_params`` (disaggregated decode) are taken as they are, as vLLM does.

A body this module cannot reproduce gives ``None`` (never an exception) and a count in
:attr:`Tokenizers.counts` under one of these reasons:

- ``unknown_path``: not ``/v1/completions`` or ``/v1/chat/completions``;
- ``unknown_model``: a model that is neither served nor a LoRA adapter (or no ``model``
  where several are served);
- ``unsupported_model``: a model vLLM renders with a renderer of its own (Mistral's
  tokenizer, gpt-oss' Harmony, the DeepSeek V3.2/V4, Kimi and Inkling renderers), listed in
  :attr:`Tokenizers.unsupported`;
- ``invalid``: a body vLLM would refuse (a missing or ill-typed field, a bad
  ``cache_salt``, ``continue_final_message`` with ``add_generation_prompt``, ...);
- ``multimodal`` and ``prompt_embeds``: content parts other than text, prompt embeddings;
- ``suffix``: a completion ``suffix`` (fill-in-the-middle rendering);
- ``chat_template``: a chat template sent with the request (vLLM refuses it unless started
  with ``--trust-request-chat-template``), or ``tokenize`` in ``chat_template_kwargs``;
- ``no_chat_template``: the model has no chat template (vLLM falls back on templates of its
  own for a few model types);
- ``template_error``: the chat template raised (vLLM answers 400);
- ``too_long``: more tokens than the model's ``max_model_len``, where it is given;
- ``needs_max_model_len``: ``truncate_prompt_tokens=-1``, which needs ``max_model_len``;
- ``batch``: :meth:`Tokenizers.prompt_of` on a body that makes several prompts;
- ``error``: anything else (a bug here: please report it).

``ok`` counts the bodies turned into prompts. docs/openai-tokenization.md is the guide;
``tests/vllm_tier/test_openai_tokenize.py`` checks the token ids against vLLM's own
rendering. transformers is needed only to build a :class:`Tokenizers` (``pip install
"kvblocks[gateway]"``); this module imports without it and without vLLM.
"""

from __future__ import annotations

import collections
import copy
import fnmatch
import inspect
import json
import os
import re
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "Prompt", "ServedModel", "Tokenizers"]

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class Prompt:
    """One engine request's prompt as the vLLM server would make it.

    ``model`` is the served name of the base model (what selects the replicas and the
    tokenizer; None where the body names none); ``lora_name`` the LoRA adapter the request
    names, if any, and ``lora_path`` the path its replicas loaded it from (vLLM keys cached
    blocks by both: a ``lora_name`` without its path cannot be scored exactly);
    ``cache_salt`` the request's salt (also keyed)."""

    model: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass(frozen=True)
class ServedModel:
    """A served model: its directory and the ``vllm serve`` options that change prompts.

    Every field but ``path`` mirrors a ``vllm serve`` flag and defaults to vLLM's default:

    - ``chat_template``: ``--chat-template``, as the template's text (read the file);
    - ``chat_template_content_format``: ``--chat-template-content-format``;
    - ``default_chat_template_kwargs``: ``--default-chat-template-kwargs``;
    - ``reasoning_effort_map``: ``--reasoning-effort-map``;
    - ``exclude_tools_when_tool_choice_none``: ``--exclude-tools-when-tool-choice-none``;
    - ``max_model_len``: ``--max-model-len`` (vLLM derives it from the model when not
      given; without it here, over-long prompts are not detected and
      ``truncate_prompt_tokens=-1`` is not handled);
    - ``trust_remote_code``: ``--trust-remote-code``.
    """

    path: str | os.PathLike[str]
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    reasoning_effort_map: Mapping[str, str] | None = None
    exclude_tools_when_tool_choice_none: bool = False
    max_model_len: int | None = None
    trust_remote_code: bool = False


class _Unhandled(Exception):
    """A body this module does not turn into a prompt; ``reason`` is the count's key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Architectures for which vLLM picks a tokenizer mode (and renderer) of its own under
# ``--tokenizer-mode auto`` (vllm.config.model.ModelConfig, 0.33 and 0.34).
_OWN_RENDERER_ARCHITECTURES = frozenset(
    {
        "Alpamayo2Super",
        "MoonshotKimiaForCausalLM",
        "KimiK3ForConditionalGeneration",
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "DeepseekV4ForConditionalGeneration",
        "DeepseekV41ForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
    }
)

# Model types whose tokenizer vLLM loads as transformers' generic fast tokenizer
# (TokenizersBackend) instead of the class their files name.
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset(
    {"internlm2", "step3_vl", "step3p7", "step5", "step5_vl", "unlimited-ocr", "unlimited_ocr"}
)

# Content part types vLLM reads as text, and the key holding the text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# For these, a part whose text is null is dropped instead of refused.
_NULL_TEXT_DROPPED = frozenset({"text", "refusal"})
# The content-part fields vLLM knows; in the "openai" format the others are kept on the part.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
# Keys that make a content part media, whatever its type.
_MEDIA_PART_KEYS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "image_pil",
        "audio_url",
        "audio_embeds",
        "input_audio",
        "video_url",
        "video_embeds",
        "prompt_embeds",
    }
)
# Claude Code's per-request attribution line, which vLLM drops from system text.
_BILLING_HEADER = "x-anthropic-billing-header"
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_CACHE_SALT_MAX = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
# Values that leave a template argument unset when vLLM merges them (vLLM's merge_kwargs).
_UNSET = (None, "auto")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the test environments have it
        raise ImportError(
            "kvblocks.router.openai needs transformers to load tokenizers: "
            'pip install "kvblocks[gateway]"'
        ) from e
    return transformers


def _merged(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``defaults`` updated with those ``overrides`` that are set (neither None nor "auto"),
    the way vLLM layers template arguments."""
    out = dict(defaults or {})
    for key, value in (overrides or {}).items():
        if value not in _UNSET:
            out[key] = value
    return out


class _Tokenizer:
    """One loaded tokenizer, shared by the served names of one directory, with what vLLM
    derives from it once: the processor's chat template and the longest token's length."""

    def __init__(self, path: str, trust_remote_code: bool) -> None:
        transformers = _transformers()
        config: Any = None
        try:
            config = transformers.AutoConfig.from_pretrained(
                path, trust_remote_code=trust_remote_code
            )
        except Exception:  # no usable config.json: AutoTokenizer looks for itself
            config = None
        kwargs: dict[str, Any] = {
            "trust_remote_code": trust_remote_code,
            "revision": None,
            "cache_dir": None,
            "truncation_side": "left",
            "mistral_format": False,
        }
        if config is not None:
            kwargs["config"] = config
        loader: Any = transformers.AutoTokenizer
        if getattr(config, "model_type", None) in _GENERIC_TOKENIZER_MODEL_TYPES:
            loader = transformers.TokenizersBackend
        self.hf: Any = loader.from_pretrained(path, **kwargs)
        self.processor_template = _processor_chat_template(path, trust_remote_code)
        # Named parameters of apply_chat_template: vLLM passes those whatever the template.
        named: set[str] = set()
        for cls in (type(self.hf), getattr(transformers, "PythonBackend", None)):
            if cls is None:
                continue
            for param in inspect.signature(cls.apply_chat_template).parameters.values():
                if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                    named.add(param.name)
        self.named_params = frozenset(named)
        self._max_chars: int | None = None
        # transformers' fast tokenizers change their truncation state per call: one at a time.
        self.lock = threading.Lock()
        self.segments = _Segments.of(self.hf)

    @property
    def max_chars_per_token(self) -> int:
        if self._max_chars is None:
            self._max_chars = max(len(token) for token in self.hf.get_vocab())
        return self._max_chars


class _Segments:
    """Tokenization of a rendered chat by its pieces between added tokens, each piece's ids
    kept (LRU), so that a chat's history and shared system prompt are tokenized once.

    Hugging Face's tokenizers split the added tokens (the template's special tokens) out of a
    text before anything else, then normalize, pre-tokenize and encode each piece between
    them on its own: a text's ids are its pieces' ids and the added tokens' ids in order.
    That holds where every added token matches the raw text as it is (not normalized, no
    stripping of the whitespace beside it, not single-word only) and no step looks at where
    a piece lies in the whole text (Metaspace's ``prepend_scheme: first``); :meth:`of`
    declines other tokenizers. The first calls, and one call in 512 after them, also encode
    the text whole and compare: a difference turns the pieces off for good (counted in
    :attr:`mismatches`), the whole text's ids are used."""

    CHECK_FIRST = 16
    CHECK_EVERY = 512
    KEPT = 4096

    def __init__(self, backend: Any, added: dict[str, int]) -> None:
        self.backend = backend
        self.added = added
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self.split = re.compile(f"({pattern})")
        self.kept: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.calls = self.hits = self.mismatches = 0
        self.enabled = True

    @classmethod
    def of(cls, hf: Any) -> _Segments | None:
        backend = getattr(hf, "_tokenizer", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None
        added: dict[str, int] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.lstrip or token.rstrip or token.single_word or token.normalized:
                return None
            added[token.content] = token_id
        try:
            layout = json.loads(backend.to_str())
        except Exception:
            return None
        if not added or '"prepend_scheme": "first"' in json.dumps(layout.get("pre_tokenizer")):
            return None
        return cls(backend, added)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids without special tokens added, or None where the pieces are off
        (the caller encodes the text whole)."""
        if not self.enabled:
            return None
        self.calls += 1
        ids: list[int] = []
        for piece in self.split.split(text):
            if not piece:
                continue
            found = self.added.get(piece)
            if found is not None:
                ids.append(found)
                continue
            kept = self.kept.get(piece)
            if kept is None:
                kept = self.backend.encode(piece, add_special_tokens=False).ids
                self.kept[piece] = kept
                if len(self.kept) > self.KEPT:
                    self.kept.popitem(last=False)
            else:
                self.hits += 1
                self.kept.move_to_end(piece)
            ids.extend(kept)
        if self.calls <= self.CHECK_FIRST or self.calls % self.CHECK_EVERY == 0:
            whole = self.backend.encode(text, add_special_tokens=False).ids
            if whole != ids:
                self.mismatches += 1
                self.enabled = False
                return list(whole)
        return ids


def _processor_chat_template(path: str, trust_remote_code: bool) -> str | None:
    """The chat template of the model's processor (multimodal models ship one), which vLLM
    prefers to the tokenizer's for requests without tools; None for a tokenizer-only model."""
    transformers = _transformers()
    try:
        processor = transformers.AutoProcessor.from_pretrained(
            path, trust_remote_code=trust_remote_code
        )
    except Exception:
        return None
    if not isinstance(processor, transformers.ProcessorMixin):
        return None
    template = getattr(processor, "chat_template", None)
    if isinstance(template, dict):  # several named templates (vLLM 0.34 takes "default")
        template = template.get("default")
    return template if isinstance(template, str) else None


@dataclass
class _Served:
    """A served name's tokenizer and options, and its resolved templates (by whether the
    request has tools, which is all that changes the choice)."""

    spec: ServedModel
    tokenizer: _Tokenizer
    templates: dict[bool, _Template | None] = field(default_factory=dict)


@dataclass(frozen=True)
class _Template:
    text: str
    content_format: str  # "string" or "openai"
    variables: frozenset[str]
    knows_developer: bool


def _unsupported_reason(path: Path) -> str | None:
    """Why vLLM would render this model's prompts with something else than its Hugging
    Face tokenizer and chat template, or None."""
    config: dict[str, Any] = {}
    try:
        loaded = json.loads((path / "config.json").read_text())
        if isinstance(loaded, dict):
            config = loaded
    except (OSError, ValueError):
        pass
    architectures = config.get("architectures") or []
    own = sorted(set(architectures) & _OWN_RENDERER_ARCHITECTURES)
    if own:
        return f"vLLM renders {own[0]} prompts with a renderer of its own"
    if config.get("model_type") == "gpt_oss":
        return "vLLM renders gpt-oss prompts with Harmony"
    try:
        names = [entry.name for entry in path.iterdir()]
    except OSError:
        names = []
    if any(fnmatch.fnmatch(n, "consolidated*.safetensors") for n in names) and any(
        n == "tekken.json" or fnmatch.fnmatch(n, "tokenizer.model.v*") for n in names
    ):
        return "vLLM tokenizes Mistral-format models with mistral_common"
    return None


class Tokenizers:
    """The served models' tokenizers, and the prompts vLLM makes of OpenAI request bodies.

    ``models`` maps each served model name (what requests put in ``model``) to its model
    directory, or to a :class:`ServedModel` with the server's options; several names may
    share one directory (one tokenizer is loaded for them). ``lora_adapters`` maps each
    LoRA adapter's name (``--lora-modules NAME=PATH``) to the served name of its base model,
    whose tokenizer vLLM uses for it, or to ``(base model, PATH)``: with the path, the
    adapter's prompts can be scored (vLLM hashes the path too).

    Tokenizers are loaded here (transformers needed); a directory that does not load
    raises. A model vLLM renders with something else than its Hugging Face tokenizer and
    chat template is not loaded but listed in :attr:`unsupported` with the reason, and its
    requests give None. Calls may come from several threads (tokenization is serialized
    per tokenizer)."""

    def __init__(
        self,
        models: Mapping[str, str | os.PathLike[str] | ServedModel],
        lora_adapters: Mapping[str, str | tuple[str, str]] | None = None,
    ) -> None:
        self.counts: dict[str, int] = {}
        self.unsupported: dict[str, str] = {}
        self._served: dict[str, _Served] = {}
        self._loras: dict[str, str] = {}
        self._lora_paths: dict[str, str] = {}
        for adapter, target in (lora_adapters or {}).items():
            if isinstance(target, tuple):
                self._loras[adapter], self._lora_paths[adapter] = target
            else:
                self._loras[adapter] = target
        self._names = list(models)
        self._count_lock = threading.Lock()
        loaded: dict[tuple[str, bool], _Tokenizer] = {}
        for name, entry in models.items():
            spec = entry if isinstance(entry, ServedModel) else ServedModel(path=entry)
            if spec.chat_template_content_format not in ("auto", "string", "openai"):
                raise ValueError(
                    f"{name}: chat_template_content_format must be 'auto', 'string' or "
                    f"'openai', not {spec.chat_template_content_format!r}"
                )
            path = Path(spec.path)
            if not path.is_dir():
                raise FileNotFoundError(f"{name}: no model directory at {path}")
            reason = _unsupported_reason(path)
            if reason is not None:
                self.unsupported[name] = reason
                continue
            key = (str(path), spec.trust_remote_code)
            if key not in loaded:
                loaded[key] = _Tokenizer(str(path), spec.trust_remote_code)
            self._served[name] = _Served(spec, loaded[key])
        for adapter, base in self._loras.items():
            if base not in models:
                raise ValueError(f"LoRA adapter {adapter!r}: {base!r} is not a served model")

    def tokenizer(self, model: str) -> Any:
        """The Hugging Face tokenizer used for ``model`` (a served name or LoRA adapter)."""
        return self._served[self._loras.get(model, model)].tokenizer.hf

    def prompt_of(self, path: str, body: Mapping[str, Any]) -> Prompt | None:
        """The prompt vLLM's server makes of ``body`` sent to ``path``, or None (counted in
        :attr:`counts`). A completions body with a batch of several prompts gives None
        (``batch``): see :meth:`prompts`."""
        prompts = self._run(path, body, single=True)
        return None if prompts is None else prompts[0]

    def prompts(self, path: str, body: Mapping[str, Any]) -> list[Prompt] | None:
        """The prompts vLLM's server makes of ``body`` sent to ``path``, one per engine
        request in vLLM's order (a completions batch makes one per item; everything else
        one), or None (counted in :attr:`counts` by reason)."""
        return self._run(path, body, single=False)

    def _run(self, path: str, body: Mapping[str, Any], single: bool) -> list[Prompt] | None:
        try:
            prompts = self._prompts(path, body)
            if single and len(prompts) != 1:
                raise _Unhandled("batch")
        except _Unhandled as unhandled:
            self._count(unhandled.reason)
            return None
        except Exception:
            self._count("error")
            return None
        self._count("ok")
        return prompts

    def _count(self, reason: str) -> None:
        with self._count_lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1

    def _prompts(self, path: str, body: Mapping[str, Any]) -> list[Prompt]:
        endpoint = path.split("?", 1)[0].rstrip("/")
        if endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise _Unhandled("unknown_path")
        if not isinstance(body, Mapping):
            raise _Unhandled("invalid")
        model, lora_name = self._model_of(body.get("model"))
        salt = body.get("cache_salt")
        if salt is not None and (
            not isinstance(salt, str)
            or not salt
            or len(salt) > _CACHE_SALT_MAX
            or any(char in _CACHE_SALT_FORBIDDEN for char in salt)
        ):
            raise _Unhandled("invalid")
        served = self._served[model]
        token_ids = _completion(served, body) if endpoint == COMPLETIONS else [_chat(served, body)]
        lora_path = None if lora_name is None else self._lora_paths.get(lora_name)
        return [Prompt(model, ids, salt, lora_name, lora_path) for ids in token_ids]

    def _model_of(self, requested: object) -> tuple[str, str | None]:
        """The base model's served name and the LoRA adapter's name for ``model``."""
        if requested is None or requested == "":
            if len(self._names) != 1:
                raise _Unhandled("unknown_model")
            requested = self._names[0]
        if not isinstance(requested, str):
            raise _Unhandled("invalid")
        lora_name = None
        if requested in self._loras:
            lora_name, requested = requested, self._loras[requested]
        if requested in self.unsupported:
            raise _Unhandled("unsupported_model")
        if requested not in self._served:
            raise _Unhandled("unknown_model")
        return requested, lora_name


# Tokenization and truncation ----------------------------------------------------------------


@dataclass(frozen=True)
class _Truncation:
    """A request's length handling: vLLM's ``TokenizeParams`` for one request."""

    max_model_len: int | None
    truncate: int | None  # truncate_prompt_tokens: tokens kept, -1 for the most allowed
    side: str | None  # truncation_side; None: the tokenizer's (left, as vLLM loads it)
    max_output: int | None  # tokens asked for (0: none)

    @staticmethod
    def of(served: _Served, body: Mapping[str, Any], max_output: int | None) -> _Truncation:
        limit = served.spec.max_model_len
        truncate = body.get("truncate_prompt_tokens")
        side = body.get("truncation_side")
        if truncate is not None and (not _is_int(truncate) or truncate < -1):
            raise _Unhandled("invalid")
        if side not in (None, "left", "right"):
            raise _Unhandled("invalid")
        if limit is not None:
            if max_output is not None and max_output > limit:
                raise _Unhandled("invalid")
            if truncate is not None and truncate > limit:
                raise _Unhandled("invalid")
        elif truncate == -1:
            raise _Unhandled("needs_max_model_len")
        return _Truncation(limit, truncate, side, max_output)

    @property
    def keep(self) -> int | None:
        """The most tokens truncation keeps, or None where it keeps all."""
        if self.truncate is None or self.truncate >= 0:
            return self.truncate
        assert self.max_model_len is not None
        if self.max_output == 0:
            return self.max_model_len
        return max(0, self.max_model_len - 1)  # one token of room for the output

    def encode(self, tokenizer: _Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids as vLLM computes them: a character pre-trim where a side is
        asked for, the tokenizer's own truncation otherwise, then :meth:`cut`."""
        limit = self.max_model_len
        if limit is not None:
            most_chars = limit * tokenizer.max_chars_per_token
            if self.truncate is None:
                if len(text) > most_chars:
                    raise _Unhandled("too_long")
            elif self.side is not None and len(text) > most_chars:
                text = text[-most_chars:] if self.side == "left" else text[:most_chars]
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
        max_length = None
        if self.side is not None and self.truncate is not None:
            kwargs["truncation"] = False
        else:
            max_length = self.keep
            if max_length is None and limit is not None:
                max_length = limit + 1  # enough to tell an over-long prompt
            kwargs["truncation"] = max_length is not None
            kwargs["max_length"] = max_length
        with tokenizer.lock:
            pieces = tokenizer.segments
            if pieces is not None and not add_special_tokens:
                found = pieces.encode(text)
                # the tokenizer's own truncation would have cut a longer one: encode it whole
                if found is not None and (max_length is None or len(found) <= max_length):
                    return self.cut(found)
            ids = tokenizer.hf(text, **kwargs)["input_ids"]
        return self.cut(list(ids))

    def cut(self, ids: list[int]) -> list[int]:
        """``ids`` truncated to :attr:`keep` tokens; refused where longer than the model."""
        keep = self.keep
        if keep is not None and keep < len(ids):
            if keep == 0:
                ids = []
            elif (self.side or "left") == "left":
                ids = ids[-keep:]
            else:
                ids = ids[:keep]
        if self.max_model_len is not None and len(ids) > self.max_model_len:
            raise _Unhandled("too_long")
        return ids


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise _Unhandled("invalid")
    return value


# Completions ---------------------------------------------------------------------------------


def _completion(served: _Served, body: Mapping[str, Any]) -> list[list[int]]:
    """The token ids of each prompt of a completions body (vLLM's order)."""
    if body.get("suffix") is not None:
        raise _Unhandled("suffix")
    embeds = body.get("prompt_embeds")
    if embeds is not None and embeds != []:
        raise _Unhandled("prompt_embeds")
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise _Unhandled("invalid")
    items: list[str | list[int]]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_token_ids(prompt)):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        items = [list(p) for p in prompt]
    else:
        raise _Unhandled("invalid")
    add_special_tokens = _flag(body, "add_special_tokens", True)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = 16  # vLLM's default for completions
    if not _is_int(max_tokens):
        raise _Unhandled("invalid")
    truncation = _Truncation.of(served, body, max_tokens or 0)
    tokenizer = served.tokenizer
    return [
        truncation.encode(tokenizer, item, add_special_tokens)
        if isinstance(item, str)
        else truncation.cut(item)
        for item in items
    ]


# Chat completions ----------------------------------------------------------------------------


def _chat(served: _Served, body: Mapping[str, Any]) -> list[int]:
    """The token ids of a chat completions body: its messages rendered through the chat
    template with vLLM's arguments, then tokenized."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
    ):
        raise _Unhandled("invalid")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise _Unhandled("invalid")
    add_special_tokens = _flag(body, "add_special_tokens", False)
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is not None and not isinstance(user_kwargs, Mapping):
        raise _Unhandled("invalid")
    if body.get("chat_template") is not None or (
        user_kwargs is not None and user_kwargs.get("chat_template") is not None
    ):
        raise _Unhandled("chat_template")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise _Unhandled("invalid")
    documents = body.get("documents")
    if documents is not None and not isinstance(documents, list):
        raise _Unhandled("invalid")
    max_output = body.get("max_completion_tokens")
    if max_output is None:
        max_output = body.get("max_tokens")
    if max_output is not None and not _is_int(max_output):
        raise _Unhandled("invalid")
    tools = _tools(body, served.spec.exclude_tools_when_tool_choice_none)
    truncation = _Truncation.of(served, body, max_output)

    forwarded = _forwarded_prompt_ids(body)
    if forwarded is not None:
        _reject_media(messages)
        return forwarded

    spec = served.spec
    if effort is not None and spec.reasoning_effort_map:
        effort = spec.reasoning_effort_map.get(effort, effort)
    request_kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        request_kwargs["enable_thinking"] = effort != "none"
    defaults = _merged(spec.default_chat_template_kwargs, {"tools": tools, "tokenize": False})
    kwargs = _merged(defaults, _merged(user_kwargs, request_kwargs))
    if kwargs.pop("tokenize", False):
        raise _Unhandled("chat_template")  # the template would give token ids directly
    tools = kwargs.pop("tools", None)

    template = _template(served, tools)
    content_format = spec.chat_template_content_format
    if content_format == "auto":
        content_format = template.content_format
    conversation = [_conversation_message(m, content_format) for m in messages]
    if any(m["role"] == "developer" for m in conversation) and not template.knows_developer:
        conversation = _developer_as_system(conversation)

    tokenizer = served.tokenizer
    accepted = template.variables | tokenizer.named_params
    kwargs = {k: v for k, v in kwargs.items() if k in accepted and k != "chat_template"}
    kwargs["return_dict"] = False
    try:
        with tokenizer.lock:
            text = tokenizer.hf.apply_chat_template(
                conversation, tools=tools, chat_template=template.text, tokenize=False, **kwargs
            )
    except Exception as e:
        raise _Unhandled("template_error") from e
    if not isinstance(text, str):
        raise _Unhandled("template_error")
    return truncation.encode(tokenizer, text, add_special_tokens)


def _forwarded_prompt_ids(body: Mapping[str, Any]) -> list[int] | None:
    """Prompt token ids a prefill server forwarded in ``kv_transfer_params``, which vLLM
    feeds to the engine without rendering (unless ``echo`` asks for the text)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, Mapping) or params.get("prompt_token_ids") is None:
        return None
    if body.get("echo"):
        return None
    ids = params["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not _is_token_ids(ids):
        raise _Unhandled("invalid")
    return list(ids)


def _reject_media(messages: Sequence[Mapping[str, Any]]) -> None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, str):
                    _text_of(part)


def _tools(body: Mapping[str, Any], exclude_when_none: bool) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM hands them to the template (its pydantic models dumped:
    unset ``description`` and ``parameters`` as None), or None."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if tools == [] and not isinstance(choice, Mapping):
        # vLLM 0.34 takes an empty list for no tools (0.33 refuses the request).
        tools = None
        if choice in ("auto", "required"):
            choice = "none"
    if tools is None:
        if choice not in (None, "none"):
            raise _Unhandled("invalid")
        return None
    if not isinstance(tools, list):
        raise _Unhandled("invalid")
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not any(
            isinstance(t, Mapping)
            and isinstance(t.get("function"), Mapping)
            and t["function"].get("name") == name
            for t in tools
        ):
            raise _Unhandled("invalid")
    elif choice not in (None, "none", "auto", "required"):
        raise _Unhandled("invalid")
    if choice == "none" and exclude_when_none:
        return None
    dumped = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise _Unhandled("invalid")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _Unhandled("invalid")
        description = function.get("description")
        parameters = function.get("parameters")
        strict = function.get("strict")
        defer = function.get("defer_loading")
        tool_defer = tool.get("defer_loading")
        if (
            (description is not None and not isinstance(description, str))
            or (parameters is not None and not isinstance(parameters, Mapping))
            or (strict is not None and not isinstance(strict, bool))
            or (defer is not None and not isinstance(defer, bool))
            or (tool_defer is not None and not isinstance(tool_defer, bool))
        ):
            raise _Unhandled("invalid")
        if defer is None:
            defer = tool_defer
        out_function: dict[str, Any] = {
            "name": function["name"],
            "description": description,
            "parameters": copy.deepcopy(dict(parameters)) if parameters is not None else None,
        }
        if strict is not None:
            out_function["strict"] = strict
        if defer is not None:
            out_function["defer_loading"] = defer
        out: dict[str, Any] = {"type": "function", "function": out_function}
        if tool_defer is not None:
            out["defer_loading"] = tool_defer
        dumped.append(out)
    return dumped


def _text_of(part: object) -> tuple[str | None, dict[str, Any]]:
    """A content part's text (None: a part vLLM drops) and its fields vLLM keeps in the
    "openai" format; media and prompt embeddings are refused."""
    if isinstance(part, str):
        return part, {}
    if not isinstance(part, Mapping):
        raise _Unhandled("invalid")
    kind = part.get("type")
    if kind == "prompt_embeds" or "prompt_embeds" in part:
        raise _Unhandled("prompt_embeds")
    media = bool(_MEDIA_PART_KEYS & part.keys())
    if kind is None and not media and "tool_reference" not in part:
        raise _Unhandled("invalid")  # vLLM: a part without a type
    if not isinstance(kind, str) or kind not in _TEXT_PARTS or "uuid" in part or media:
        raise _Unhandled("multimodal")
    text = part.get(_TEXT_PARTS[kind])
    if text is None and kind in _NULL_TEXT_DROPPED:
        return None, {}
    if not isinstance(text, str):
        raise _Unhandled("invalid")
    return text, {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System text parts without Claude Code's attribution line (vLLM drops it: it changes
    on every request)."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _conversation_message(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
    """A request message as vLLM hands it to the chat template."""
    role = message["role"]
    content = message.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise _Unhandled("invalid")
    if role == "system":
        parts = _without_billing_header(parts)
    texts: list[Any] = []
    for part in parts:
        text, extra = _text_of(part)
        if text is None:
            continue
        if content_format == "openai":
            texts.append({"type": "text", "text": text, **copy.deepcopy(extra)})
        elif text:
            texts.append(text)
    out: dict[str, Any] = {
        "role": role,
        "content": texts if content_format == "openai" else "\n".join(texts),
    }
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if isinstance(reasoning, Mapping) and reasoning.get("type") == "prompt_embeds":
        raise _Unhandled("prompt_embeds")
    if role == "assistant":
        if reasoning is not None and not isinstance(reasoning, str):
            raise _Unhandled("invalid")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            calls = _tool_calls(tool_calls)
            if calls:
                out["tool_calls"] = calls
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        items = out["content"]
        if isinstance(items, list) and all(item.get("type") == "text" for item in items):
            out["content"] = "\n".join(item.get("text", "") for item in items)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        if message.get("tools") is not None:
            raise _Unhandled("invalid")  # per-message tools: not reproduced
        out["tools"] = None
    return out


def _tool_calls(calls: object) -> list[dict[str, Any]]:
    """Assistant tool calls as vLLM hands them to templates: in its models' field order,
    arguments parsed from JSON into an object ({} where they are not one)."""
    if not isinstance(calls, list):
        raise _Unhandled("invalid")
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise _Unhandled("invalid")
        function = call.get("function")
        if (
            not isinstance(call.get("id"), str)
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise _Unhandled("invalid")
        arguments: Any = {}
        if function["arguments"]:
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = {}
            if not isinstance(arguments, dict):
                arguments = {}
        out_function = {"arguments": arguments, "name": function["name"]}
        out_function.update(
            {k: copy.deepcopy(v) for k, v in function.items() if k not in out_function}
        )
        out_call: dict[str, Any] = {"id": call["id"], "function": out_function}
        if "type" in call:
            out_call["type"] = call["type"]
        out_call.update(
            {k: copy.deepcopy(v) for k, v in call.items() if k not in ("id", "function", "type")}
        )
        out.append(out_call)
    return out


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` messages as ``system`` ones, and the system messages merged into one
    first message where they are not already a single first one (for templates that do not
    know the developer role)."""
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        if i > 0 or system:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if (isinstance(p, Mapping) and "text" in p) or isinstance(p, str)
            )
        if content:
            system.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


# Chat templates ------------------------------------------------------------------------------


def _template(served: _Served, tools: object) -> _Template:
    """The chat template vLLM renders this request with: the server's, else the processor's
    (only without tools), else the tokenizer's (its tool-use one where it has several)."""
    key = tools is None
    if key not in served.templates:
        served.templates[key] = _resolve_template(served, tools)
    template = served.templates[key]
    if template is None:
        raise _Unhandled("no_chat_template")
    return template


def _resolve_template(served: _Served, tools: object) -> _Template | None:
    tokenizer = served.tokenizer
    text: Any = None
    if served.spec.chat_template is not None:
        text = tokenizer.hf.get_chat_template(served.spec.chat_template, tools=tools)
    elif tools is None and tokenizer.processor_template is not None:
        text = tokenizer.processor_template
    else:
        try:
            text = tokenizer.hf.get_chat_template(None, tools=tools)
        except Exception:
            text = None
    if not isinstance(text, str):
        return None
    ast = _template_ast(text)
    variables: frozenset[str] = frozenset()
    if ast is not None:
        import jinja2.meta

        variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
    return _Template(
        text=text,
        content_format=_content_format(ast),
        variables=variables,
        knows_developer='"developer"' in text or "'developer'" in text,
    )


def _template_ast(text: str) -> Any:
    """The template parsed by the Jinja environment transformers renders it in."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(text)
        return compiled.environment.parse(text)
    except Exception:
        return None


def _content_format(ast: Any) -> str:
    """``"openai"`` where the template loops over a message's content (so it takes content
    as a list of parts), else ``"string"``: vLLM's detection, on the template's syntax."""
    if ast is None:
        return "string"
    try:
        return "openai" if _loops_over_content(ast) else "string"
    except _NotAName:
        return "string"


class _NotAName(Exception):
    """A loop of interest binds something else than a name (vLLM then assumes "string")."""


def _reads(node: Any, name: str) -> bool:
    """``node`` reads the variable ``name`` (or the namespace attribute ``ns.attr``)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return bool(node.ctx == "load" and node.name == name)
    if isinstance(node, nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return bool(node.attr == attr) and _reads(node.node, base)
    return False


def _refers(node: Any, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or its field ``key``), through filters, tests and slices."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, nodes.Test) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node
        else:
            break
    if key is None:
        return _reads(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, name)
        )
    if isinstance(node, nodes.Getattr):
        return bool(node.attr == key) and _reads(node.node, name)
    return False


def _dotted(node: Any) -> str | None:
    from jinja2 import nodes

    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs = []
    while isinstance(node, nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, nodes.Name):
        return ".".join([node.name, *reversed(attrs)])
    return None


def _aliases(ast: Any, name: str) -> list[str]:
    """``name`` and every variable (or namespace attribute) the template sets from it,
    transitively."""
    from jinja2 import nodes

    assigns = list(ast.find_all(nodes.Assign))
    found, queue = [name], deque([name])
    while queue:
        current = queue.popleft()
        for assign in assigns:
            target, value = assign.target, assign.node
            new: list[str] = []
            if isinstance(target, nodes.Name) and _refers(value, current):
                new.append(target.name)
            if (
                isinstance(target, nodes.Name)
                and isinstance(value, nodes.Call)
                and isinstance(value.node, nodes.Name)
                and value.node.name == "namespace"
            ):
                new += [
                    f"{target.name}.{kw.key}" for kw in value.kwargs if _refers(kw.value, current)
                ]
            elif isinstance(target, (nodes.Getattr, nodes.NSRef)) and _refers(value, current):
                dotted = _dotted(target)
                if dotted is not None:
                    new.append(dotted)
            for alias in new:
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _loop_name(loop: Any) -> str:
    from jinja2 import nodes

    if not isinstance(loop.target, nodes.Name):
        raise _NotAName
    name: str = loop.target.name
    return name


def _loops_over_content(ast: Any) -> bool:
    """Whether some loop of the template iterates over a message's content: ``for x in
    message.content`` (a message being a loop variable over ``messages`` or an alias of
    it), a loop in a macro over a parameter that calls pass a message's content to, or a
    loop outside macros over a variable named ``content``."""
    from jinja2 import nodes

    messages = _aliases(ast, "messages")
    message_names = [
        _loop_name(loop)
        for loop in ast.find_all(nodes.For)
        if any(_refers(loop.iter, m) for m in messages)
    ]

    def content_of_message(node: Any) -> bool:
        return any(_refers(node, m, "content") for m in message_names)

    in_macros: set[int] = set()
    content_params: dict[int, set[str]] = {}
    calls = list(ast.find_all(nodes.Call))
    for macro in ast.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        takes_content: set[str] = set()
        for call in calls:
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and content_of_message(arg):
                    takes_content.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and content_of_message(kw.value):
                    takes_content.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if takes_content:
                content_params[id(loop)] = takes_content

    for loop in ast.find_all(nodes.For):
        iterated = loop.iter
        if content_of_message(iterated):
            _loop_name(loop)
            return True
        if isinstance(iterated, nodes.Name) and (
            iterated.name in content_params.get(id(loop), ())
            or (id(loop) not in in_macros and iterated.name == "content")
        ):
            _loop_name(loop)
            return True
    return False
