"""Speculative decoding: n-gram and suffix drafts, verified by the target model in one step."""

from kvcore.config_speculative import SpeculativeConfig, SpeculativeConfigError
from kvcore.speculation.speculator import (
    SpecDecodeStats,
    Speculator,
    draft_rows,
)

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "SpeculativeConfigError", "Speculator",
           "draft_rows"]
