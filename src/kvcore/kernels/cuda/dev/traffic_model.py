"""The attention kernels' traffic model on an H200: four floors side by side, from what the
compiler reports for one pass through each kernel's key-tile loop (compile_check).

For a workload the model counts block-tiles (one block, one key tile) and multiplies what one
warp spends per tile (PTX instructions, mma.sync, shared-memory pipe slots: ptx_facts) by the
warps of a block, and what a tile moves from HBM by the block-tiles. The floors, each the time
if that resource alone were the limit:
- HBM: bytes / 4.3 TB/s (the device-to-device copy rate the benchmarks measure against);
- tensor: mma.sync m16n8k16 issued (padding rows included) x 4,096 FLOP / 989 TFLOP/s (the
  H200's dense fp16 peak; the legacy mma.sync path reaches about 2/3 of it on sm_90, which the
  estimate column applies);
- shared pipe: slots (128-byte wavefronts) / (132 SMs x 1 per clock x 1.98 GHz);
- issue: warp instructions / (132 SMs x 4 schedulers x 1.98 GHz), PTX counted as SASS.
The estimate is the largest floor (the others overlapped under it: double-buffered cp.async,
several warps per SM) with the tensor floor at the mma.sync rate. Static counts take both sides
of every branch, so the instruction and slot floors are upper bounds.

`python -m kvcore.kernels.cuda.dev.traffic_model` compiles the variants (NVRTC, sm_90) and prints
the tables of docs/gpu-performance.md (`--json`: the numbers).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

SMS = 132
CLOCK_HZ = 1.98e9
HBM_BYTES_PER_S = 4.3e12
DENSE_FP16_FLOPS = 989e12
MMA_SYNC_SHARE = 2 / 3  # of the dense peak that mma.sync sustains on sm_90 (assumed)
MMA_FLOP = 2 * 16 * 8 * 16
FA2_TFLOPS = 330.0  # FlashAttention-2 forward, head_dim 128 on an H100 (its published rates)
FLASHMLA_TFLOPS = (580.0, 660.0)  # FlashMLA decode on an H800 / H100 (its published range)


@dataclass(frozen=True, slots=True)
class TileCost:
    """One pass through a kernel variant's key-tile loop: per warp, and per block."""

    name: str
    warps: int
    instructions: int  # per warp
    mma: int  # per warp
    slots: int  # shared-memory pipe slots per warp
    global_bytes: int  # HBM bytes the block's tile moves
    registers: int
    smem_bytes: int


@dataclass(frozen=True, slots=True)
class Estimate:
    workload: str
    kernel: str
    block_tiles: int
    hbm_us: float
    tensor_us: float
    smem_us: float
    issue_us: float
    estimate_us: float
    bound: str
    useful_tflops: float


def estimate(workload: str, cost: TileCost, block_tiles: int, hbm_bytes: float,
             useful_flop: float) -> Estimate:
    warp_tiles = block_tiles * cost.warps
    hbm = hbm_bytes / HBM_BYTES_PER_S
    tensor = warp_tiles * cost.mma * MMA_FLOP / DENSE_FP16_FLOPS
    smem = warp_tiles * cost.slots / (SMS * CLOCK_HZ)
    issue = warp_tiles * cost.instructions / (SMS * 4 * CLOCK_HZ)
    floors = {"HBM": hbm, "tensor": tensor / MMA_SYNC_SHARE, "shared pipe": smem,
              "issue": issue}
    bound = max(floors, key=lambda k: floors[k])
    total = floors[bound]
    return Estimate(workload, cost.name, block_tiles, hbm * 1e6, tensor * 1e6, smem * 1e6,
                    issue * 1e6, total * 1e6, bound, useful_flop / total / 1e12)


