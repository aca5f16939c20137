"""Drawing a step's tokens from its logits: the device half (token ids left on the logits'
device) and the read-back, and the per-sequence SamplingRow. Touches no engine state, so the
engine core runs it as device work (async scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvcore.device import array_module, to_numpy
from kvcore.request import Sequence
from kvcore.sampling import SamplingParams, SamplingRow, TokenLogprob
from kvcore.sampling.sampler import SamplerOutput

HostDraw = tuple[list[int], list[TokenLogprob | None]]  # (R,) token ids, (R,) logprobs
# RowSampler (its `launch` keeps the draw on the device), or any (logits, rows) callable
Sampler = Callable[[Any, list[SamplingRow]], SamplerOutput]


def draw_rows(sampler: Sampler, logits: Any, row_logits: list[int], rows: list[Sequence],
              sampling_rows: list[SamplingRow]
              ) -> tuple[Any, Callable[[], HostDraw], dict[int, BaseException]]:
    """Draw every row's token: ((R,) device token ids, their read-back, failed rows). A
    failure of one request (its processors, its draw) fails that request alone: the batch
    is redrawn row by row (a row's draw depends only on its seed and output position: the
    same tokens). Touches no engine state: it runs as device work."""
    try:
        return (*draw(sampler, logits, row_logits, rows, sampling_rows), {})
    except Exception:
        pass
    ids: list[int] = [0] * len(rows)
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    errors: dict[str, BaseException] = {}  # request id -> its first row's failure
    failed: dict[int, BaseException] = {}
    for i, seq in enumerate(rows):
        error = errors.get(seq.request_id)
        if error is None:
            try:
                _, read = draw(sampler, logits, row_logits[i:i + 1], [seq],
                               sampling_rows[i:i + 1])
                one, one_lp = read()
                ids[i], logprobs[i] = one[0], one_lp[0]
                continue
            except Exception as e:
                error = errors[seq.request_id] = e
        failed[i] = error
    xp = array_module(logits)
    return xp.asarray(np.array(ids, dtype=np.int64)), lambda: (ids, logprobs), failed


def draw(sampler: Sampler, logits: Any, row_logits: list[int], rows: list[Sequence],
         sampling_rows: list[SamplingRow]) -> tuple[Any, Callable[[], HostDraw]]:
    """`logits` (L, V) on the model's device (NumPy or CuPy): ((R,) token ids on that
    device, the read-back of the ids and the asked logprobs, which waits for the device)."""
    xp = array_module(logits)
    index = xp.asarray(np.asarray(row_logits, dtype=np.int64))  # (R,)
    if logits.ndim == 1:  # the model sampled on its own device: (L,) greedy token ids
        for seq in rows:
            params = seq.params
            assert isinstance(params, SamplingParams)
            if not params.greedy or params.logprobs is not None or params.constraint:
                raise ValueError("this model returns token ids: only greedy sampling "
                                 "without logprobs or constraints")
        ids = logits[index]  # (R,)
        return ids, lambda: (to_numpy(ids).tolist(), [None] * len(rows))
    if len(row_logits) == logits.shape[0] and row_logits == list(range(len(row_logits))) \
            and all(reads_only(r) for r in sampling_rows):
        batch = logits  # argmax only: no processor writes to the logits, no copy
    else:
        batch = logits[index]  # (R, V) a copy on the device: the processors write in place
    launch = getattr(sampler, "launch", None)
    if launch is None:  # a plain sampler callable: host output at once
        out = sampler(batch, sampling_rows)
        return out.token_ids, lambda: (out.token_ids.tolist(), list(out.logprobs))
    token_ids, read = launch(batch, sampling_rows)

    def read_back() -> HostDraw:
        out = read()
        return out.token_ids.tolist(), list(out.logprobs)
    return token_ids, read_back


def sampling_row(seq: Sequence) -> SamplingRow:
    """The sequence's row for the sampler: its history only when a processor reads it."""
    params = seq.params
    assert isinstance(params, SamplingParams)
    if not params.reads_history:  # the draw needs only the output position
        return SamplingRow(params, None, (), (), seq.seed, seq.num_output_tokens)
    num_prompt = seq.num_prompt_tokens
    return SamplingRow(params, None, seq.token_ids[:num_prompt], seq.token_ids[num_prompt:],
                       seq.seed)


def reads_only(row: SamplingRow) -> bool:
    """A greedy row with no processor: the sampler only takes its argmax (and raw logprobs)."""
    return row.params.argmax_only
