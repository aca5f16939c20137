"""RoPE scaling as config.json states it (linear, llama3, yarn): the record and YaRN's magnitude
correction. Parsed and checked by kvcore.config."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # "linear", "llama3" or "yarn"
    factor: float
    # llama3 only: the wavelength band that is interpolated smoothly
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only: the rotation band blended between extrapolation and interpolation, and the
    # magnitude corrections (DeepSeek's mscale / mscale_all_dim; attention_factor when given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        """yarn multiplies cos and sin (so q.k of the rotated parts) by this; others by 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """DeepSeek's extra softmax scale: mscale(factor, mscale_all_dim) squared."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
