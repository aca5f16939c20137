"""The Llama-family forward (Llama 2/3, Mistral, Qwen2/3, SmolLM2) over the paged KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import numpy as np

from kvcore import kernels
from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.device import get_xp, resolve_device, to_numpy
from kvcore.kernels import cpu
from kvcore.kernels.cpu import jit, quant
from kvcore.kernels.cpu.quant import QuantizedWeight
from kvcore.model.batch import BatchInput, InputFill
from kvcore.model.cpu_decode import FusedDecode
from kvcore.model.staging import CupyStaging, HostStaging


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer as (out, in) matrices, q/k/v and gate/up fused (one GEMM each)."""

    input_norm: Any  # (hidden,)
    qkv: Any  # ((H + 2 Hkv) D, hidden): q, k and v projections fused into one matmul
    qkv_bias: Any | None  # ((H + 2 Hkv) D,)
    o: Any  # (hidden, H D)
    o_bias: Any | None  # (hidden,)
    post_norm: Any  # (hidden,)
    gate_up: Any  # (2 I, hidden): gate and up fused into one matmul
    down: Any  # (hidden, I)
    q_norm: Any | None = None  # (D,) RMSNorm weight of every q head (Qwen3)
    k_norm: Any | None = None  # (D,) of every k head


@dataclass(frozen=True, slots=True)
class DeviceBatch:
    """A BatchInput's arrays on the model's device (NumPy on the CPU): what `run` reads."""

    input_ids: Any  # (T,) int64
    positions: Any  # (T,) int64
    slot_mapping: Any  # (T,) int64
    query_start_loc: Any  # (S+1,) int32
    context_lens: Any  # (S,) int32
    block_tables: Any  # (S, max_blocks) int32
    logits_indices: Any  # (L,) int64


