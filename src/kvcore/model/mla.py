"""Multi-head latent attention (DeepSeek-V2/V3) on the CPU over the paged latent cache.

Per token the cache holds one row of kv_lora_rank + qk_rope_head_dim: the normalized latent c and
the rotated rope key k_r, shared by every head. Head h's key is [W_UK_h c, k_r] and its value
W_UV_h c. Absorbed form (decode, short chunks): q_nope_h W_UK_h moves the query into latent space,
so the scores are [q_nope_h W_UK_h, q_r_h] . [c, k_r], an MQA over the cache whose single
"KV head" is the cached row itself, and the latent-space output goes through W_UV_h afterwards.
Decompressed form (long prefill chunks): c W_UK and c W_UV per head for the sequence's tokens,
then ordinary causal attention; cheaper once a chunk has many queries per key (see _prefers).

The absorbed form is written against the arrays' module (NumPy or CuPy): on the GPU it runs the
tensor-core kernel mla_attention.cu for decode rows and prefill chunks alike (mode "absorbed");
the decompressed form is the CPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore import kernels
from kvcore.config_deepseek import MLAConfig
from kvcore.device import array_module
from kvcore.kernels.cpu import mla as mla_kernels

MLA_MODES = ("auto", "absorbed", "decompressed")


@dataclass(slots=True)
class MLAWeights:
    """One MLA layer; the rope rows are stored de-interleaved when the checkpoint interleaves
    them, so rotate-half rope applies (the permutation is the same for q and k: equal scores)."""

    x_proj: Any  # (q_a or H Dqk, + W, hidden): the query input and kv_a in one GEMM
    q_a_norm: Any | None  # (q_lora_rank,); None without q_lora (q straight from x_proj)
    q_b: Any | None  # (H Dqk, q_lora_rank)
    kv_a_norm: Any  # (kv_lora_rank,)
    w_uk: Any  # (H, Dn, r): latent -> per-head key part
    w_uv_t: Any  # (H, r, Dv): latent -> per-head value, transposed for the output GEMM
    kv_b: Any | None  # (H (Dn + Dv), r): the decompression GEMM (None: absorbed form only)
    o: Any  # (hidden, H Dv)


def interleaved_to_halves(dim: int) -> np.ndarray:
    """Row order that turns rope pairs (2i, 2i + 1) into halves (i, i + dim/2)."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def _float32(array: np.ndarray) -> Any:
    return np.ascontiguousarray(array, dtype=np.float32)


def mla_weights(w: dict[str, np.ndarray], prefix: str, mla: MLAConfig, num_heads: int,
                put: Callable[[np.ndarray], Any] = _float32,
                decompress: bool = True) -> MLAWeights:
    """MLAWeights of layer `prefix` from HF tensors; `put` stores each one (default: float32
    NumPy; the GPU model: fp16 on the device). decompress=False leaves out kv_b (the absorbed
    form reads the same numbers as w_uk and w_uv_t)."""
    a = prefix + "self_attn."
    r, dn, dr, dv = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    order = interleaved_to_halves(dr) if mla.rope_interleave else np.arange(dr)
    head_rows = np.concatenate([np.arange(dn), dn + order])  # one head's output rows
    q_rows = (np.arange(num_heads)[:, None] * (dn + dr) + head_rows).reshape(-1)
    kv_a = w[a + "kv_a_proj_with_mqa.weight"][np.concatenate([np.arange(r), r + order])]
    if mla.q_lora_rank is None:
        q_in, q_a_norm, q_b = w[a + "q_proj.weight"][q_rows], None, None
    else:
        q_in, q_a_norm = w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"]
        q_b = put(w[a + "q_b_proj.weight"][q_rows])
    kv_b = np.ascontiguousarray(w[a + "kv_b_proj.weight"], dtype=np.float32)
    per_head = kv_b.reshape(num_heads, dn + dv, r)
    return MLAWeights(
        x_proj=put(np.concatenate([q_in, kv_a])),
        q_a_norm=None if q_a_norm is None else put(np.array(q_a_norm, dtype=np.float32)),
        q_b=q_b,
        kv_a_norm=put(np.array(w[a + "kv_a_layernorm.weight"], dtype=np.float32)),
        w_uk=put(per_head[:, :dn]),
        w_uv_t=put(per_head[:, dn:].transpose(0, 2, 1)),
        kv_b=put(kv_b) if decompress else None,
        o=put(w[a + "o_proj.weight"]),
    )


@dataclass(frozen=True, slots=True)
class MLAStep:
    """What one layer's attention needs of the step: the batch arrays on the model's device,
    and the host-side choice of form per sequence."""

    positions: Any  # (T,)
    slot_mapping: Any  # (T,)
    block_tables: Any  # (S, max_blocks)
    context_lens: Any  # (S,)
    query_start_loc: Any  # (S+1,)
    decompressed: np.ndarray  # (S,) bool, host: this sequence attends in the decompressed form


def plan_step(positions: Any, slot_mapping: Any, block_tables: Any, context_lens: Any,
              query_start_loc: Any, mla: MLAConfig, mode: str) -> MLAStep:
    """Choose the form of each sequence once per step (every layer has the same shape). Only
    "auto" reads the batch's values (host arrays); a fixed mode reads nothing back."""
    if mode not in MLA_MODES:
        raise ValueError(f"mla mode must be one of {MLA_MODES}, got {mode!r}")
    if mode == "auto":
        q_lens = np.diff(query_start_loc).astype(np.int64)
        decompressed = np.array([_prefers_decompressed(int(n), int(c), mla)
                                 for n, c in zip(q_lens, context_lens, strict=True)], dtype=bool)
    else:
        decompressed = np.full(context_lens.shape, mode == "decompressed")  # (S,)
    return MLAStep(positions, slot_mapping, block_tables, context_lens, query_start_loc,
                   decompressed)


