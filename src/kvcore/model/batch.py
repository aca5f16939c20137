"""BatchInput: the explicit, plain-array description of one forward step over the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from kvcore.device import array_module


@dataclass(frozen=True, slots=True)
class BatchInput:
    """One step's tokens, sequence after sequence; host NumPy arrays (one device copy each)."""

    input_ids: np.ndarray  # (T,) int64, the step's tokens, sequence after sequence
    positions: np.ndarray  # (T,) int64, position of each token in its sequence
    slot_mapping: np.ndarray  # (T,) int64, cache slot (block_id * block_size + offset); -1 = skip
    query_start_loc: np.ndarray  # (S+1,) int32, first row of each sequence in T
    context_lens: np.ndarray  # (S,) int32, tokens of each sequence including this step's
    block_tables: np.ndarray  # (S, max_blocks) int32, -1 padding (or a released block)
    logits_indices: np.ndarray  # (L,) int64, rows of T whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def build(cls, token_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
              block_tables: Sequence[Sequence[int | None]], block_size: int,
              sample: Sequence[int] | None = None) -> BatchInput:
        """Build a step from per-sequence lists, in one pass over the batch.

        Sequence s feeds token_ids[s] at positions num_computed_tokens[s] onwards; its block table
        (None = a block released outside the sliding window) must cover every new position. The
        logits of sequence s's last sample[s] new tokens are wanted (a bool: its last token or
        none; more than one: a speculative step verifying drafts; default: the last of each).
        """
        num_seqs = len(token_ids)
        if len(num_computed_tokens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(f"token_ids ({num_seqs}), num_computed_tokens "
                             f"({len(num_computed_tokens)}) and block_tables "
                             f"({len(block_tables)}) must have one entry per sequence")
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        wanted = [1] * num_seqs if sample is None else [int(n) for n in sample]
        if len(wanted) != num_seqs:
            raise ValueError(f"sample has {len(wanted)} entries for {num_seqs} sequences")
        q_lens = np.array([len(t) for t in token_ids], dtype=np.int64)  # (S,)
        if num_seqs and q_lens.min() <= 0:
            raise ValueError("every sequence of a step needs at least one token")
        table_lens = np.array([len(t) for t in block_tables], dtype=np.int64)  # (S,)
        tables = np.full((num_seqs, max(int(table_lens.max(initial=0)), 1)), -1,
                         dtype=np.int32)  # (S, max_blocks)
        try:  # one pass over every table's ids (None: a block the sliding window released)
            flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32,
                               count=int(table_lens.sum()))
        except TypeError:
            flat = np.array([-1 if b is None else b for t in block_tables for b in t],
                            dtype=np.int32)
        tables[np.arange(tables.shape[1]) < table_lens[:, None]] = flat
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)  # (S+1,)
        np.cumsum(q_lens, out=query_start_loc[1:])
        computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(num_seqs)
        if num_seqs and computed.min() < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {list(num_computed_tokens)}")
        seq_of_row = np.repeat(np.arange(num_seqs), q_lens)  # (T,)
        positions = computed[seq_of_row] + np.arange(int(q_lens.sum())) - query_start_loc[
            seq_of_row]
        block_index = positions // block_size
        if num_seqs and np.any(block_index >= tables.shape[1]):
            raise ValueError("a block table does not cover every new token's position")
        block_ids = tables[seq_of_row, block_index].astype(np.int64)
        if np.any(block_ids < 0):
            raise ValueError("a new token's position falls in a released or missing block")
        input_ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64,
                                count=int(q_lens.sum()))
        num_wanted = np.asarray(wanted, dtype=np.int64).reshape(num_seqs)  # (S,)
        if num_seqs and (num_wanted.min() < 0 or np.any(num_wanted > q_lens)):
            raise ValueError(f"sample must be in [0, tokens of the sequence], got {wanted}")
        if num_wanted.max(initial=0) <= 1:
            logits_indices = query_start_loc[1:][num_wanted == 1].astype(np.int64) - 1
        else:  # the last num_wanted[s] rows of each sequence, in order
            ends = np.repeat(query_start_loc[1:].astype(np.int64), num_wanted)  # (L,)
            firsts = np.cumsum(num_wanted) - num_wanted
            offsets = np.arange(int(num_wanted.sum())) - np.repeat(firsts, num_wanted)
            logits_indices = ends - np.repeat(num_wanted, num_wanted) + offsets
        return cls(
            input_ids=input_ids,
            positions=positions.astype(np.int64),
            slot_mapping=block_ids * block_size + positions % block_size,
            query_start_loc=query_start_loc,
            context_lens=(computed + q_lens).astype(np.int32),
            block_tables=tables,
            logits_indices=logits_indices,
        )


@dataclass(frozen=True, slots=True)
class InputFill:
    """Rows of a step's input_ids that the device fills after the inputs went up, from token ids
    already on the device (async scheduling: the tokens the step before sampled, never read back
    to the host). The host's input_ids hold any valid id there."""

    rows: np.ndarray  # (P,) int64 rows of input_ids
    token_ids: Any  # (P,) int64 on the model's device

    def apply(self, input_ids: Any) -> None:
        """Scatter into the device copy of input_ids (stream order: after its upload)."""
        input_ids[array_module(input_ids).asarray(self.rows)] = self.token_ids