class LlamaModel:
    """Weights on one device and a forward over an explicit BatchInput; no hidden state."""

    staging: HostStaging | None = None  # the GPU's pinned input buffers, made on first use

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 device: str = "cpu") -> None:
        """`weights` maps HF names to float32 arrays (as from load_weights); they are fused,
        transposed and moved to the device here."""
        self.config = config
        self.device = resolve_device(device)
        self.xp: ModuleType = get_xp(self.device)
        c = config
        self.embed = self._put(weights["model.embed_tokens.weight"])  # (vocab, hidden)
        self.norm = self._put(weights["model.norm.weight"])  # (hidden,)
        # (vocab, hidden) as stored, and the embedding's very array when tied (no copy)
        lm_head = weights.get("lm_head.weight")
        self.lm_head = self.embed if lm_head is None or c.tie_word_embeddings else self._put(
            lm_head)  # (vocab, hidden)
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(c.num_layers)]
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._inv_freq = cpu.rope_inv_freq(c.rope_dim, c.rope_theta, c.rope_scaling)
        # yarn scales cos and sin (1 for the other rope types)
        self._cos_sin_factor = c.rope_scaling.cos_sin_factor if c.rope_scaling else 1.0
        self._cos: Any = self.xp.empty((0, c.rope_dim // 2), np.float32)
        self._sin: Any = self._cos
        # the CPU's fused decode step (batches of up to 16 rows), or None where it cannot run
        self.fused = FusedDecode.build(self) if self.xp is np else None

    def _put(self, array: Any) -> Any:
        """A contiguous float32 array on the device, detached from any memory-mapped file; a
        quantized weight (CPU only) as it is."""
        if isinstance(array, QuantizedWeight | tuple):
            if self.xp is not np:
                raise ValueError("quantized weights run on the CPU only")
            return array
        if self.xp is np:  # 64-byte aligned rows for the compiled matmul (a copy, detached)
            return jit.aligned(array, copy=True)
        return self.xp.asarray(np.ascontiguousarray(array, dtype=np.float32))

    def _layer(self, w: dict[str, np.ndarray], p: str) -> Any:
        c = self.config
        qkv_bias = o_bias = None
        if c.attention_bias:
            qkv_bias = self._put(np.concatenate([w[p + f"self_attn.{x}_proj.bias"]
                                                 for x in "qkv"]))
        if c.o_proj_bias:
            o_bias = self._put(w[p + "self_attn.o_proj.bias"])
        return LayerWeights(
            input_norm=self._put(w[p + "input_layernorm.weight"]),
            qkv=self._put(_fuse([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])),
            qkv_bias=qkv_bias,
            o=self._put(w[p + "self_attn.o_proj.weight"]),
            o_bias=o_bias,
            post_norm=self._put(w[p + "post_attention_layernorm.weight"]),
            gate_up=self._put(_fuse([w[p + "mlp.gate_proj.weight"],
                                     w[p + "mlp.up_proj.weight"]])),
            down=self._put(w[p + "mlp.down_proj.weight"]),
            q_norm=self._put(w[p + "self_attn.q_norm.weight"]) if c.qk_norm else None,
            k_norm=self._put(w[p + "self_attn.k_norm.weight"]) if c.qk_norm else None,
        )

    def _rope_tables(self, max_position: int) -> tuple[Any, Any]:
        """cos/sin up to max_position, grown by doubling so steps never recompute them."""
        if max_position >= self._cos.shape[0]:
            size = max(2 * self._cos.shape[0], max_position + 1, 256)
            cos, sin = cpu.rope_cos_sin(self._inv_freq, size)  # (size, D/2) each
            if self._cos_sin_factor != 1.0:
                cos *= np.float32(self._cos_sin_factor)
                sin *= np.float32(self._cos_sin_factor)
            self._cos, self._sin = self.xp.asarray(cos), self.xp.asarray(sin)
        return self._cos, self._sin

    def _check(self, batch: BatchInput, kv_cache: KVCache) -> None:
        c = self.config
        heads, width, shared = c.kv_layout
        if (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.shared_kv) != (
                c.num_layers, heads, width, shared):
            raise ValueError(f"kv_cache holds {kv_cache.num_layers} layers x "
                             f"{kv_cache.num_kv_heads} KV heads x {kv_cache.head_dim} (shared K/V: "
                             f"{kv_cache.shared_kv}), the model needs {c.num_layers} x {heads} x "
                             f"{width} (shared K/V: {shared})")
        if kv_cache.device != self.device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, the model on {self.device}")
        num_tokens = batch.input_ids.shape[0]
        for name in ("positions", "slot_mapping"):
            if getattr(batch, name).shape != (num_tokens,):
                raise ValueError(f"batch.{name} must have shape ({num_tokens},), "
                                 f"got {getattr(batch, name).shape}")
        if num_tokens and (batch.input_ids.min() < 0 or batch.input_ids.max() >= c.vocab_size):
            raise ValueError(f"batch.input_ids must lie in [0, {c.vocab_size})")

    # forward(..., fill=InputFill): pending tokens gathered on the device (async scheduling)
    supports_input_fill = True

    def forward(self, batch: BatchInput, kv_cache: KVCache,
                fill: InputFill | None = None) -> np.ndarray:
        """(L, vocab) float32 host logits at batch.logits_indices; writes the step's K/V to the
        cache."""
        return np.ascontiguousarray(to_numpy(self.forward_device(batch, kv_cache, fill)),
                                    dtype=np.float32)

    def forward_device(self, batch: BatchInput, kv_cache: KVCache,
                       fill: InputFill | None = None) -> Any:
        """forward() with the logits left on the model's device: (L, vocab) float32, NumPy on
        the CPU, CuPy on the GPU (the engine samples them there). On the GPU each input field
        goes up through its pinned staging buffer: one asynchronous copy per field; `fill`
        then overwrites its rows of the device input_ids."""
        self._check(batch, kv_cache)
        xp = self.xp
        if batch.input_ids.shape[0] == 0:
            return xp.zeros((0, self.config.vocab_size), np.float32)  # (L, vocab): an empty step
        self.ensure_rope(int(batch.positions.max()))
        if xp is np:
            device_batch = DeviceBatch(**{f.name: getattr(batch, f.name)
                                          for f in fields(DeviceBatch)})
        else:
            if self.staging is None:
                self.staging = HostStaging(CupyStaging())
            staging = self.staging
            device_batch = DeviceBatch(**{f.name: staging.upload(f.name, getattr(batch, f.name))
                                          for f in fields(DeviceBatch)})
            staging.end_step()
        if fill is not None:
            fill.apply(device_batch.input_ids)
        logits = self.run(device_batch, kv_cache)  # (L, vocab)
        return xp.ascontiguousarray(logits, dtype=xp.float32)

    def ensure_rope(self, max_position: int) -> None:
        """Grow the rope tables to cover max_position (before a step, or a graph capture)."""
        self._rope_tables(max_position)

    def run(self, batch: DeviceBatch, kv_cache: KVCache) -> Any:
        """The step on device arrays: (L, vocab) logits on the device. Reads nothing back to the
        host and allocates only through xp, so a CUDA graph can capture it; the rope tables must
        already cover every position (ensure_rope)."""
        c, xp = self.config, self.xp
        cos, sin = self._cos, self._sin
        positions, slot_mapping = batch.positions, batch.slot_mapping
        num_tokens = batch.input_ids.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = _embed(self.embed, batch.input_ids)  # (T, hidden) residual stream
        if self.fused is not None and self.fused.takes(num_tokens, kv_cache):
            h = np.ascontiguousarray(h, dtype=np.float32)
            self.fused.run(h, batch, kv_cache, cos, sin)  # every layer, in place
            h = kernels.rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)
            return _linear(h, self.lm_head)  # (L, vocab)
        for layer_id, layer in enumerate(self.layers):
            k_cache, v_cache, k_scale, v_scale = kv_cache.layer(layer_id)
            x = kernels.rms_norm(h, layer.input_norm, c.rms_norm_eps)
            # contiguous: q/k/v below are views with dense (H, D) per token, as rope wants
            qkv = xp.ascontiguousarray(_linear(x, layer.qkv))  # (T, (H + 2 Hkv) D)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            qk = qkv[:, :q_dim + kv_dim].reshape(num_tokens, c.num_heads + c.num_kv_heads,
                                                 c.head_dim)  # (T, H + Hkv, D)
            if layer.q_norm is not None:
                qk = self._qk_norm(qk, layer)
            # q and k rotated in one call: (T, H + Hkv, D), then views of it
            qk = kernels.rope(qk, positions, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_dim + kv_dim:].reshape(num_tokens, c.num_kv_heads, c.head_dim)
            if kernels.uses_cuda_kernels(qk):  # the CUDA kernels want dense q, k and v
                q, k, v = xp.ascontiguousarray(q), xp.ascontiguousarray(k), xp.ascontiguousarray(v)
            kernels.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            attn = kernels.paged_attention(q, k_cache, v_cache, batch.block_tables,
                                           batch.context_lens, batch.query_start_loc, self.scale,
                                           c.sliding_window, k_scale, v_scale)  # (T, H, D)
            out = _linear(attn.reshape(num_tokens, q_dim), layer.o)  # (T, hidden)
            if layer.o_bias is not None:
                out += layer.o_bias
            h += out
            x = kernels.rms_norm(h, layer.post_norm, c.rms_norm_eps)
            h += _linear(kernels.silu_and_mul(_linear(x, layer.gate_up)), layer.down)
        h = kernels.rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)
        return _linear(h, self.lm_head)  # (L, vocab)


    def _qk_norm(self, qk: Any, layer: LayerWeights) -> Any:
        """Qwen3's RMSNorm over each q and k head, as (rows, D) blocks with one weight each."""
        c = self.config
        num_tokens = qk.shape[0]
        q = kernels.rms_norm(qk[:, :c.num_heads].reshape(-1, c.head_dim), layer.q_norm,
                             c.rms_norm_eps)  # (T H, D)
        k = kernels.rms_norm(qk[:, c.num_heads:].reshape(-1, c.head_dim), layer.k_norm,
                             c.rms_norm_eps)  # (T Hkv, D)
        return self.xp.concatenate((q.reshape(num_tokens, c.num_heads, c.head_dim),
                                    k.reshape(num_tokens, c.num_kv_heads, c.head_dim)), axis=1)


