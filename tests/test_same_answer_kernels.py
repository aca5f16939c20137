"""The guard against batch-dependent reductions: every CPU kernel of the forward pass and the
sampler gives a row the same bits whether it is computed alone or among other rows (1 row, 7
rows, and other counts that take other code paths: tiles of 4 and 6 rows, tails, thread
splits), and attention gives a query row the same bits as a decode token, inside a prefill
chunk of any size, with its keys written by this step or an earlier one. A kernel whose
reduction order depends on the batch fails here before any engine test runs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvcore import kernels
from kvcore.cache.kv_cache import KVCache
from kvcore.kernels import cpu
from kvcore.kernels.cpu import jit, quant
from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.model.llama import _linear
from kvcore.sampling import SamplingParams, SamplingRow
from kvcore.sampling.xp_sampler import XpSampler

pytestmark = pytest.mark.skipif(not jit.active(),
                                reason="the promise is the compiled CPU kernels'")

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 13, 64, 130)


def shared_row_bits(op, rows: np.ndarray, target: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    """The row counts m (with m > target) for which op(rows[:m])[target] differs from
    op(rows[target:target + 1])[0] in any bit."""
    alone = op(rows[target:target + 1])[0]
    return [m for m in ROW_COUNTS if m > target
            and not np.array_equal(op(rows[:m])[target], alone, equal_nan=True)]


@pytest.mark.parametrize(("out_features", "in_features"), [(300, 96), (1536, 576), (49, 37),
                                                           (2048, 64)])
def test_float32_linear(out_features: int, in_features: int) -> None:
    rng = np.random.default_rng(out_features)
    weight = jit.aligned(rng.standard_normal((out_features, in_features), np.float32))
    x = rng.standard_normal((max(ROW_COUNTS), in_features), np.float32)
    assert shared_row_bits(lambda rows: _linear(rows, weight), x) == []
    assert shared_row_bits(lambda rows: _linear(rows, weight), x, target=5) == []
    out = _linear(x[:7], weight)
    reference = x[:7].astype(np.float64) @ weight.T.astype(np.float64)
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4 * np.sqrt(in_features))
    # an unaligned, non-contiguous x: copied, the same bits
    wide = np.zeros((7, in_features + 3), np.float32)
    wide[:, 1:in_features + 1] = x[:7]
    assert np.array_equal(_linear(wide[:, 1:in_features + 1], weight), out)


def test_lm_head_sized_linear() -> None:
    """The LM head's shape class: many outputs (thread shares), few rows."""
    rng = np.random.default_rng(3)
    weight = jit.aligned(rng.standard_normal((20_000, 64), np.float32))
    x = rng.standard_normal((max(ROW_COUNTS), 64), np.float32)
    assert shared_row_bits(lambda rows: _linear(rows, weight), x, target=2) == []


@pytest.mark.parametrize("isa", quant.AVAILABLE_ISAS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quantized_linear(fmt: str, isa: str) -> None:
    rng = np.random.default_rng(len(fmt))
    weight = quant.QUANTIZERS[fmt](rng.standard_normal((200, 128)))
    x = rng.standard_normal((max(ROW_COUNTS), 128)).astype(np.float32)
    op = lambda rows: quant.linear(rows, weight, isa)  # noqa: E731
    assert shared_row_bits(op, x) == [] and shared_row_bits(op, x, target=6) == []


def test_norm_rope_swiglu() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4096, 576), np.float32)  # past the ops' parallel row split
    weight = rng.standard_normal(576, np.float32)
    assert shared_row_bits(lambda rows: kernels.rms_norm(rows, weight, 1e-5), x, 3) == []
    assert shared_row_bits(kernels.silu_and_mul, x, 3) == []
    cos, sin = cpu.rope_cos_sin(cpu.rope_inv_freq(64, 1e4), 5000)
    q = rng.standard_normal((4096, 9, 64), np.float32)
    positions = rng.integers(0, 5000, 4096)
    alone = kernels.rope(q[3:4], positions[3:4], cos, sin)[0]
    for m in (4, 7, 130, 4096):
        assert np.array_equal(kernels.rope(q[:m], positions[:m], cos, sin)[3], alone)


def _cache(dtype: str, num_blocks: int, block_size: int, heads: int, dim: int) -> KVCache:
    extra = dict(num_window_slots=num_blocks, window_tokens=2 * block_size) \
        if dtype == "int4" else {}
    return KVCache(1, num_blocks, block_size, heads, dim, dtype, **extra)  # type: ignore[arg-type]


