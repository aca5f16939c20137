"""SpeculativeConfig: which proposer drafts tokens, how many, and when speculation stays off
(EngineConfig.speculative; kvcore.speculation runs it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")
# Above this many running sequences a step does not speculate. Measured on the CPU with the
# default model (docs/benchmarks.md, `## Speculative decoding`): at 8 streams ngram still gained
# (1.08x open chat, 1.77x grounded); larger batches were not measured, and as a batch becomes
# compute bound every draft row costs as much as a sequence's own token.
DEFAULT_MAX_BATCH_FOR_SPECULATION = 8
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2


class SpeculativeConfigError(ValueError):
    """A bad speculative config; `param` names the field as data (speculative_config.X)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields (method, num_speculative_tokens, prompt_lookup_max,
    prompt_lookup_min) and kvcore's own (suffix index bounds, max_batch_for_speculation)."""

    method: str = "ngram"  # "ngram" (prompt lookup) or "suffix" (suffix index, per tenant)
    num_speculative_tokens: int = 4  # drafts verified per step at most (k)
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX  # longest n-gram / suffix context matched
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # shortest match that may draft
    # suffix: a tenant's index holds its most recent outputs up to this many tokens, and at
    # most this many tenants are indexed (the least recently used one is dropped)
    suffix_max_tokens_per_tenant: int = 65536
    suffix_max_tenants: int = 64
    # a step whose running batch is larger does not speculate (verification rows cost more
    # than they save once the batch is compute bound)
    max_batch_for_speculation: int = DEFAULT_MAX_BATCH_FOR_SPECULATION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                "speculative_config.method", f"speculative_config.method must be one of "
                f"{', '.join(METHODS)}, got {self.method!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "method" and (not isinstance(value, int) or isinstance(value, bool)
                                       or value < 1):
                raise SpeculativeConfigError(
                    f"speculative_config.{f.name}",
                    f"speculative_config.{f.name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                "speculative_config.prompt_lookup_min",
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict, a SpeculativeConfig or None (off). A
        SpeculativeConfigError (a ValueError) names the field in `param`: an unknown one, or
        one out of range."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(
                    "speculative_config", f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative_config", f"speculative_config must be a "
                                         f"JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config.{unknown[0]}",
                f"speculative_config.{unknown[0]} is not a field kvcore knows (unknown: "
                f"{unknown}; known: {sorted(known)})")
        args = dict(value)
        # one bound given: the other follows it where the default would contradict it
        low, high = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
        if isinstance(low, int) and high is None:
            args["prompt_lookup_max"] = max(low, DEFAULT_LOOKUP_MAX)
        if isinstance(high, int) and low is None:
            args["prompt_lookup_min"] = min(high, DEFAULT_LOOKUP_MIN)
        return cls(**args)
