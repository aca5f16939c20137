"""The quality runs of `kvcore eval`: variants scored in lockstep on the same text (so the KL
divergence against the baseline needs only one chunk of the baseline's logits at a time), and
greedy generations on chat prompts, each variant through its own paged KV cache.

The text is split into windows of `context` tokens, each a fresh sequence prefilled `chunk` tokens
per step through the cache, so the cache's error accumulates over the window as it does in use. An
int4 cache is fed one block per step whatever the chunk: its window and sealing then treat every
token as a decode step would (a longer step would read its own recent tokens in fp16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.model.batch import BatchInput
from kvcore.model.int4_sim import Int4SimCache
from kvcore.model.quality import TextScore, Variant, log_softmax, next_token_stats

BLOCK_SIZE = 16


class CachedModel:
    """One variant: a model and its own KV cache of `num_blocks` blocks, run step by step."""

    def __init__(self, model: Any, variant: Variant, num_blocks: int, int4_group: int,
                 int4_window: int) -> None:
        kv_heads, width, shared = model.config.kv_layout
        self.model, self.variant = model, variant
        self.cache: KVCache
        self.max_step: int | None = None  # tokens per forward step of one sequence (None: any)
        self.int4: dict[str, Any] | None = None  # the int4 cache's settings and path
        if variant.cache_dtype == "int4":
            if shared:
                raise ValueError("the int4 KV cache needs separate K and V (not MLA's latent)")
            self.cache = Int4SimCache(model.config.num_layers, num_blocks, BLOCK_SIZE, kv_heads,
                                      width, int4_group, int4_window)
            self.max_step = BLOCK_SIZE
            self.int4 = {"group": int4_group, "window": int4_window, "path": "simulated"}
        else:
            self.cache = KVCache(model.config.num_layers, num_blocks, BLOCK_SIZE, kv_heads,
                                 width, variant.cache_dtype, shared_kv=shared)

    def step(self, token_ids: Sequence[Sequence[int]], context_lens: Sequence[int],
             block_tables: Sequence[Sequence[int]], all_logits: bool) -> np.ndarray:
        """Feed each sequence its tokens after context_lens[s] cached ones: (rows, vocab) logits
        of every new token (all_logits) or of each sequence's last."""
        batch = BatchInput.build(token_ids, context_lens, block_tables, BLOCK_SIZE)
        if all_logits:
            batch = replace(batch, logits_indices=np.arange(sum(map(len, token_ids)),
                                                            dtype=np.int64))
        new_lens = [n + len(t) for n, t in zip(context_lens, token_ids, strict=True)]
        if isinstance(self.cache, Int4SimCache):
            self.cache.before_step(block_tables, context_lens, new_lens)
        logits: np.ndarray = self.model.forward(batch, self.cache)
        if isinstance(self.cache, Int4SimCache):
            self.cache.after_step(block_tables, context_lens, new_lens)
        return logits

    def prefill(self, token_ids: Sequence[int], context_len: int, block_table: Sequence[int],
                all_logits: bool) -> np.ndarray:
        """One sequence's tokens after context_len cached ones, max_step tokens per step: the
        logits of every token (all_logits) or of the last."""
        size = self.max_step or len(token_ids)
        parts = [self.step([token_ids[i:i + size]], [context_len + i], [block_table], all_logits)
                 for i in range(0, len(token_ids), size)]
        return np.concatenate(parts) if all_logits else parts[-1]


def score_text(runs: Sequence[CachedModel], token_ids: Sequence[int], context: int, chunk: int,
               progress: Callable[[int], None] | None = None) -> list[TextScore]:
    """Score every variant on the same windows; the first is the baseline of the KL divergence.
    progress(n): n more tokens were scored by every variant."""
    if len(token_ids) < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens, got {len(token_ids)}")
    table = list(range(-(-context // BLOCK_SIZE)))
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in runs]
    for start in range(0, len(token_ids) - 1, context):
        ids = list(token_ids[start:start + context + 1])  # the window and the token after it
        for offset in range(0, len(ids) - 1, chunk):
            part = ids[offset:offset + chunk]
            targets = np.asarray(ids[offset + 1:offset + 1 + len(part)], np.int64)
            part = part[:len(targets)]  # the last token of the text predicts nothing
            base = None
            for run, out in zip(runs, parts, strict=True):
                logprobs = log_softmax(run.prefill(part, offset, table, all_logits=True))
                base = logprobs if base is None else base
                out.append(next_token_stats(logprobs, targets, base))
            if progress is not None:
                progress(len(part))
    return [TextScore(*(np.concatenate(column) for column in zip(*out, strict=True)))
            for out in parts]


def greedy(run: CachedModel, prompts: Sequence[Sequence[int]], max_tokens: int,
           eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Each prompt's greedy continuation (up to max_tokens, the end-of-sequence token included
    when one ends it): each prompt prefilled, then all decoded together."""
    if max_tokens <= 0 or not prompts:
        return [[] for _ in prompts]
    per_seq = -(-(max(map(len, prompts)) + max_tokens) // BLOCK_SIZE)
    if per_seq * len(prompts) > run.cache.num_blocks:
        raise ValueError(f"{len(prompts)} prompts of up to {max(map(len, prompts))} tokens + "
                         f"{max_tokens} need {per_seq * len(prompts)} blocks, the cache has "
                         f"{run.cache.num_blocks}")
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    last: list[int] = []
    for prompt, table in zip(prompts, tables, strict=True):
        last.append(int(run.prefill(prompt, 0, table, all_logits=False)[0].argmax()))
    active = list(range(len(prompts)))
    stops = set(eos_token_ids)
    while active:
        for s, token in zip(active, last, strict=True):
            outputs[s].append(token)
        keep = [i for i, s in enumerate(active)
                if last[i] not in stops and len(outputs[s]) < max_tokens]
        active, fed = [active[i] for i in keep], [last[i] for i in keep]
        if not active:
            break
        logits = run.step([[t] for t in fed],
                          [len(prompts[s]) + len(outputs[s]) - 1 for s in active],
                          [tables[s] for s in active], False)
        last = [int(row.argmax()) for row in logits]
    return outputs