def _write(cache: KVCache, table: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
           end: int) -> None:
    """One step writing positions [start, end) of a sequence (K/V rows (ctx, Hkv, D)), with an
    int4 cache's window operations for them as the engine runs them."""
    bs = cache.block_size
    if cache.window is not None:  # every block written holds a slot; blocks past whole
        window = cache.window   # super-blocks before `end - 1` are read sealed
        ops = []
        for b in range(start // bs, -(-end // bs)):
            if window.slot_of[table[b]] is None:
                window.open(int(table[b]))
            window.written(int(table[b]))
        span = window.window_blocks * bs
        for b in range((end - 1) // span * window.window_blocks):
            window.step_seal(int(table[b]))
        ops = window.take_ops()
        cache.apply_window_ops(ops)
    k_layer, v_layer, k_scale, v_scale = cache.layer(0)
    pos = np.arange(start, end)
    slots = table[pos // bs].astype(np.int64) * bs + pos % bs
    kernels.reshape_and_cache(k[start:end], v[start:end], k_layer, v_layer, slots, k_scale,
                              v_scale)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8", "int4"])
def test_attention_prefill_decode_and_cached_keys(dtype: str, window: int | None) -> None:
    """Rows of one sequence computed as decode tokens (keys from earlier steps), as prefill
    chunks of several sizes (their keys written in this step), and beside other sequences:
    the same bits."""
    rng = np.random.default_rng(7)
    bs, heads, kv_heads, dim, ctx = 16, 9, 3, 64, 300
    num_blocks = 2 * (ctx // bs + 2)
    k = rng.standard_normal((ctx, kv_heads, dim), np.float32)
    v = rng.standard_normal((ctx, kv_heads, dim), np.float32)
    q = rng.standard_normal((ctx, heads, dim), np.float32)
    table = rng.permutation(num_blocks)[:ctx // bs + 1].astype(np.int32)
    other_q = rng.standard_normal((5, heads, dim), np.float32)

    def attend(cache: KVCache, start: int, end: int, extra: int) -> np.ndarray:
        """Rows [start, end) as one chunk, beside `extra` decode rows of a second sequence
        that reads the first one's blocks (a prefix-cache hit)."""
        k_layer, v_layer, _, _ = cache.layer(0)
        query = np.concatenate([q[start:end], other_q[:extra]])
        tables = np.stack([table, table])[:1 + (extra > 0)]
        lens = np.array([end, 160][:1 + (extra > 0)], np.int32)
        starts = np.array([0, end - start, end - start + extra][:2 + (extra > 0)], np.int32)
        return kernels.paged_attention(query, k_layer, v_layer, tables, lens, starts,
                                       dim ** -0.5, window)[:end - start]

    outs = {}
    for chunk in (1, 7, 16, 45, 300):  # decode steps, small and large prefill chunks
        cache = _cache(dtype, num_blocks, bs, kv_heads, dim)
        rows = []
        for start in range(0, ctx, chunk):
            end = min(ctx, start + chunk)
            _write(cache, table, k, v, start, end)
            rows.append(attend(cache, start, end, extra=(start // chunk) % 3))
        outs[chunk] = np.concatenate(rows)
    for chunk, out in outs.items():
        assert np.array_equal(out, outs[1]), (dtype, chunk)


def test_int4_layer_reads_by_position() -> None:
    """An int4 row reads its own super-block from the window and earlier blocks sealed: the
    same bits whatever else the slot table says (a slot kept for another reader)."""
    rng = np.random.default_rng(9)
    cache = _cache("int4", 8, 4, 1, 16)
    table = np.arange(8, dtype=np.int32)
    k = rng.standard_normal((24, 1, 16), np.float32)
    _write(cache, table, k, k, 0, 24)
    k_layer, v_layer, _, _ = cache.layer(0)
    assert isinstance(k_layer, Int4Layer) and k_layer.window_blocks == 2
    query = rng.standard_normal((1, 2, 16), np.float32)
    args = (np.array([[0, 1, 2, 3, 4, 5]], np.int32), np.array([23], np.int32),
            np.array([0, 1], np.int32), 0.25)
    before = kernels.paged_attention(query, k_layer, v_layer, *args)
    reference = cpu._numpy_attention(query, k_layer, v_layer, *args, None, 1.0, 1.0)
    np.testing.assert_allclose(before, reference, rtol=1e-5, atol=1e-6)
    sealed = [b for b in range(4) if cache.window_slot[b] < 0]
    assert sealed == []  # the step sealed blocks 0-3 and kept their slots
    cache.window_slot[:4] = -1  # later steps give them back: the same bits
    assert np.array_equal(kernels.paged_attention(query, k_layer, v_layer, *args), before)


def test_sampler_rows_alone_and_batched() -> None:
    """Greedy and seeded rows (penalties, top-k / top-p, logprobs) draw the same token and
    logprobs alone and among other rows."""
    rng = np.random.default_rng(11)
    vocab = 4096
    logits = (rng.standard_normal((7, vocab)) * 3).astype(np.float32)
    history = rng.integers(0, vocab, 20).tolist()
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.8, seed=5, logprobs=2, repetition_penalty=1.2),
              SamplingParams(temperature=1.1, seed=6, top_k=20, top_p=0.9, logprobs=0),
              SamplingParams(temperature=0.7, seed=7, presence_penalty=0.4,
                             frequency_penalty=0.3),
              SamplingParams(temperature=1.0, seed=8, min_p=0.05, logprobs=4),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=9)]
    rows = [SamplingRow(p, history[:5 + i], (3, 4, 5), None if p.seed is None else 7 + i)
            for i, p in enumerate(params)]
    sampler = XpSampler((2,), vocab)

    def draw(indices: list[int]) -> list[tuple]:
        batch = sampler.batch([rows[i] for i in indices])
        out = sampler(logits[indices].copy(), batch)
        return [(int(t), lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]

    batched = draw(list(range(7)))
    for i in range(7):
        assert draw([i]) == [batched[i]], i
    assert draw([6, 2, 4]) == [batched[6], batched[2], batched[4]]


def test_fp8_and_bf16_caches_store_what_they_read() -> None:
    """A key written by a step is read by later steps exactly as the step's own rows read it
    (the cache's stored form), never as the activation it came from."""
    rng = np.random.default_rng(2)
    for dtype, np_dtype in (("fp8", ml_dtypes.float8_e4m3fn), ("bf16", ml_dtypes.bfloat16)):
        cache = _cache(dtype, 4, 4, 1, 16)
        table = np.arange(4, dtype=np.int32)
        k = rng.standard_normal((8, 1, 16), np.float32)
        _write(cache, table, k, k, 0, 8)
        k_layer = cache.layer(0)[0]
        stored = k_layer[table[:2]].reshape(8, 1, 16)
        assert np.array_equal(stored, k.astype(np_dtype))
