"""The kernel variants compile_check builds: each .cu source once, the decode kernels per
(head_dim, GQA group, activation/cache dtype), the register-tile kernels' int4 variants, the MLA
kernel per latent shape and the key-tile size each arch gets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcore.kernels.cuda.nvrtc import KERNEL_DIR

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "fp8": 1}
INT4 = "int4"  # the cache "dtype" of the int4 variants (KVC_INT4, register-tile kernels only)
INT4_CHECK_GROUP = 32  # value channels per scale the int4 variants compile for
TC_GROUP = 4  # a GQA group the prefill variants are checked at (they compile for any)
ARCHS = ("80", "90")
# decode variants compiled by the check: the head_dims and groups of common models
CHECK_HEAD_DIMS = (64, 128, 256)
CHECK_GROUPS = (1, 2, 3, 4, 8, 16, 32)
CHECK_DTYPES = (("f16", "f16"), ("bf16", "bf16"), ("f16", "fp8"), ("f32", "f32"),
                ("f16", INT4))
# MLA variants: (kv_lora_rank, qk_rope_head_dim) of DeepSeek-V2, V2-Lite and V3 (all 512 + 64)
CHECK_MLA_SHAPES = ((512, 64),)
SMEM_OPT_IN = {"80": 163 * 1024, "90": 227 * 1024}  # most shared memory a block may opt in to


@dataclass(frozen=True, slots=True)
class Variant:
    source: str
    defines: tuple[str, ...] = ()
    group: int = 0  # decode: the GQA group the variant serves (its register budget depends on it)
    dynamic_smem: int = 0
    tile_global_bytes: int = 0  # register-tile kernels: K + V bytes of one key tile
    archs: tuple[str, ...] = ARCHS  # the archs the variant is built for (MLA: per tile size)


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


def variants(head_dims: tuple[int, ...] = CHECK_HEAD_DIMS, groups: tuple[int, ...] = CHECK_GROUPS,
             dtypes: tuple[tuple[str, str], ...] = CHECK_DTYPES,
             mla_shapes: tuple[tuple[int, int], ...] = CHECK_MLA_SHAPES) -> list[Variant]:
    """Every source once, the decode kernel once per (head_dim, group, dtypes) asked for, the
    tensor-core prefill once per (head_dim, dtypes) and the MLA kernel once per (latent shape,
    dtypes) (both 16-bit activations only)."""
    from kvcore.kernels.cuda.attention import (
        DECODE_TC_KEYS,
        decode_defines,
        decode_smem_bytes,
        decode_tc_smem_bytes,
        prefill_mma_smem_bytes,
        prefill_tc_defines,
        prefill_tc_smem_bytes,
    )
    from kvcore.kernels.cuda.variants import AttentionShape, sources_for

    def served(source: str, d: int, g: int, act: str, cache: str) -> bool:
        """Whether the planners' table picks `source` at (d, g, dtypes), block size 16."""
        return source in sources_for(AttentionShape(act, cache, g, d, 16))

    asked, dtypes = dtypes, tuple((act, cache) for act, cache in dtypes if cache != INT4)
    out: list[Variant] = []
    for path in kernel_sources():
        if path.name == "paged_attention_decode.cu":
            # every group: the module also holds paged_attention_reduce, which every decode
            # kernel's split-KV merge launches with its (head_dim, group, dtypes)
            out += [Variant(path.name, decode_defines(d, g, act, cache), g,
                            decode_smem_bytes(g, d))
                    for d in head_dims for g in groups for act, cache in dtypes]
        elif path.name == "paged_attention_decode_tc.cu":
            out += [Variant(path.name, decode_defines(d, g, act, cache), g,
                            decode_tc_smem_bytes(d, _ITEMSIZE[cache]),
                            2 * DECODE_TC_KEYS * d * _ITEMSIZE[cache])
                    for d in head_dims for g in groups for act, cache in dtypes
                    if served(path.name, d, g, act, cache)]
            out += int4_variants(path.name, head_dims, groups, asked)
        elif path.name == "paged_attention_prefill_mma.cu":
            out += [Variant(path.name, prefill_tc_defines(d, act, cache), 0,
                            prefill_mma_smem_bytes(d, _ITEMSIZE[cache]),
                            2 * DECODE_TC_KEYS * d * _ITEMSIZE[cache])
                    for d in head_dims for act, cache in dtypes
                    if served(path.name, d, TC_GROUP, act, cache)]
            out += int4_variants(path.name, head_dims, groups, asked)
        elif path.name == "paged_attention_prefill_tc.cu":
            out += [Variant(path.name, prefill_tc_defines(d, act, cache), 0,
                            prefill_tc_smem_bytes(d))
                    for d in head_dims for act, cache in dtypes if act != "f32"]
        elif path.name == "mla_attention.cu":
            for r, dr in mla_shapes:
                for act, cache in dtypes:
                    if act != "f32":
                        out += _mla_variants(path.name, r, dr, act, cache)
        else:
            out.append(Variant(path.name))
    return out


def _mla_variants(source: str, rank: int, rope: int, act: str, cache: str) -> list[Variant]:
    """One MLA variant per key-tile size the launcher picks on the checked archs (64 keys on
    sm_90, 32 on sm_80 at DeepSeek's shape with a 16-bit cache), each built for its archs."""
    from kvcore.kernels.cuda.mla import mla_defines, mla_key_tile, mla_smem_bytes

    width, itemsize = rank + rope, _ITEMSIZE[cache]
    by_keys: dict[int, tuple[str, ...]] = {}
    for arch in ARCHS:
        keys = mla_key_tile(width, itemsize, SMEM_OPT_IN[arch])
        by_keys[keys] = (*by_keys.get(keys, ()), arch)
    return [Variant(source, mla_defines(rank, rope, act, cache, keys), 0,
                    mla_smem_bytes(rank, rope, itemsize, keys), keys * width * itemsize, archs)
            for keys, archs in by_keys.items()]


def int4_variants(source: str, head_dims: tuple[int, ...], groups: tuple[int, ...],
                  dtypes: tuple[tuple[str, str], ...]) -> list[Variant]:
    """The KVC_INT4 variants of a register-tile kernel for the activations paired with "int4"
    in `dtypes`: decode per (head_dim, group) (an int4 cache takes it for every group), prefill
    per head_dim."""
    from kvcore.kernels.cuda.attention_kv_int4 import (
        INT4_HEAD_DIMS,
        int4_decode_smem_bytes,
        int4_defines,
        int4_tile_global_bytes,
        int4_tiles_bytes,
    )

    acts = [act for act, cache in dtypes if cache == INT4 and act != "f32"]
    dims, grp = [d for d in head_dims if d in INT4_HEAD_DIMS], INT4_CHECK_GROUP
    if source == "paged_attention_decode_tc.cu":
        return [Variant(source, int4_defines(d, act, grp, g), g, int4_decode_smem_bytes(d, grp),
                        int4_tile_global_bytes(d, grp))
                for d in dims for g in groups for act in acts]
    return [Variant(source, int4_defines(d, act, grp, None), 0, int4_tiles_bytes(d, grp),
                    int4_tile_global_bytes(d, grp)) for d in dims for act in acts]