def _prefers_decompressed(q_len: int, context: int, mla: MLAConfig) -> bool:
    """Multiply-adds per head of the two forms for q_len queries over context keys: absorbed
    pays the latent width (r + Dr) twice per query and key (scores, and V = the cached row) plus
    the per-query absorption; decompressed pays kv_b per key, then head-sized attention."""
    r, dn, dr, dv = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    absorbed = q_len * (dn * r + r * dv) + 2 * q_len * context * (r + dr)
    decompressed = context * r * (dn + dv) + q_len * context * (dn + dr + dv)
    return decompressed < absorbed


def mla_attention(x: Any, w: MLAWeights, step: MLAStep, cache: Any, cache_scale: float,
                  cos: Any, sin: Any, mla: MLAConfig, num_heads: int, eps: float,
                  scale: float) -> Any:
    """(T, hidden) normalized input -> (T, hidden) attention output; writes the step's cache
    rows first, so each query reads its own token back from the cache like every other key."""
    xp = array_module(x)
    # the CUDA kernels want dense rows: column slices of the fused projection are copied
    dense = xp.ascontiguousarray if kernels.uses_cuda_kernels(x) else (lambda a: a)
    num_tokens = x.shape[0]
    r, dn, dr = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    proj = x @ w.x_proj.T  # (T, q_in + r + Dr)
    q_in = proj.shape[1] - r - dr
    if w.q_b is not None and w.q_a_norm is not None:
        q = kernels.rms_norm(dense(proj[:, :q_in]), w.q_a_norm, eps) @ w.q_b.T  # (T, H Dqk)
    else:
        q = proj[:, :q_in]
    q = q.reshape(num_tokens, num_heads, dn + dr)
    latent = kernels.rms_norm(dense(proj[:, q_in:q_in + r]), w.kv_a_norm, eps)  # (T, r)
    # every head's rope query and the shared rope key rotated in one call: (T, H + 1, Dr)
    rope_in = xp.concatenate((q[:, :, dn:], proj[:, None, q_in + r:]), axis=1)
    rotated = kernels.rope(rope_in, step.positions, cos, sin)
    q_rope, k_rope = rotated[:, :num_heads], rotated[:, num_heads]
    entries = xp.concatenate((latent, k_rope), axis=1)[:, None]  # (T, 1, r + Dr)
    kernels.cache_latent(entries, cache, step.slot_mapping, cache_scale)
    q_nope = q[:, :, :dn]
    out = xp.empty((num_tokens, num_heads, mla.v_head_dim), x.dtype)  # (T, H, Dv)
    absorbed = np.flatnonzero(~step.decompressed)
    if absorbed.size:
        _absorbed(q_nope, q_rope, w, step, absorbed, cache, cache_scale, scale, r, out)
    for s in np.flatnonzero(step.decompressed):
        if w.kv_b is None:
            raise ValueError("these MLA weights hold no kv_b (absorbed form only): the "
                             "decompressed form cannot run")
        q0, q1 = int(step.query_start_loc[s]), int(step.query_start_loc[s + 1])
        latents = mla_kernels.read_latents(cache, step.block_tables[s],
                                           int(step.context_lens[s]), cache_scale)  # (N, W)
        kv = (latents[:, :r] @ w.kv_b.T).reshape(-1, num_heads, dn + mla.v_head_dim)
        out[q0:q1] = mla_kernels.causal_attention(q_nope[q0:q1], q_rope[q0:q1], kv[:, :, :dn],
                                                  latents[:, r:], kv[:, :, dn:], scale)
    return out.reshape(num_tokens, -1) @ w.o.T


def _absorbed(q_nope: Any, q_rope: Any, w: MLAWeights, step: MLAStep, seqs: np.ndarray,
              cache: Any, cache_scale: float, scale: float, r: int, out: Any) -> None:
    """The absorbed form for sequences `seqs`: attention of [q_nope W_UK, q_rope] over the
    cached rows (K = V = the row; the value's rope columns dropped), then W_UV per head."""
    xp = array_module(q_nope)
    qsl = step.query_start_loc
    if seqs.size == step.decompressed.size:  # every sequence: the batch arrays as they are
        rows: Any = slice(None)
        query_start_loc, block_tables, context_lens = qsl, step.block_tables, step.context_lens
    else:  # a subset (CPU, host arrays)
        rows = np.concatenate([np.arange(qsl[s], qsl[s + 1]) for s in seqs])
        query_start_loc = np.zeros(seqs.size + 1, dtype=qsl.dtype)
        np.cumsum(np.diff(qsl)[seqs], out=query_start_loc[1:])
        block_tables, context_lens = step.block_tables[seqs], step.context_lens[seqs]
    q_nope_h = xp.ascontiguousarray(q_nope[rows].transpose(1, 0, 2))  # (H, t, Dn)
    q_latent = q_nope_h @ w.w_uk  # (H, t, r)
    query = xp.concatenate((q_latent.transpose(1, 0, 2), q_rope[rows]), axis=2)  # (t, H, r + Dr)
    attn = kernels.mla_paged_attention(query, cache, block_tables, context_lens,
                                       query_start_loc, r, scale, cache_scale)  # (t, H, r)
    latent_out = xp.ascontiguousarray(attn.transpose(1, 0, 2))  # (H, t, r)
    out[rows] = (latent_out @ w.w_uv_t).transpose(1, 0, 2)  # (t, H, Dv)