def decode_workload(cost: TileCost, batch: int, context: int, heads: int = 32,
                    kv_heads: int = 8, head_dim: int = 128) -> Estimate:
    """GQA decode: a block per (sequence, KV head, partition), 64-key tiles; partials of 512-token
    partitions written and read once (fp32 output + max + sum per head)."""
    tiles = -(-context // 64)
    parts = min(32, -(-context // 512))
    partials = batch * heads * parts * (head_dim + 2) * 4 * 2 if parts > 1 else 0
    flop = 4.0 * batch * context * heads * head_dim
    block_tiles = batch * kv_heads * tiles
    return estimate(f"decode b{batch} x {context // 1024}k", cost, block_tiles,
                    block_tiles * cost.global_bytes + partials, flop)


def prefill_workload(cost: TileCost, length: int, heads: int = 32, kv_heads: int = 8,
                     head_dim: int = 128) -> Estimate:
    """Causal prefill of one prompt: 128-row query tiles (128 / G positions), each against the
    64-key tiles up to its last position. HBM: Q, O and the K/V tiles once (the K/V of one
    prompt, 16 MB at 4k, stay in the 50 MB L2 for the query tiles that reread them)."""
    positions = 128 // (heads // kv_heads)
    q_tiles = -(-length // positions)
    tiles = sum(-(-min(length, (i + 1) * positions) // 64) for i in range(q_tiles))
    flop = 2.0 * 2 * heads * head_dim * length * length / 2  # QK and PV, causal half
    kv_bytes = kv_heads * -(-length // 64) * cost.global_bytes
    qo_bytes = 2 * length * heads * head_dim * 2
    return estimate(f"prefill {length // 1024}k causal", cost, kv_heads * tiles,
                    kv_bytes + qo_bytes, flop)


def mla_workload(cost: TileCost, batch: int, context: int, heads: int = 128,
                 rank: int = 512, rope: int = 64, keys: int = 64) -> Estimate:
    """MLA decode (absorbed): a block per (sequence, 64 heads), one partition (large batch)."""
    row_tiles = -(-heads // 64)
    tiles = -(-context // keys)
    flop = 2.0 * batch * heads * context * (rank + rope + rank)
    # the two row tiles of a sequence run side by side: the second reads the tile from L2
    return estimate(f"MLA b{batch} x {context // 1024}k", cost, batch * row_tiles * tiles,
                    batch * tiles * cost.global_bytes, flop)


# (name, source, defines, warps, global bytes per tile, trips of the loop inside the tile loop:
# MLA's S loop runs 36 16-column steps two at a time, unrolled 3 times: 6): the variants the
# tables use; int4 decode compiled with KVC_INT4_PROBE_SEALED, the common tile (every block
# sealed: a sequence has at most its last block or two in the fp16 window). Int4 prefill is not
# modelled: its tile loop keeps rolled loops (the per-tile unpack, P V in passes) whose trips
# the static counts do not see.
VARIANTS = (
    ("decode fp16", "paged_attention_decode_tc.cu",
     ("KVC_HEAD_DIM=128", "KVC_GROUP=4", "KVC_SCALAR=__half", "KVC_CACHE=__half"), 4, 32768, 1),
    ("decode int4", "paged_attention_decode_tc.cu",
     ("KVC_HEAD_DIM=128", "KVC_GROUP=4", "KVC_SCALAR=__half", "KVC_INT4", "KVC_INT4_GROUP=32",
      "KVC_INT4_PROBE_SEALED"), 4, 11264, 1),
    ("prefill fp16", "paged_attention_prefill_mma.cu",
     ("KVC_HEAD_DIM=128", "KVC_SCALAR=__half", "KVC_CACHE=__half"), 8, 32768, 1),
    ("MLA fp16", "mla_attention.cu",
     ("KVC_LORA_RANK=512", "KVC_ROPE_DIM=64", "KVC_SCALAR=__half", "KVC_CACHE=__half",
      "KVC_MLA_KEYS=64"), 8, 73728, 6),
    ("MLA fp8", "mla_attention.cu",
     ("KVC_LORA_RANK=512", "KVC_ROPE_DIM=64", "KVC_SCALAR=__half",
      "KVC_CACHE=__nv_fp8_e4m3", "KVC_MLA_KEYS=64"), 8, 36864, 1),
)
_ENTRY = {"paged_attention_decode_tc.cu": "paged_attention_decode_tc",
          "paged_attention_prefill_mma.cu": "paged_attention_prefill_mma",
          "mla_attention.cu": "mla_paged_attention"}


def tile_costs() -> dict[str, TileCost]:
    """Compile the variants for sm_90 and read their tile loops."""
    from kvcore.kernels.cuda.dev.compile_check import compile_source
    from kvcore.kernels.cuda.nvrtc import KERNEL_DIR

    out: dict[str, TileCost] = {}
    for name, source, defines, warps, global_bytes, trips in VARIANTS:
        r = next(r for r in compile_source(KERNEL_DIR / source, "90", defines)
                 if r.kernel == _ENTRY[source])
        extra = trips - 1  # the inner loop's body is in the tile loop's counts once
        out[name] = TileCost(name, warps, r.tile_instructions + extra * r.inner_instructions,
                             r.tile_mma + extra * r.inner_mma,
                             r.tile_smem_slots + extra * r.inner_smem_slots, global_bytes,
                             r.registers, r.static_smem)
    return out


def estimates(costs: dict[str, TileCost]) -> list[Estimate]:
    return [decode_workload(costs["decode fp16"], 64, 4096),
            decode_workload(costs["decode int4"], 64, 4096),
            decode_workload(costs["decode fp16"], 1, 16384),
            decode_workload(costs["decode int4"], 1, 16384),
            prefill_workload(costs["prefill fp16"], 4096),
            mla_workload(costs["MLA fp16"], 64, 4096),
            mla_workload(costs["MLA fp8"], 64, 4096)]


def markdown(costs: dict[str, TileCost], rows: list[Estimate]) -> str:
    lines = ["| kernel (sm_90) | warps | instructions / warp / tile | mma.sync / warp / tile | "
             "shared slots / warp / tile | HBM bytes / tile |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in costs.values():
        lines.append(f"| {c.name} | {c.warps} | {c.instructions:,} | {c.mma} | {c.slots} | "
                     f"{c.global_bytes:,} |")
    lines += ["", "| workload | kernel | HBM floor | tensor floor (989) | shared-pipe floor | "
              "issue floor | estimate | bound | TFLOP/s |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for e in rows:
        lines.append(f"| {e.workload} | {e.kernel} | {e.hbm_us:.1f} us | {e.tensor_us:.1f} us | "
                     f"{e.smem_us:.1f} us | {e.issue_us:.1f} us | {e.estimate_us:.1f} us | "
                     f"{e.bound} | {e.useful_tflops:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="the numbers as JSON")
    args = parser.parse_args(argv)
    costs = tile_costs()
    rows = estimates(costs)
    if args.json:
        print(json.dumps({"costs": [asdict(c) for c in costs.values()],
                          "estimates": [asdict(e) for e in rows]}, indent=1))
    else:
        print(markdown(costs, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
