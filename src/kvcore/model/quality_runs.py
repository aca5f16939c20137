"""The quality runs of `kvcore eval`: variants scored in lockstep on the same text (so the KL
divergence against the baseline needs only one chunk of the baseline's logits at a time), and
greedy generations on chat prompts, each variant through its own paged KV cache.

The text is split into windows of `context` tokens, each a fresh sequence prefilled `chunk` tokens
per step through the cache, so the cache's error accumulates over the window as it does in use. An
int4 cache reads each block by the rule of positions (a row's own super-block in fp16, every
earlier block sealed), so how the text is chunked does not change its numbers; it is fed one
block per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvcore.cache.int4_window import num_window_slots
from kvcore.cache.kv_cache import KVCache
from kvcore.cache.manager import KVCacheManager
from kvcore.model.batch import BatchInput
from kvcore.model.quality import TextScore, Variant, log_softmax, next_token_stats

BLOCK_SIZE = 16


class CachedModel:
    """One variant: a model and its own KV cache of `num_blocks` blocks whose block tables (and,
    for int4, fp16 window slots and seals) the engine's KVCacheManager drives, run step by step
    as the engine's runner runs them."""

    def __init__(self, model: Any, variant: Variant, num_blocks: int, int4_group: int,
                 int4_window: int, max_num_seqs: int = 4) -> None:
        kv_heads, width, shared = model.config.kv_layout
        self.model, self.variant = model, variant
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.max_step: int | None = None  # tokens per forward step of one sequence (None: any)
        self.int4: dict[str, Any] | None = None  # the int4 cache's settings
        slots = None
        if variant.cache_dtype == "int4":
            self.max_step = BLOCK_SIZE
            slots = num_window_slots(max_num_seqs, int4_window, BLOCK_SIZE,
                                     max_num_seqs * BLOCK_SIZE)
        self.cache = KVCache(model.config.num_layers, num_blocks, BLOCK_SIZE, kv_heads, width,
                             variant.cache_dtype, shared_kv=shared, num_window_slots=slots,
                             window_tokens=int4_window, int4_group=int4_group)
        if self.cache.window is not None:
            self.manager.attach_window(self.cache.window)
            self.int4 = {"group": self.cache.int4_group, "window": int4_window, "path": "cache"}

    def step(self, seqs: Sequence[tuple[str, Sequence[int], int]],
             all_logits: bool) -> np.ndarray:
        """Feed each (seq_id, token_ids, num_new) its last num_new tokens (a new seq_id starts a
        sequence): (rows, vocab) logits of every new token (all_logits) or of each sequence's
        last."""
        tables, computed, new_ids = [], [], []
        for seq_id, token_ids, num_new in seqs:
            if seq_id not in self.manager:
                self.manager.allocate_prefix(seq_id, token_ids)
            if self.manager.allocate_slots(seq_id, token_ids, num_new) is None:
                raise ValueError(f"the eval cache ({self.manager.num_blocks} blocks) is short "
                                 f"for {len(token_ids)} tokens of {seq_id!r}")
            tables.append(self.manager.block_table(seq_id))
            computed.append(len(token_ids) - num_new)
            new_ids.append(token_ids[len(token_ids) - num_new:])
        batch = BatchInput.build(new_ids, computed, tables, BLOCK_SIZE)
        if all_logits:
            batch = replace(batch, logits_indices=np.arange(sum(map(len, new_ids)),
                                                            dtype=np.int64))
        window_ops = self.cache.take_window_ops()  # int4: slot moves and seals, as the runner
        if window_ops is not None:
            self.cache.apply_window_ops(window_ops)
        logits: np.ndarray = self.model.forward(batch, self.cache)
        return logits

    def prefill(self, seq_id: str, token_ids: Sequence[int], context_len: int,
                all_logits: bool) -> np.ndarray:
        """A sequence's tokens after its context_len computed ones, max_step tokens per step:
        the logits of every token (all_logits) or of the last."""
        size = self.max_step or len(token_ids) - context_len
        parts = [self.step([(seq_id, token_ids[:i + size], len(token_ids[i:i + size]))],
                           all_logits) for i in range(context_len, len(token_ids), size)]
        return np.concatenate(parts) if all_logits else parts[-1]

    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)


def score_text(runs: Sequence[CachedModel], token_ids: Sequence[int], context: int, chunk: int,
               progress: Callable[[int], None] | None = None) -> list[TextScore]:
    """Score every variant on the same windows; the first is the baseline of the KL divergence.
    progress(n): n more tokens were scored by every variant."""
    if len(token_ids) < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens, got {len(token_ids)}")
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in runs]
    for start in range(0, len(token_ids) - 1, context):
        ids = list(token_ids[start:start + context + 1])  # the window and the token after it
        seq_id = f"window-{start}"
        for offset in range(0, len(ids) - 1, chunk):
            end = min(offset + chunk, len(ids) - 1)  # the last token of the text predicts nothing
            targets = np.asarray(ids[offset + 1:end + 1], np.int64)
            base = None
            for run, out in zip(runs, parts, strict=True):
                logprobs = log_softmax(run.prefill(seq_id, ids[:end], offset, all_logits=True))
                base = logprobs if base is None else base
                out.append(next_token_stats(logprobs, targets, base))
            if progress is not None:
                progress(end - offset)
        for run in runs:
            run.free(seq_id)
    return [TextScore(*(np.concatenate(column) for column in zip(*out, strict=True)))
            for out in parts]


def greedy(run: CachedModel, prompts: Sequence[Sequence[int]], max_tokens: int,
           eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Each prompt's greedy continuation (up to max_tokens, the end-of-sequence token included
    when one ends it): each prompt prefilled, then all decoded together."""
    if max_tokens <= 0 or not prompts:
        return [[] for _ in prompts]
    tokens = [list(p) for p in prompts]  # (S,) each sequence's prompt and generated tokens
    seq_ids = [f"prompt-{s}" for s in range(len(prompts))]
    last = [int(run.prefill(seq_id, t, 0, all_logits=False)[0].argmax())
            for seq_id, t in zip(seq_ids, tokens, strict=True)]
    active = list(range(len(prompts)))
    stops = set(eos_token_ids)
    while active:
        for s, token in zip(active, last, strict=True):
            tokens[s].append(token)
        done = [s for i, s in enumerate(active)
                if last[i] in stops or len(tokens[s]) - len(prompts[s]) >= max_tokens]
        active = [s for s in active if s not in done]
        if not active:
            break
        logits = run.step([(seq_ids[s], tokens[s], 1) for s in active], all_logits=False)
        last = [int(row.argmax()) for row in logits]
    for seq_id in seq_ids:
        run.free(seq_id)
    return [t[len(p):] for t, p in zip(tokens, prompts, strict=True)]
