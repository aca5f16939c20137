"""Drawing a step's tokens from its logits: the device half (token ids left on the logits'
device) and the read-back, and the per-sequence SamplingRow. Touches no engine state, so the
engine core runs it as device work (async scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvcore.device import array_module
from kvcore.request import Sequence
from kvcore.sampling import RowSampler, SamplingParams, SamplingRow, TokenLogprob

HostDraw = tuple[list[int], list[TokenLogprob | None]]  # (R,) token ids, (R,) logprobs


def draw_rows(sampler: RowSampler, logits: Any, row_logits: list[int], rows: list[Sequence],
              sampling_rows: list[SamplingRow]
              ) -> tuple[Any, Callable[[], HostDraw], dict[int, BaseException]]:
    """Draw every row's token: ((R,) device token ids, their read-back, failed rows). A
    failure of one request (its processors, its draw) fails that request alone: the batch
    is redrawn row by row (a row's draw depends only on its seed and output position: the
    same tokens). Touches no engine state: it runs as device work."""
    try:
        return (*draw(sampler, logits, row_logits, sampling_rows), {})
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
                _, read = draw(sampler, logits, row_logits[i:i + 1], sampling_rows[i:i + 1])
                one, one_lp = read()
                ids[i], logprobs[i] = one[0], one_lp[0]
                continue
            except Exception as e:
                error = errors[seq.request_id] = e
        failed[i] = error
    xp = array_module(logits)
    return xp.asarray(np.array(ids, dtype=np.int64)), lambda: (ids, logprobs), failed


def draw(sampler: RowSampler, logits: Any, row_logits: list[int],
         sampling_rows: list[SamplingRow]) -> tuple[Any, Callable[[], HostDraw]]:
    """`logits` (L, V) on the model's device (NumPy or CuPy): ((R,) token ids on that
    device, the read-back of the ids and the asked logprobs, which waits for the device)."""
    xp = array_module(logits)
    if len(row_logits) == logits.shape[0] and row_logits == list(range(len(row_logits))) \
            and all(r.params.argmax_only for r in sampling_rows):
        batch = logits  # argmax only: no processor writes to the logits, no copy
    else:
        index = xp.asarray(np.asarray(row_logits, dtype=np.int64))  # (R,)
        batch = logits[index]  # (R, V) a copy on the device: the processors write in place
    token_ids, read = sampler.launch(batch, sampling_rows)

    def read_back() -> HostDraw:
        out = read()
        return out.token_ids.tolist(), list(out.logprobs)
    return token_ids, read_back


def sampling_row(seq: Sequence) -> SamplingRow:
    """The sequence's row for the sampler: its history only when a processor reads it (the
    prompt's own list, never copied; the outputs as they are now)."""
    params: SamplingParams = seq.params  # type: ignore[assignment]  # beams never draw
    if not params.reads_history:  # the draw needs only the output position
        return SamplingRow(params, (), (), seq.seed, len(seq.token_ids) - seq.num_prompt_tokens)
    return SamplingRow(params, seq.prompt_token_ids, seq.token_ids[seq.num_prompt_tokens:],
                       seq.seed)