def _fuse(parts: list[Any]) -> Any:
    """Weights stacked by rows (one GEMM for q/k/v, one for gate/up), float or quantized;
    quantized parts of different formats (a GGUF mixing Q4_1 and Q8_0) stay a tuple, one
    product each."""
    if not isinstance(parts[0], QuantizedWeight):
        return np.concatenate(parts)
    if len({p.format for p in parts}) > 1:
        return tuple(parts)
    return quant.concat_rows(parts)


def _embed(embed: Any, input_ids: Any) -> Any:
    """(T, hidden) float32 rows of the embedding (dequantized rows of a quantized one)."""
    if isinstance(embed, QuantizedWeight):
        return quant.dequantize_rows(embed, input_ids)
    return embed[input_ids]


def _linear(x: Any, weight: Any) -> Any:
    """x (T, in) @ weight (out, in).T -> (T, out). On the CPU the compiled float32 matmul
    (jit.matmul: one reduction order per output element whatever T is, so a row's result
    never depends on the batch) or the integer kernels of a quantized weight (kernels.quant,
    the same promise); OpenBLAS only where numba is off; cuBLAS on the GPU."""
    if isinstance(weight, QuantizedWeight):
        return quant.linear(x, weight)
    if isinstance(weight, tuple):
        return np.concatenate([quant.linear(x, part) for part in weight], axis=1)
    out = jit.matmul(x, weight) if isinstance(x, np.ndarray) else None
    return x @ weight.T if out is None else out
