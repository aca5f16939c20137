"""A sentencepiece ('llama') GGUF tokenizer vs a from-scratch llama.cpp SPM encoder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.model.gguf_convert import convert_gguf
from kvcore.model.tokenizer import IncrementalDetokenizer, Tokenizer
from test_tokenizer import check_stream
from tiny_gguf import make_tiny_gguf, spm_vocab

SPACE = "\u2581"
SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}


def reference_spm_encode(text: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: each text segment between special tokens gets a leading
    space, spaces become U+2581, then the adjacent pair whose concatenation is the best-scored
    normal piece is merged (leftmost on ties) until none is; pieces without an id fall back to
    their UTF-8 bytes as <0xXX>."""
    tokens, types, scores = spm_vocab()
    piece_score = {t: s for t, ty, s in zip(tokens, types, scores, strict=True) if ty == 1}
    ids = {t: i for i, t in enumerate(tokens)}
    out: list[int] = []
    segment = ""
    i = 0
    while i <= len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        if special is None and i < len(text):
            segment += text[i]
            i += 1
            continue
        if segment:
            symbols = list(SPACE + segment.replace(" ", SPACE))
            while True:
                candidates = [(piece_score[a + b], -j) for j, (a, b)
                              in enumerate(zip(symbols, symbols[1:], strict=False))
                              if a + b in piece_score]
                if not candidates:
                    break
                j = -max(candidates)[1]
                symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
            for symbol in symbols:
                if symbol in piece_score:
                    out.append(ids[symbol])
                else:
                    out += [ids[f"<0x{b:02X}>"] for b in symbol.encode()]
            segment = ""
        if special is not None:
            out.append(SPECIALS[special])
            i += len(special)
        else:
            i += 1
    return out


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("spm")
    make_tiny_gguf(path / "spm.gguf", tokenizer_model="llama", chat_template=None)
    return Tokenizer.from_dir(convert_gguf(path / "spm.gguf", path / "out"))


TEXTS = ["the cat sat on the mat.", "  two leading spaces", "théâtre 中文 😀!", "at 10 to 12,",
         "<s>the hat</s> then<unk>", "", " ", "trailing space ", "a\nb\tc"]


@pytest.mark.parametrize("text", TEXTS)
def test_matches_reference_spm(spm, text):
    assert spm.encode(text) == reference_spm_encode(text)


@settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "60")), deadline=None)
@given(text=st.lists(st.sampled_from(list("the cat mat 12,.!'éü中😀  ") + ["</s>", "<s>"]),
                    max_size=30).map("".join) | st.text(max_size=20))
def test_matches_reference_spm_on_random_text(spm, text):
    assert spm.encode(text) == reference_spm_encode(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])
def test_round_trip_and_bos(spm, text):
    ids = spm.encode(text)
    assert spm.decode(ids) == text
    assert spm.encode(text, add_special_tokens=True) == [1, *ids]  # llama.cpp's default BOS
    assert spm.bos_token_id == 1 and spm.eos_token_id == 2


@settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "60")), deadline=None)
@given(ids=st.lists(st.integers(0, len(spm_vocab()[0]) - 1), max_size=20), skip=st.booleans())
def test_detokenizer_with_byte_fallback(spm, ids, skip):
    check_stream(spm, ids, skip)


def test_config_says_bos(tmp_path: Path):
    make_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    out = convert_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    assert '"add_bos_token": true' in (out / "tokenizer_config.json").read_text()


def test_byte_fallback_characters_stream_whole(spm):
    text = "the 中文 cat 😀😀 sat é!"
    ids = spm.encode(text)
    assert sum(spm.id_to_token(i).startswith("<0x") for i in ids) >= 14  # 中文 and the emoji
    detok = IncrementalDetokenizer(spm)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert not any("\ufffd" in p for p in pieces)
