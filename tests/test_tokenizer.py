"""Tokenizer round trips, the smollm pre-tokenizer, chat templates, the incremental detokenizer."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcore.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tiny_model import byte_to_unicode

EXAMPLES = settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "60")),
                    deadline=None)
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SAMPLES = [
    "Hello, world! naïve café Ünïcödé façade — “quotes” ½ ©",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "x = [1, 22, 333]; y = {'k': 3.14159e-10, 'n': -0x1F}\n\tif (a && b) { return *p++; }",
    "Numbers: 0 7 42 1,000,000 2024-11-29 ٣٤٥ ४२ ² ¾ Ⅻ ０１２",
    "emoji 😀 👩‍👩‍👧 🇫🇷 ✨ 🧑🏽‍💻 and \u00e9 vs e\u0301",
    "中文字符 日本語のテキスト 한국어 텍스트 Ελληνικά русский עברית العربية",
    "  leading spaces,\ttabs,\r\nCRLF,\n\n\nand trailing   ",
]


@pytest.fixture(scope="module", params=["tiny", "default"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    name = "tiny_model_dir" if request.param == "tiny" else "default_model_dir"
    return Tokenizer.from_dir(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def smol(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def representable_bytes(tok: Tokenizer) -> set[int]:
    return {b for b, ch in byte_to_unicode().items() if tok.token_to_id(ch) is not None}


@EXAMPLES
@given(text=st.text(max_size=80))
def test_round_trip_random_text(tok, text):
    # SmolLM2's vocabulary has no token for a few bytes (0xF1, 0xF2: code points U+40000 to
    # U+BFFFF; some C0 controls); text made of the others round trips exactly
    assume(set(text.encode()) <= representable_bytes(tok))
    assert tok.decode(tok.encode(text)) == text


def test_default_model_facts(smol):
    assert smol.vocab_size == 49152
    assert 0xF1 not in representable_bytes(smol) and 0xF0 in representable_bytes(smol)
    assert (smol.token_to_id("<|endoftext|>"), smol.token_to_id("<|im_start|>"),
            smol.token_to_id("<|im_end|>")) == (0, 1, 2)
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert smol.all_special_ids == set(range(17))  # the 17 control tokens
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # no automatic BOS
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert (ids[0], ids[-1]) == (1, 2)
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_each_ascii_digit_is_its_own_token(smol):
    ids = smol.encode("pi is 3.14159265358979 and 2024")
    pieces = [smol.decode([i]) for i in ids]
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("314159265358979") + list("2024")


@EXAMPLES
@given(left=st.text(st.characters(categories=["L"]), max_size=5),
       numerals=st.text(st.characters(categories=["Nd", "Nl", "No"]), min_size=1, max_size=6),
       right=st.text(st.characters(categories=["L"]), max_size=5))
def test_every_numeral_is_split_off(smol, left, numerals, right):
    """The smollm pre-tokenizer isolates every \\p{N} character, in any script."""
    expected = smol.encode(left) + [i for c in numerals for i in smol.encode(c)]
    assert smol.encode(left + numerals + right) == expected + smol.encode(right)


def test_default_chat_template(smol):
    user = {"role": "user", "content": "What is 2+2?"}
    assert smol.apply_chat_template([user]) == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    conversation = [{"role": "system", "content": "Be brief."}, user,
                    {"role": "assistant", "content": "4"}]
    assert smol.apply_chat_template(conversation, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n")
    ids = smol.encode(smol.apply_chat_template([user]))
    assert ids[0] == 1 and ids.count(2) == 2


def test_tiny_chat_template(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _tokenizer_with(tmp_path: Path, src: Path, config: dict, jinja: str | None = None) -> Tokenizer:
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return Tokenizer.from_dir(tmp_path)


def test_template_sources_and_hf_environment(tmp_path, tiny_model_dir):
    tok = _tokenizer_with(tmp_path, tiny_model_dir, {
        "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": "{{ bos_token }}default"},
                          {"name": "tool_use", "template": "tools"}]},
        jinja=("{% for m in messages %}\n  {% if m.role == 'user' %}\n"
               "[{{ m.content | tojson }}]{{ eos_token }}\n  {% endif %}\n{% endfor %}\n"))
    # chat_template.jinja wins; trim_blocks / lstrip_blocks drop the tag lines; tojson keeps UTF-8
    assert tok.apply_chat_template([{"role": "user", "content": "é"},
                                    {"role": "bot", "content": "x"}]) == '["é"]<|im_end|>\n'
    (tmp_path / "chat_template.jinja").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>default"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_template_variables_as_transformers_passes_them(tmp_path, tiny_model_dir):
    tok = _tokenizer_with(tmp_path, tiny_model_dir, {
        "eos_token": "<|im_end|>", "chat_template": (
            "{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }} "
            "{{ eos_token }} {{ bos_token is defined }} {{ strftime_now('%Y') | length }}")})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "True True True <|im_end|> False 4")


@pytest.mark.parametrize(("template", "match"), [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),  # the sandbox holds
    ("{{ messages.append(messages[0]) }}", "chat template"),  # and it is immutable
    ("{{ 'x' + messages[0]['content'] + 'y' }}", "chat template"),  # content None
])
def test_template_errors(tmp_path, tiny_model_dir, template, match):
    tok = _tokenizer_with(tmp_path, tiny_model_dir, {"chat_template": template})
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template([{"role": "user", "content": None}])


def test_bad_input_is_named(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    with pytest.raises(ValueError, match="token id 259"):
        tok.decode([5, 259])
    with pytest.raises(ValueError, match="token id -1"):
        tok.id_to_token(-1)
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tiny_model_dir / "nowhere")


def check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    """Feed ids one by one; at every prefix the emitted text is the decode of that prefix
    (less a held-back incomplete character or open run of <0xXX> byte-fallback pieces), and
    after flush() it is the full decode."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    emitted = ""
    visible: list[int] = []  # the tokens that are not skipped specials
    for n, token_id in enumerate(ids, start=1):
        piece = detok.add(token_id)
        assert not piece.endswith("\ufffd")
        emitted += piece
        full = tok.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        assert full.startswith(emitted)
        if not (skip_special_tokens and token_id in tok.all_special_ids):
            visible.append(token_id)
        byte_run = bool(visible) and re.fullmatch(r"<0x[0-9A-F]{2}>", tok.id_to_token(visible[-1]))
        if not full.endswith("\ufffd") and not byte_run:
            assert emitted == full
    emitted += detok.flush()
    assert emitted == tok.decode(ids, skip_special_tokens=skip_special_tokens)


