"""Tokenizer (tokenizer.json through `tokenizers`, HF chat templates) and streaming detokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
_WINDOW_TOKENS = 64  # the native detokenizer keeps no more of a sequence's tokens than this
_GIL_FREE_CHARS = 8192  # longer inputs go through the *_batch calls, which release the GIL
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # sentencepiece's byte-fallback pieces


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: unlike jinja2's, it keeps non-ASCII text and does not HTML-escape
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


class Tokenizer:
    """Text <-> token ids of one model directory, and its chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        config = config or {}
        generation_config = generation_config or {}
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: set[int] = {
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special}
        # the template sees the special tokens by name, as transformers passes them
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token_id: int | None = self._special_id("bos_token", generation_config)
        self.eos_token_id: int | None = self._special_id("eos_token", generation_config)
        self.chat_template: str | None = chat_template
        # byte-fallback pieces (<0xE4>...): a run of them decodes as a whole, so a later byte
        # can still change the text of the earlier ones
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if getattr(tokenizer.model, "byte_fallback", False):
            self.byte_fallback_ids = frozenset(
                token_id for token, token_id in tokenizer.get_vocab().items()
                if _BYTE_PIECE.fullmatch(token))
        self._template: jinja2.Template | None = None
        self._single: dict[int, str] = {}  # decode_one's memo (~id: with special tokens)
        # the most characters of text one token stands for (its vocabulary string: byte-level
        # and sentencepiece pieces hold at least one character per character of text), so a
        # text longer than n x this cannot fit in n tokens: a bound checked before tokenizing
        self.max_token_chars: int = max(
            [len(token) for token in tokenizer.get_vocab(with_added_tokens=True)] or [1])

    def _special_id(self, name: str, generation_config: dict[str, Any]) -> int | None:
        text = self.special_tokens.get(name)
        if text is not None and (token_id := self._tokenizer.token_to_id(text)) is not None:
            return int(token_id)
        return _first_id(generation_config.get(f"{name}_id"))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """tokenizer.json, tokenizer_config.json, chat_template.jinja (over the config's)."""
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"model_dir {str(path)!r} has no tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json") or _read_json(path / "config.json")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template: Any = template_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(HFTokenizer.from_file(str(tokenizer_file)), config,
                   template if isinstance(template, str) else None, generation)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if len(text) < _GIL_FREE_CHARS:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        # `encode` holds the GIL throughout (seconds for megabytes, stalling every thread);
        # `encode_batch` releases it and gives the same ids
        batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), memoized: streaming decodes the same single tokens again and
        again (the incremental detokenizer's window start)."""
        key = token_id if skip_special_tokens else ~token_id
        text = self._single.get(key)
        if text is None:
            text = self._single[key] = self.decode([token_id], skip_special_tokens)
        return text

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) < _GIL_FREE_CHARS:
            return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self._tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])

    def id_to_token(self, token_id: int) -> str:
        token = self._tokenizer.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return str(token)

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its view of the vocabulary from)."""
        return str(self._tokenizer.to_str())

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, rendered as transformers renders it (`tools`:
        OpenAI-style tool definitions, for templates that render them)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja)")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages must be a non-empty list, got {messages!r}")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be a dict with a string 'role', "
                                 f"got {message!r}")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        try:
            # tools and documents are None, not undefined, as transformers passes them
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except (jinja2.exceptions.TemplateError, TypeError) as e:
            # TypeError: a message field of the wrong type, e.g. content None in `'a' + content`
            raise ChatTemplateError(f"chat template: {e}") from e


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, for streaming.

    Decodes only a short window of recent tokens (vLLM's prefix/read offsets): the text of
    ids[prefix_offset:read_offset] has been emitted already, and a new token's delta is what
    decoding ids[prefix_offset:] adds beyond it. The window starts one emitted token back so
    decoders that treat the first token specially (a leading space) see context. Text that
    ends in U+FFFD is held back until the bytes that complete the character arrive, and so is a
    run of byte-fallback pieces until a token that is not one ends it (a further byte would
    change how the whole run decodes).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before it have all been emitted as text
        self._in_byte_run = False  # the last visible token is a byte-fallback piece
        if not tokenizer.byte_fallback_ids:
            # the same window in one native call per token (tokenizers' DecodeStream, as vLLM
            # uses). Not with byte fallback: it emits a byte piece that a later byte turns
            # into U+FFFD, where this class holds the run back until it ends
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self.add = self._add_native  # type: ignore[method-assign]

    def _decode(self, start: int, end: int) -> str:
        if end - start == 1:  # the usual window start: one token, decoded once per tokenizer
            return self.tokenizer.decode_one(self.token_ids[start], self.skip_special_tokens)
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        if not (self.skip_special_tokens and token_id in self.tokenizer.all_special_ids):
            self._in_byte_run = token_id in self.tokenizer.byte_fallback_ids
        if self._in_byte_run:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        if new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for its remaining bytes
        if new_text == prefix_text:
            # nothing visible (a skipped special token): the window end moves, the start stays
            self._read_offset = len(self.token_ids)
            return ""
        if len(new_text) < len(prefix_text):
            return ""  # the decoder rewrote earlier text; wait until the window grows past it
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def _add_native(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self._stream.step(self.tokenizer._tokenizer, token_id)
        if text is None:  # nothing visible yet (an incomplete character, a skipped special)
            return ""
        self._read_offset = len(self.token_ids)  # all emitted: flush has nothing to add
        if self._read_offset > _WINDOW_TOKENS:  # keep the window only
            del self.token_ids[:-1]
            self._read_offset = 1
        self._prefix_offset = self._read_offset - 1
        return str(text)

    def flush(self) -> str:
        """At the end of the sequence: the held-back text (an incomplete character, an open
        byte-fallback run)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._in_byte_run = False
        return new_text[len(prefix_text):]
