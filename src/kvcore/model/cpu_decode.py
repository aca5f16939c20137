"""The fused CPU decode step for the Llama-family model: its weights stacked per kind (every
layer a view of one array, so nothing is held twice) and the call of
kvcore.kernels.cpu.decode_step.run_layers for a batch of up to MAX_ROWS query rows.

What it takes: float32 weights, or quantized ones of one format per kind (int8, q4, q8) whose
dimensions are whole kernel tiles; fp32, fp16 and bf16 KV caches; no q/k norm (Qwen3) and no
sliding window beyond what the attention items handle. Everything else (larger batches, fp8 and
int4 caches, a GGUF that mixes block formats within a fused weight) runs the per-op path, which
gives a row the same bits (kvcore.kernels.cpu.decode_step). $KVCORE_CPU_FUSED=0 turns it off.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.kernels.cpu import jit, quant
from kvcore.kernels.cpu.attention_blocks import MODE_BF16, MODE_FP16, MODE_FP32
from kvcore.kernels.cpu.quant import BLOCK, PAD_K, TILE, QuantizedWeight
from kvcore.kernels.cpu.threads import num_threads
from kvcore.model.batch import BatchInput

KINDS = ("qkv", "o", "gate_up", "down")
_MODES = {"fp32": MODE_FP32, "bf16": MODE_BF16, "fp16": MODE_FP16}
_NO_INT4 = (np.zeros((1, 1, 1, 1), np.uint16), np.zeros((1, 1, 1, 1), np.uint16),
            np.zeros(1, np.int32), 0, 0)


def enabled() -> bool:
    return os.environ.get("KVCORE_CPU_FUSED", "1") != "0"


def _stack_kind(layers: list[Any], kind: str) -> tuple[tuple, list[Any]] | None:
    """((weights (L, X), scales (L, Y), terms (L, Np, B), meta), the per-layer views) or None
    when the layers' weights of this kind cannot run fused."""
    parts = [getattr(layer, kind) for layer in layers]
    if all(isinstance(p, np.ndarray) and p.dtype == np.float32 for p in parts):
        n, k = parts[0].shape
        stack = jit.aligned(np.stack([p.reshape(-1) for p in parts]))  # (L, N K)
        meta = np.array([n, k, 0, 0, 0, 0, 0, n], np.int64)
        none = np.zeros((len(parts), 1), np.float32)
        return (stack, none, none.reshape(len(parts), 1, 1), meta), [
            row.reshape(n, k) for row in stack]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    fmt, (n, k) = parts[0].format, parts[0].shape
    if any(p.format != fmt or p.shape != (n, k) for p in parts) or n % TILE or k % BLOCK:
        return None
    isa = quant.ISA
    if isa is None:
        return None
    vnni = quant.ISA_NAMES[isa] is quant.ISA_VNNI
    kp = quant.padded(k, PAD_K)
    q = np.stack([p.q.reshape(-1) for p in parts])  # (L, Np Kp') codes
    scales = np.stack([p.scales.reshape(-1) for p in parts])
    if fmt == "q4":
        terms, kind_of_terms = np.stack([p.mins for p in parts]), 1  # type: ignore[misc]
    elif vnni:
        terms, kind_of_terms = np.stack([p.offsets for p in parts]), 2  # type: ignore[misc]
    else:
        terms, kind_of_terms = np.zeros((len(parts), 1, 1), np.float32), 0
    int8 = fmt == "int8"
    meta = np.array([n, k, kp, 2 if int8 else kp // BLOCK, 0 if int8 else 1, kind_of_terms,
                     int(vnni and fmt == "q4"), parts[0].q.shape[0]], np.int64)
    views = [QuantizedWeight(fmt, (n, k), q[i].reshape(p.q.shape), scales[i].reshape(
        p.scales.shape), terms[i] if fmt == "q4" else None,
        terms[i] if kind_of_terms == 2 else p.offsets) for i, p in enumerate(parts)]
    return (q, scales, terms, meta), views


