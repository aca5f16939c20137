"""Build tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types (gguf.TokenType): UNKNOWN and CONTROL tokens are special (matched in
# text, skipped when decoding), USER_DEFINED are added tokens that stay in decoded text.
_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "\u2581"  # sentencepiece's visible space

# The Llama 3 / Qwen2 pre-tokenizer regexes (as in their tokenizer.json), split off before the
# byte-level mapping.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    # SmolLM: every numeric character on its own, then GPT-2's byte-level regex
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_REGEX),
    "qwen2": lambda: _split_then_bytes(_QWEN2_REGEX),
}


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer cannot be rebuilt as a `tokenizers` pipeline."""


def add_bos_token(meta: dict[str, Any]) -> bool:
    """llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int]) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(_PRE_TOKENIZERS)})")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def merges_from_scores(tokens: list[str], scores: list[float],
                       token_types: list[int]) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges the adjacent pair whose concatenation is the best-scored normal
    piece; as BPE merges: every split of a normal piece into two vocabulary pieces, ranked by
    the piece's score (then longer left part first, as transformers ranks them)."""
    vocab = set(tokens)
    ranked = []
    for token, score, token_type in zip(tokens, scores, token_types, strict=True):
        if token_type != _NORMAL:
            continue
        for i in range(1, len(token)):
            if token[:i] in vocab and token[i:] in vocab:
                ranked.append((-score, -i, -(len(token) - i), token[:i], token[i:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(meta: dict[str, Any], vocab: dict[str, int], tokens: list[str],
                       token_types: list[int]) -> HFTokenizer:
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = merges_from_scores(tokens, list(meta["tokenizer.ggml.scores"]), token_types)
    else:
        raise GGUFTokenizerError("a 'llama' tokenizer needs tokenizer.ggml.scores or merges")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    # byte_fallback: a character with no piece becomes its UTF-8 bytes as <0xXX> pieces
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                 unk_token=None if unk_id is None else tokens[unk_id]))
    # as llama.cpp and the original Llama tokenizer.json: a space before every text segment
    # (the text between special tokens) when add_space_prefix, spaces as U+2581
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", _SPACE)]
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE), *steps] if space_prefix else steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


def build_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """A `tokenizers.Tokenizer` from the GGUF's tokenizer.ggml.* metadata: byte-level BPE
    (tokenizer.ggml.model 'gpt2') or sentencepiece BPE with byte fallback ('llama')."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {model!r} is not supported (kvcore converts 'gpt2', "
            "byte-level BPE, and 'llama', sentencepiece BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicates")
    token_types = list(meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if model == "gpt2":
        tok = _byte_level_bpe(meta, vocab)
    else:
        tok = _sentencepiece_bpe(meta, vocab, tokens, token_types)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos_token(meta) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    elif model == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # normalized=False: the text of an added token is matched as is, before normalization
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(token_types) if t in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(token_types) if t == _USER_DEFINED])
    for i, t in enumerate(token_types):
        # an added token must keep its GGUF id, or every id after it would shift
        if t in (_UNKNOWN, _CONTROL, _USER_DEFINED) and tok.token_to_id(tokens[i]) != i:
            raise GGUFTokenizerError(f"added token {tokens[i]!r} did not keep its id {i}")
    return tok


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """bos / eos / unk / pad ids present in the metadata, keyed by their HF name."""
    ids = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = "padding" if name == "pad" else ("unknown" if name == "unk" else name)
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ids[name] = int(value)
    return ids


def tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS policy and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos_token(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    for name, token_id in special_token_ids(meta).items():
        cfg[f"{name}_token"] = tokens[token_id]
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        cfg["chat_template"] = template
    return cfg


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: bos, pad and every end-of-turn id as eos."""
    ids = special_token_ids(meta)
    eos = [ids["eos"]] if "eos" in ids else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    cfg: dict[str, Any] = {}
    if "bos" in ids:
        cfg["bos_token_id"] = ids["bos"]
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad" in ids:
        cfg["pad_token_id"] = ids["pad"]
    return cfg
