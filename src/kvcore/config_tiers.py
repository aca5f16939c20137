"""TierConfig: the KV tiers behind the pool (a host-memory tier, a disk tier), how pages are
written to them and how preemption uses them (EngineConfig.tiers; kvcore.engine.tier_driver
runs them)."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
PREEMPTION_MODES = ("auto", "recompute", "swap")
# the host tier's page formats: "auto" keeps the pool's own bytes (bit exact); int4 / fp8 are
# lossy compressions of an fp32 / fp16 / bf16 pool (more tokens per byte, other outputs)
OFFLOAD_DTYPES = ("auto", "int4", "fp8")
DEFAULT_DISK_SIZE = 10 * 2**30


@dataclass(frozen=True, slots=True)
class TierConfig:
    """vLLM's / SGLang's spirit: `--kv-offload-size` (the host tier's bytes, 0 = off),
    `--kv-tier-dir` / `--kv-tier-disk-size` (the disk tier), the write policy and the
    preemption mode. Every tier is off by default."""

    kv_offload_size: int = 0  # bytes of host memory for pages (0: no host tier)
    kv_offload_dtype: str = "auto"  # the host tier's page format, see OFFLOAD_DTYPES
    kv_tier_dir: str | None = None  # a directory of page files (None: no disk tier)
    kv_tier_disk_size: int = DEFAULT_DISK_SIZE  # bytes of page files at most (LRU)
    # write_back: a page is written when its block is evicted from the pool (or swapped out);
    # write_through: also as soon as the block is full and cached; write_through_selective:
    # also when the block is hit by a prefix lookup the second time
    kv_tier_write_policy: str = "write_through"
    # a preempted sequence: "swap" writes its blocks to the tiers at once and restores them
    # when that beats recomputing; "recompute" frees them; "auto": swap when a tier is on
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        for name in ("kv_offload_size", "kv_tier_disk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (bytes), got {value!r}")
        if self.kv_tier_dir is not None and (not isinstance(self.kv_tier_dir, str)
                                             or not self.kv_tier_dir):
            raise ValueError(f"kv_tier_dir must be a non-empty path or None, "
                             f"got {self.kv_tier_dir!r}")
        if self.kv_tier_dir is not None and self.kv_tier_disk_size == 0:
            raise ValueError("kv_tier_disk_size must be > 0 with a kv_tier_dir")
        for name, allowed in (("kv_offload_dtype", OFFLOAD_DTYPES),
                              ("kv_tier_write_policy", WRITE_POLICIES),
                              ("preemption_mode", PREEMPTION_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        if self.preemption_mode == "swap" and not self.enabled:
            raise ValueError("preemption_mode swap needs a tier (kv_offload_size > 0 or a "
                             "kv_tier_dir)")

    @property
    def enabled(self) -> bool:
        """Some tier is configured."""
        return self.kv_offload_size > 0 or self.kv_tier_dir is not None

    @property
    def swap(self) -> bool:
        """Preemption writes the victim's blocks to the tiers and restores them."""
        return self.enabled and self.preemption_mode != "recompute"