class FusedDecode:
    """The stacked weights of a model and the call of the fused region."""

    def __init__(self, model: Any, kinds: dict[str, tuple]) -> None:
        c = model.config
        self.config, self.model = c, model
        self.weights = kinds
        layers = model.layers
        self.norms = (np.stack([layer.input_norm for layer in layers]),
                      np.stack([layer.post_norm for layer in layers]))  # (L, hidden) each
        none = np.zeros((1, 1), np.float32)
        self.biases = (np.stack([layer.qkv_bias for layer in layers])
                       if layers[0].qkv_bias is not None else none,
                       np.stack([layer.o_bias for layer in layers])
                       if layers[0].o_bias is not None else none)
        self.has_bias = (layers[0].qkv_bias is not None, layers[0].o_bias is not None)
        self.isa = quant.ISA_NAMES.get(quant.ISA or "", quant.ISA_VNNI)

    @classmethod
    def build(cls, model: Any) -> FusedDecode | None:
        """The fused step for `model` (its layers' weights become views of the stacks), or
        None where it cannot run (see the module docstring)."""
        c = model.config
        if not model.layers or not all(hasattr(model.layers[0], kind) for kind in KINDS):
            return None  # another family's layers (MLA, MoE)
        if (model.xp is not np or not enabled() or not jit.active() or c.qk_norm
                or c.head_dim % TILE or c.hidden_size % TILE or c.intermediate_size % TILE):
            return None
        stacked = {}
        for kind in KINDS:
            found = _stack_kind(model.layers, kind)
            if found is None:
                return None
            stacked[kind] = found
        for kind, (_, views) in stacked.items():
            for layer, view in zip(model.layers, views, strict=True):
                setattr(layer, kind, view)
        return cls(model, {kind: arrays for kind, (arrays, _) in stacked.items()})

    def warm_up(self, cache_dtype: str) -> float:
        """Load (or compile, on a machine's first start) the region for this model's weights
        and `cache_dtype` with a one-token step on a cache of its own: no JIT on a request.
        Returns the seconds it took."""
        start = time.perf_counter()
        if cache_dtype in _MODES:
            c = self.config
            cache = KVCache(c.num_layers, 1, 4, c.num_kv_heads, c.head_dim, cache_dtype)
            self.model.forward(BatchInput.build([[0]], [0], [[0]], 4), cache)
        return time.perf_counter() - start

    def takes(self, num_tokens: int, kv_cache: Any) -> bool:
        from kvcore.kernels.cpu.decode_step import MAX_ROWS

        return (0 < num_tokens <= MAX_ROWS and kv_cache.dtype in _MODES
                and kv_cache.key_stack is not None and not kv_cache.shared_kv)

    def run(self, h: np.ndarray, batch: Any, kv_cache: Any, cos: np.ndarray,
            sin: np.ndarray) -> None:
        """Every layer over the residual rows h (T, hidden) float32, in place; writes the
        step's K/V to the cache."""
        from kvcore.kernels.cpu import decode_step

        c = self.config
        kernel = jit.compiled()
        assert kernel is not None
        rows = h.shape[0]
        mode = _MODES[kv_cache.dtype]
        bs = kv_cache.block_size
        tables = np.ascontiguousarray(batch.block_tables, dtype=np.int32)
        lens = np.ascontiguousarray(batch.context_lens, dtype=np.int32)
        starts = np.ascontiguousarray(batch.query_start_loc, dtype=np.int32)
        window = int(c.sliding_window or 0)
        error = kernel.check_batch(tables, lens, starts, bs, kv_cache.num_blocks, window)
        if error:
            raise ValueError(kernel.ERRORS[error])
        items, groups, num_partial = kernel.work_items(lens, starts, bs, window, 0)
        item_group = np.empty(items.shape[0], np.int64)
        for g in range(groups.shape[0]):
            item_group[groups[g, 2]:groups[g, 3]] = g
        threads = decode_step.set_threads(num_threads())
        heads, kv_heads, dim, hidden = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        inter, layers = c.intermediate_size, c.num_layers
        f32 = np.float32

        def quantized_rows(kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            cols = max(int(self.weights[kind][3][2]), BLOCK)  # padded in_features (1: dense)
            return (np.empty((threads, rows, cols), np.int8),
                    np.empty((threads, rows, cols // BLOCK), f32),
                    np.empty((threads, rows, cols // BLOCK), f32))

        scratch = (np.empty((threads, rows, hidden), f32), quantized_rows("qkv"),
                   quantized_rows("o"), quantized_rows("down"), np.empty((threads, dim), f32),
                   np.empty((rows, (heads + 2 * kv_heads) * dim), f32),
                   np.empty((rows, heads, dim), f32), np.empty((rows, heads, dim), f32),
                   np.empty((rows, hidden), f32), np.empty((rows, 2 * inter), f32),
                   np.empty((rows, inter), f32), np.empty((rows, hidden), f32),
                   np.empty(num_partial * heads, f32), np.empty(num_partial * heads, f32),
                   np.empty((num_partial * heads, dim), f32),
                   np.zeros(layers * groups.shape[0], np.int64))
        if mode == MODE_FP32:
            caches = (kv_cache.key_stack, kv_cache.value_stack, _NO_BYTES, _NO_BYTES)
        else:
            caches = (_NO_FLOATS, _NO_FLOATS, kv_cache.key_stack.view(np.uint16),
                      kv_cache.value_stack.view(np.uint16))
        scale = self.model.scale
        k_scales = [float(s) for s in kv_cache.k_scales]
        v_scales = [float(s) for s in kv_cache.v_scales]
        q_scales = np.array([np.float32(scale * k) for k in k_scales], f32)
        kv_scales = np.array([k_scales, v_scales], np.float64).T.copy()  # (L, 2)
        dims = np.array([hidden, heads, kv_heads, dim, inter, rows, layers, self.has_bias[0],
                         self.has_bias[1]], np.int64)
        attn = (tables, lens, starts, window, items, groups, item_group, _NO_INT4)
        w = self.weights
        decode_step.run_layers(
            self.isa, h, np.ascontiguousarray(batch.positions, dtype=np.int64),
            np.ascontiguousarray(batch.slot_mapping, dtype=np.int64), self.norms, w["qkv"],
            w["o"], w["gate_up"], w["down"], self.biases, cos, sin, caches, mode, q_scales,
            kv_scales, attn, dims, float(c.rms_norm_eps), scratch,
            np.zeros(2 * layers * decode_step.PHASES, np.int64))


_NO_FLOATS = np.zeros((1, 1, 1, 1, 1), np.float32)
_NO_BYTES = np.zeros((1, 1, 1, 1, 1), np.uint8)  # as the per-op path's placeholder
