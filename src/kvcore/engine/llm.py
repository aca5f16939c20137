"""LLM: the offline API, a batch of prompts in, their finished outputs out (in order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.config_speculative import SpeculativeConfig
from kvcore.config_tiers import TierConfig
from kvcore.engine.engine import Engine
from kvcore.model.hub import resolve_model
from kvcore.planner import parse_size
from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling import BeamSearchParams, SamplingParams

Prompt = str | Sequence[int]

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_TIER_FIELDS = {f.name for f in dataclasses.fields(TierConfig)}  # kv_offload_size=, kv_tier_dir=
_ENGINE_FIELDS = {"device", "seed", "enforce_eager", "async_scheduling", "quantization"}


def engine_config(model: str, speculative_config: SpeculativeConfig | dict[str, Any] | str
                  | None = None, **engine_args: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments (block_size=..., max_num_seqs=..., seed=...);
    `speculative_config`: vLLM's shape ({"method": "ngram", "num_speculative_tokens": 4, ...},
    or its JSON text), see SpeculativeConfig."""
    known = _CACHE_FIELDS | _SCHEDULER_FIELDS | _ENGINE_FIELDS | _TIER_FIELDS
    unknown = set(engine_args) - known
    if unknown:
        raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; known: "
                         f"{sorted(known)}")

    def pick(names: set[str]) -> dict[str, Any]:
        return {k: v for k, v in engine_args.items() if k in names}

    for size in ("kv_offload_size", "kv_tier_disk_size"):  # "8GiB" as the CLI takes it
        if isinstance(engine_args.get(size), str):
            engine_args[size] = parse_size(engine_args[size])

    return EngineConfig(model=model, cache=CacheConfig(**pick(_CACHE_FIELDS)),
                        scheduler=SchedulerConfig(**pick(_SCHEDULER_FIELDS)),
                        speculative=SpeculativeConfig.parse(speculative_config),
                        tiers=TierConfig(**pick(_TIER_FIELDS)), **pick(_ENGINE_FIELDS))


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))`; model None: the default model;
    `LLM(model, speculative_config={"method": "ngram", ...})`: speculative decoding."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = Engine(engine_config(str(resolve_model(model)), **engine_args))
        self._counter = 0

    def close(self) -> None:
        """Let the KV tiers' queued writes land (also done at interpreter exit)."""
        self.engine.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(batch)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(batch):
                raise ValueError(f"params has {len(per_prompt)} entries for {len(batch)} prompts")
        return self._run(batch, per_prompt)

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        return self._run(batch, [params] * len(batch))

    def _run(self, batch: list[Prompt],
             params: Sequence[SamplingParams | BeamSearchParams]) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                self._counter += 1
                request_id = f"llm-{self._counter}"
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids}
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    outputs[output.request_id].append(output)
            return [merge_outputs(outputs[i]) for i in ids]
        finally:
            for request_id in ids:  # an error half-way must not leave requests behind
                self.engine.abort_request(request_id)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt of token ids
    return items  # type: ignore[return-value]
