"""The KV memory model behind tools/simulate_memory.py: a ShareGPT-like trace and two pool policies.

Trace: prompt and output lengths are lognormal, ShareGPT's long tail. The means are those the vLLM
paper (Kwon et al., SOSP 2023, Fig. 11) reports for ShareGPT: 161.31 prompt and 337.99 output
tokens. It gives no medians; we assume 75 (prompt) and 250 (output) tokens, so
sigma = sqrt(2 ln(mean / median)) = 1.24 and 0.78, and mu = ln(median).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

PROMPT_MEAN, PROMPT_MEDIAN = 161.31, 75.0
OUTPUT_MEAN, OUTPUT_MEDIAN = 337.99, 250.0


@dataclass(frozen=True, slots=True)
class Request:
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_steps: int  # decode steps until every request finished
    waste: float  # 1 - sum over steps of used tokens / reserved tokens
    mean_running: float  # running sequences per step while some request was waiting
    peak_running: int
    num_preemptions: int
    num_recomputed_tokens: int  # KV of preempted requests computed again on readmission
    running_per_step: list[int] = field(repr=False)


@dataclass(slots=True)
class _Seq:
    request: Request
    num_generated: int = 0
    num_blocks: int = 0  # paged only

    @property
    def length(self) -> int:
        return self.request.prompt_len + self.num_generated


def lognormal_params(mean: float, median: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and median."""
    return math.log(median), math.sqrt(2 * math.log(mean / median))


def sharegpt_like_trace(num_requests: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(*lognormal_params(PROMPT_MEAN, PROMPT_MEDIAN), size=num_requests)
    outputs = rng.lognormal(*lognormal_params(OUTPUT_MEAN, OUTPUT_MEDIAN), size=num_requests)
    return [Request(max(1, round(p)), max(1, round(o)))
            for p, o in zip(prompts, outputs, strict=True)]


def clip_to_max_len(trace: list[Request], max_model_len: int) -> tuple[list[Request], int]:
    """Prompts with no room for one output token are rejected; outputs stop at max_model_len."""
    kept = [Request(r.prompt_len, min(r.output_len, max_model_len - r.prompt_len))
            for r in trace if r.prompt_len < max_model_len]
    return kept, len(trace) - len(kept)


def static_waste(trace: list[Request], max_model_len: int, block_size: int) -> tuple[float, float]:
    """(contiguous, paged) waste with every request at its final length: unused / reserved."""
    used = sum(r.total_len for r in trace)
    paged_reserved = sum(-(-r.total_len // block_size) * block_size for r in trace)
    return 1 - used / (len(trace) * max_model_len), 1 - used / paged_reserved


def simulate_pool(trace: list[Request], pool_tokens: int, max_model_len: int | None = None,
                  block_size: int = 16) -> PoolStats:
    """Run the trace through a pool: all requests queued at step 0, served first come first served.

    Contiguous (max_model_len given): each running request reserves max_model_len slots. Paged
    (max_model_len None): a request holds the blocks its tokens fill and takes one when its last is
    full; without a free block the latest admitted request is preempted (its blocks freed, requeued
    at the front, recomputed on readmission). A step adds one token to every running request; the
    step that admits one writes its prompt and first output token.
    """
    num_blocks = pool_tokens // block_size
    slots = pool_tokens // max_model_len if max_model_len else 0
    longest = max(r.total_len for r in trace)
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_model_len {max_model_len}")
    if (slots == 0 if max_model_len else -(-longest // block_size) > num_blocks):
        raise ValueError(f"pool_tokens {pool_tokens} cannot hold one request")
    waiting: deque[_Seq] = deque(_Seq(r) for r in trace)
    running: list[_Seq] = []
    free, used_sum, reserved_sum, saturated_running = num_blocks, 0, 0, []
    preemptions = recomputed = 0
    per_step: list[int] = []
    while waiting or running:
        preempted = False
        if max_model_len is None:
            i = 0
            while i < len(running):  # every running request needs a slot for its next token
                seq = running[i]
                need = -(-(seq.length + 1) // block_size) - seq.num_blocks
                while need > free:
                    victim = running.pop()  # the latest admitted, possibly seq itself
                    free += victim.num_blocks
                    victim.num_blocks = 0
                    waiting.appendleft(victim)
                    preemptions += 1
                    recomputed += victim.length
                    preempted = True
                    if victim is seq:
                        break
                if i == len(running):
                    break  # seq itself was preempted: it was the last running request
                free -= need
                seq.num_blocks += need
                i += 1
        while waiting and not preempted:  # a step that preempted admits nobody
            seq = waiting[0]
            if max_model_len is not None:
                if len(running) == slots:
                    break
            else:
                need = -(-(seq.length + 1) // block_size)
                if need > free:
                    break
                free -= need
                seq.num_blocks = need
            running.append(waiting.popleft())
        if waiting:
            saturated_running.append(len(running))
        for seq in running:
            seq.num_generated += 1
        per_step.append(len(running))
        used_sum += sum(seq.length for seq in running)
        reserved_sum += (len(running) * max_model_len if max_model_len is not None
                         else sum(seq.num_blocks for seq in running) * block_size)
        for seq in [s for s in running if s.num_generated == s.request.output_len]:
            running.remove(seq)
            free += seq.num_blocks
    return PoolStats(
        num_steps=len(per_step),
        waste=1 - used_sum / reserved_sum,
        mean_running=float(np.mean(saturated_running)) if saturated_running else float(per_step[0]),
        peak_running=max(per_step),
        num_preemptions=preemptions,
        num_recomputed_tokens=recomputed,
        running_per_step=per_step,
    )


def prefix_sharing_blocks(own_lens: list[int], system_len: int, block_size: int) -> tuple[int, int]:
    """(blocks without sharing, blocks with sharing) for conversations behind one system prompt.

    Only full blocks are shared (the prefix cache's rule): the system prompt's partial last block
    and everything after it stay private to each conversation.
    """
    shared = system_len // block_size
    tail = system_len - shared * block_size
    alone = sum(-(-(system_len + n) // block_size) for n in own_lens)
    sharing = shared + sum(-(-(tail + n) // block_size) for n in own_lens)
    return alone, sharing
