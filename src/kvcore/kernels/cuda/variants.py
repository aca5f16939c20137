"""The table of paged-attention kernels and the rule that picks one: the planners
(attention.py, attention_kv_int4.py) launch what `pick` returns, and the dev compile check builds
the variants the same table selects (src/kvcore/kernels/README.md prints it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TC_DECODE_MIN_GROUP = 4  # decode groups from this size on run on tensor cores (16-bit only)
PREFILL_MMA_MAX_HEAD_DIM = 128  # larger head_dims keep paged_attention_prefill_tc.cu


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What picks a kernel: activation ("f32", "f16", "bf16"), cache ("f32", "f16", "bf16",
    "fp8", "int4"), GQA group, head_dim, block size."""

    act: str
    cache: str
    group: int
    head_dim: int
    block_size: int

    @property
    def pow2_blocks(self) -> bool:
        """Power-of-two block sizes: the register-tile kernels read the block table with
        shifts."""
        return self.block_size & (self.block_size - 1) == 0


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    source: str
    entry: str
    role: str  # "decode" (one-token rows) or "prefill" (chunks)
    serves: Callable[[AttentionShape], bool]
    why: str


def _tc(s: AttentionShape) -> bool:
    return s.act != "f32" and s.group >= TC_DECODE_MIN_GROUP


# first match wins, per role
ATTENTION_KERNELS = (
    AttentionKernel("paged_attention_decode_tc.cu", "paged_attention_decode_tc", "decode",
                    lambda s: s.cache == "int4" or (_tc(s) and s.pow2_blocks),
                    "register tiles, mma.sync + ldmatrix, cp.async double buffering"),
    AttentionKernel("paged_attention_prefill_tc.cu", "paged_attention_prefill_tc", "decode",
                    lambda s: _tc(s) and s.cache != "int4",
                    "WMMA decode mode: block sizes that are not powers of two"),
    AttentionKernel("paged_attention_decode.cu", "paged_attention_decode", "decode",
                    lambda s: s.cache != "int4",
                    "CUDA cores: fp32 activations, groups 1-3 (a 16-row tile would be padding)"),
    AttentionKernel("paged_attention_prefill_mma.cu", "paged_attention_prefill_mma", "prefill",
                    lambda s: s.act != "f32" and s.head_dim <= PREFILL_MMA_MAX_HEAD_DIM
                    and s.pow2_blocks,
                    "register tiles, 128 query rows per block"),
    AttentionKernel("paged_attention_prefill_tc.cu", "paged_attention_prefill_tc", "prefill",
                    lambda s: s.act != "f32" and s.cache != "int4",
                    "WMMA: head_dim 256 and block sizes that are not powers of two"),
    AttentionKernel("paged_attention_prefill.cu", "paged_attention_prefill", "prefill",
                    lambda s: s.act == "f32",
                    "fp32 activations (tensor cores would round them)"),
)


def pick(role: str, shape: AttentionShape) -> AttentionKernel:
    """The kernel that serves `role` rows of `shape`; ValueError when none does."""
    for kernel in ATTENTION_KERNELS:
        if kernel.role == role and kernel.serves(shape):
            return kernel
    raise ValueError(f"no {role} attention kernel serves {shape}")


def sources_for(shape: AttentionShape) -> set[str]:
    """The sources whose variants `shape` compiles (decode and prefill)."""
    out = set()
    for role in ("decode", "prefill"):
        try:
            out.add(pick(role, shape).source)
        except ValueError:
            continue
    return out
