"""The converted SmolLM2 tokenizer vs a from-scratch GPT-2 byte-level BPE with the smollm split."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcore.model.tokenizer import Tokenizer
from tiny_model import byte_to_unicode

regex = pytest.importorskip("regex", reason="the reference BPE needs the regex module")

# GPT-2's pre-tokenization pattern (openai/gpt-2 encoder.py)
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
NUMERAL = regex.compile(r"(\p{N})")


class ReferenceBPE:
    """openai/gpt-2 encoder.py's BPE, after llama.cpp's smollm rule: every \\p{N} alone."""

    def __init__(self, tokenizer_json: Path) -> None:
        model = json.loads(tokenizer_json.read_text())["model"]
        self.vocab: dict[str, int] = model["vocab"]
        self.ranks = {tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m): i
                      for i, m in enumerate(model["merges"])}
        self.byte_chars = byte_to_unicode()

    def bpe(self, word: list[str]) -> list[str]:
        while len(word) > 1:
            pairs = set(zip(word, word[1:], strict=False))
            best = min(pairs, key=lambda p: self.ranks.get(p, math.inf))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):  # every occurrence of the best pair, left to right
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text: str) -> list[int]:
        ids = []
        for part in NUMERAL.split(text):
            for piece in GPT2_PATTERN.findall(part):
                word = [self.byte_chars[b] for b in piece.encode()]
                ids += [self.vocab[token] for token in self.bpe(word)]
        return ids


@pytest.fixture(scope="module")
def pair(default_model_dir: Path) -> tuple[Tokenizer, ReferenceBPE]:
    return (Tokenizer.from_dir(default_model_dir),
            ReferenceBPE(default_model_dir / "tokenizer.json"))


def _representable(ref: ReferenceBPE, text: str) -> bool:
    return all(ref.byte_chars[b] in ref.vocab for b in text.encode())


TEXTS = [
    "The quick brown fox jumps over the lazy dog's back, doesn't it? I'll see; we'd've known.",
    "for (int i = 0; i < n; ++i) { sum += a[i] * 2.5e-3; }  // 100% done\n\n\tprint(f'{x!r}')",
    "Prices: $1,299.99 (was £1.5k) — 3×4=12, ٣ + ४ = 7, x² + y³, 2024-11-29T15:32:24Z",
    "Ünïcödé naïve café; 中文 日本語 한국어; emoji 😀👍🏽🇫🇷; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "   multiple   spaces\n\n\nnewlines\r\n  and trailing whitespace   ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_matches_reference_bpe(pair, text):
    tok, ref = pair
    assert tok.encode(text) == ref.encode(text)


@settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "60")), deadline=None)
@given(text=st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
       | st.text("ab 1\n'é中😀.,s", max_size=40))
def test_matches_reference_bpe_on_random_text(pair, text):
    tok, ref = pair
    assume(_representable(ref, text) and "<" not in text)  # no special-token text
    assert tok.encode(text) == ref.encode(text)