@EXAMPLES
@given(text=st.text(max_size=20), garbage=st.lists(st.integers(0, 255), max_size=4),
       cut=st.integers(0, 80), specials=st.lists(st.integers(0, 2), max_size=3),
       skip=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_detokenizer_on_split_bytes(tiny_model_dir, text, garbage, cut, specials, skip, seed):
    """The tiny tokenizer has one token per byte: every multi-byte character arrives split,
    with stray bytes and special tokens mixed in at random places."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    byte_ids = {b: tok.token_to_id(ch) for b, ch in byte_to_unicode().items()}
    ids = [byte_ids[b] for b in text.encode()]
    rng = random.Random(seed)
    for extra in [byte_ids[b] for b in garbage] + specials:
        ids.insert(rng.randrange(len(ids) + 1), extra)
    check_stream(tok, ids[:cut], skip)


@EXAMPLES
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans())
def test_detokenizer_on_random_ids(smol, ids, skip):
    check_stream(smol, ids, skip)


@EXAMPLES
@given(ids=st.lists(st.sampled_from(list(range(17)) + list(range(100, 260))), max_size=24))
def test_detokenizer_on_byte_tokens(smol, ids):
    """Ids 100-259 hold most single bytes, including UTF-8 lead and continuation bytes."""
    check_stream(smol, ids, skip_special_tokens=True)


def test_detokenizer_streams_whole_characters_from_a_small_window(tok, monkeypatch):
    text = "".join(SAMPLES) * 4
    ids = tok.encode(text)
    assert len(ids) > 300
    windows: list[int] = []
    decode = tok.decode

    def recording_decode(token_ids, skip_special_tokens=True):
        windows.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording_decode)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text and detok.flush() == ""
    assert not any("\ufffd" in p for p in pieces)  # no character is ever emitted in halves
    assert max(windows, default=0) <= 12  # O(1) per token: never a re-decode of the whole text
