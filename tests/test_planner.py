"""The KV planner: the issue's numbers, an array-size oracle, sliding windows, sizes, errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import ModelConfig
from kvcore.planner import (
    DTYPE_BYTES,
    bytes_per_token,
    canonical_dtype,
    format_size,
    num_blocks_for_memory,
    parse_size,
    plan,
    plan_for_model,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16,
             "fp8": ml_dtypes.float8_e4m3fn}


def test_llama2_7b_shape_reproduces_the_issue() -> None:
    p = plan(32, 32, 128, "fp16", 4096, memory=64 * GiB)
    assert p.bytes_per_token == 524288
    assert format_size(p.bytes_per_token) == "512 KiB"
    assert p.bytes_per_sequence == 2 * GiB
    assert format_size(p.bytes_per_sequence) == "2 GiB"
    assert p.blocks_per_sequence == 256
    assert p.num_blocks == 8192
    assert p.max_concurrent_sequences == 32
    # and 32 such sequences need exactly the 64 GiB
    assert 32 * p.bytes_per_sequence == parse_size("64GiB")


def test_70b_gqa_shape_reproduces_the_issue() -> None:
    p = plan(80, 8, 128, "fp16", 32000)
    assert p.bytes_per_token == 320 * KiB
    assert format_size(p.bytes_per_token) == "320 KiB"
    assert p.bytes_per_sequence == 32000 * 320 * KiB
    assert abs(p.bytes_per_sequence / GiB - 10) < 0.25  # "about 10 GiB"
    assert format_size(p.bytes_per_sequence) == "9.77 GiB"
    assert p.num_blocks is None and p.max_concurrent_sequences is None


def test_70b_without_gqa_is_2_5_mib_per_token() -> None:
    assert bytes_per_token(80, 64, 128, "fp16") == int(2.5 * MiB)
    assert format_size(bytes_per_token(80, 64, 128, "fp16")) == "2.5 MiB"


@pytest.mark.parametrize(("layers", "kv_heads", "context", "memory"),
                         [(32, 32, 4096, 64 * GiB), (80, 8, 32000, 80 * GiB), (80, 64, 4096, None)])
def test_fp8_halves_each_figure(layers: int, kv_heads: int, context: int,
                                memory: int | None) -> None:
    half, full = (plan(layers, kv_heads, 128, dtype, context, memory=memory)
                  for dtype in ("fp8", "fp16"))
    assert half.bytes_per_token * 2 == full.bytes_per_token
    assert half.bytes_per_block * 2 == full.bytes_per_block
    assert half.bytes_per_sequence * 2 == full.bytes_per_sequence
    if memory is not None:
        assert full.num_blocks is not None and full.max_concurrent_sequences is not None
        assert half.num_blocks == 2 * full.num_blocks
        assert half.max_concurrent_sequences is not None
        assert half.max_concurrent_sequences >= 2 * full.max_concurrent_sequences
    assert format_size(plan(32, 32, 128, "fp8", 4096).bytes_per_sequence) == "1 GiB"


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 6), kv_heads=st.integers(1, 5), head_dim=st.integers(1, 80),
       dtype=st.sampled_from(sorted(DTYPE_BYTES)))
def test_bytes_per_token_equals_real_arrays(layers: int, kv_heads: int, head_dim: int,
                                            dtype: str) -> None:
    # oracle: the bytes of an actual K and V array of one token in every layer
    kv = np.empty((2, layers, 1, kv_heads, head_dim), dtype=NP_DTYPES[dtype])  # (K/V, L, T, Hkv, D)
    assert bytes_per_token(layers, kv_heads, head_dim, dtype) == kv.nbytes


@settings(max_examples=60, deadline=None)
@given(context=st.integers(1, 20000), block_size=st.sampled_from([1, 8, 16, 32]),
       memory=st.integers(1, 2**34))
def test_concurrency_is_the_most_whole_sequences_that_fit(context: int, block_size: int,
                                                         memory: int) -> None:
    p = plan(4, 2, 64, "fp16", context, memory=memory, block_size=block_size)
    per_block = 2 * 4 * 2 * 64 * 2 * block_size
    assert p.bytes_per_block == per_block
    assert p.num_blocks == memory // per_block
    assert p.blocks_per_sequence * block_size >= context > (p.blocks_per_sequence - 1) * block_size
    assert p.max_concurrent_sequences is not None
    assert p.max_concurrent_sequences * p.blocks_per_sequence <= p.num_blocks
    assert (p.max_concurrent_sequences + 1) * p.blocks_per_sequence > p.num_blocks
    assert num_blocks_for_memory(memory, 4, 2, 64, "fp16", block_size) == p.num_blocks


def test_partial_last_block_costs_a_whole_block() -> None:
    p = plan(32, 32, 128, "fp16", 4097, memory=64 * GiB)
    assert p.blocks_per_sequence == 257
    assert p.bytes_per_sequence == 257 * 16 * 512 * KiB
    assert p.max_concurrent_sequences == 8192 // 257  # 31: one token more costs a sequence


def test_budget_below_one_block_holds_nothing() -> None:
    p = plan(32, 32, 128, "fp16", 4096, memory=8 * MiB - 1)
    assert p.num_blocks == 0 and p.max_concurrent_sequences == 0


def test_sliding_window_caps_the_sequence() -> None:
    # Mistral-7B: 32 layers, 8 KV heads, window 4096; 32k tokens of context hold the window
    # (256 blocks) plus one block for a window straddling a block boundary
    p = plan(32, 8, 128, "fp16", 32768, memory=24 * GiB, sliding_window=4096)
    assert p.tokens_per_sequence == 4096 + 16
    assert p.blocks_per_sequence == 257
    assert p.bytes_per_sequence == 257 * 16 * 128 * KiB
    assert p.max_concurrent_sequences == (24 * GiB // (16 * 128 * KiB)) // 257  # 47
    no_window = plan(32, 8, 128, "fp16", 32768, memory=24 * GiB)
    assert no_window.max_concurrent_sequences == 6


@pytest.mark.parametrize(("window", "context", "tokens"),
                         [(100, 5000, 128), (16, 5000, 32), (17, 5000, 48), (100, 64, 64),
                          (4096, 4100, 4100), (1, 10, 10)])
def test_sliding_window_rounds_up_to_blocks_plus_one(window: int, context: int,
                                                     tokens: int) -> None:
    assert plan(2, 2, 64, "fp32", context, sliding_window=window).tokens_per_sequence == tokens


def test_plan_for_model_uses_the_config() -> None:
    mistral = ModelConfig(architecture="mistral", num_layers=32, hidden_size=4096, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
                          rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                          tie_word_embeddings=False, attention_bias=False, sliding_window=4096)
    p = plan_for_model(mistral, "bf16", memory=24 * GiB)
    assert p == plan(32, 8, 128, "bf16", 32768, memory=24 * GiB, sliding_window=4096)
    assert plan_for_model(mistral, "fp8", context=1000).tokens_per_sequence == 1000


@pytest.mark.parametrize(("text", "expected"), [
    ("64GiB", 64 * GiB), ("64 GiB", 64 * GiB), ("64gib", 64 * GiB), ("512KiB", 512 * KiB),
    ("2.5MiB", 5 * MiB // 2), ("1TiB", 2**40), ("24GB", 24 * 10**9), ("1.1GB", 1_100_000_000),
    ("10KB", 10_000), ("3MB", 3_000_000), ("2TB", 2 * 10**12), ("100B", 100), ("4096", 4096),
    (".5KiB", 512), (" 7 ", 7), (1234, 1234),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "64 GiBs", "-1GiB", "1e9", "GiB", "1.2.3KB", "64 Gi",
                                  "0x10"])
def test_parse_size_rejects_garbage_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"), (1000, "1000 B"), (1024, "1 KiB"), (512 * KiB, "512 KiB"),
    (5 * MiB // 2, "2.5 MiB"),
    (2 * GiB, "2 GiB"), (10_485_760_000, "9.77 GiB"), (3 * 2**40, "3 TiB"), (1536, "1.5 KiB"),
])
def test_format_size(num_bytes: int, text: str) -> None:
    assert format_size(num_bytes) == text


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"num_layers": 0}, "num_layers"), ({"num_layers": -2}, "num_layers"),
    ({"num_kv_heads": 0}, "num_kv_heads"), ({"head_dim": -128}, "head_dim"),
    ({"context": 0}, "context"), ({"context": -1}, "context"), ({"memory": 0}, "memory"),
    ({"memory": -5}, "memory"), ({"block_size": 0}, "block_size"),
    ({"sliding_window": 0}, "sliding_window"), ({"sliding_window": -4096}, "sliding_window"),
    ({"num_layers": 2.5}, "num_layers"), ({"num_layers": True}, "num_layers"),
    ({"dtype": "fp4"}, "dtype"), ({"dtype": "int8"}, "dtype"),
])
def test_bad_input_names_the_parameter_and_value(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                               "dtype": "fp16", "context": 4096, "memory": GiB}
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        plan(**args)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(name) and repr(kwargs[name]) in message


def test_dtype_aliases() -> None:
    assert canonical_dtype("float16") == "fp16"
    assert canonical_dtype("bfloat16") == "bf16"
    assert canonical_dtype("float32") == "fp32"
    assert canonical_dtype("float8_e4m3fn") == "fp8"
    assert bytes_per_token(1, 1, 1, "bfloat16") == 4
