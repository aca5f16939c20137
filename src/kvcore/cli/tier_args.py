"""The KV tiers' flags, shared by `kvcore serve`, `kvcore generate` and `kvcore plan`."""

from __future__ import annotations

import argparse
from typing import Any

from kvcore.config_tiers import (
    DEFAULT_DISK_SIZE,
    OFFLOAD_DTYPES,
    PREEMPTION_MODES,
    WRITE_POLICIES,
    TierConfig,
)
from kvcore.planner import format_size, parse_size


def add_tier_arguments(parser: argparse.ArgumentParser, host: bool = True,
                       policy: bool = True) -> None:
    group = parser.add_argument_group(
        "KV tiers", "pages of the prefix cache kept behind the pool: in host memory and on "
                    "disk, restored when a prompt's prefix returns (README: KV tiers)")
    if host:
        group.add_argument("--kv-offload-size", default="0", metavar="SIZE",
                           help="host memory for KV pages, e.g. 8GiB (default 0: no host tier)")
        group.add_argument("--kv-offload-dtype", default="auto", choices=OFFLOAD_DTYPES,
                           help="the host tier's page format: auto = the pool's own bytes "
                                "(bit exact); int4 / fp8 hold 2-4x more tokens of an fp32 / "
                                "fp16 / bf16 pool, not bit exact")
    group.add_argument("--kv-tier-dir", metavar="DIR",
                       help="a directory of KV page files (a disk tier): survives restarts, "
                            "shareable by the replicas of one node (default: none)")
    group.add_argument("--kv-tier-disk-size", default=format_size(DEFAULT_DISK_SIZE),
                       metavar="SIZE", help="page files at most, least recently used out "
                       f"first (default {format_size(DEFAULT_DISK_SIZE)})")
    if policy:
        group.add_argument("--kv-tier-write-policy", default="write_through",
                           choices=WRITE_POLICIES,
                           help="write_back: pages written when the pool evicts them; "
                                "write_through (default): also once a block is full; "
                                "write_through_selective: also once a block is hit twice")
        group.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES,
                           help="swap: a preempted sequence's blocks go to the tiers and come "
                                "back when cheaper than recomputing; recompute: they are "
                                "recomputed; auto (default): swap when a tier is on")


def tier_config(args: argparse.Namespace) -> TierConfig:
    """The flags as a TierConfig (ValueError for a bad size or combination)."""
    fields: dict[str, Any] = {"kv_tier_dir": args.kv_tier_dir,
                              "kv_tier_disk_size": parse_size(args.kv_tier_disk_size)}
    if hasattr(args, "kv_offload_size"):
        fields["kv_offload_size"] = parse_size(args.kv_offload_size) if (
            args.kv_offload_size not in ("0", "")) else 0
        fields["kv_offload_dtype"] = args.kv_offload_dtype
    if hasattr(args, "kv_tier_write_policy"):
        fields["kv_tier_write_policy"] = args.kv_tier_write_policy
        fields["preemption_mode"] = args.preemption_mode
    return TierConfig(**fields)
