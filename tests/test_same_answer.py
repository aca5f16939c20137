"""Same request, same answer on the CPU path: a request's token ids and logprobs (greedy and
seeded rows, n > 1, beams, stop strings and ids, penalties, constrained rows) are bit-identical
whether it runs alone on a fresh engine or in any mix, whatever its prefill is cut into, with its
prefix cached or not, with speculation ngram / suffix / off, preempted and recomputed or not,
with sync or async steps, for every weight format and KV cache dtype.

The tiny random model (near ties everywhere: any batch-dependent reduction flips tokens) takes
the broad sweep; the default model a few real cases per weight format. The kernel-level guards
(1 row against many) live in tests/test_same_answer_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kvcore.kernels.cpu import jit
from kvcore.sampling import BeamSearchParams, SamplingParams
from same_answer import Case, Schedule, mismatches, mixes

pytestmark = pytest.mark.skipif(not jit.active(),
                                reason="the promise is the compiled CPU kernels'")

TINY_VOCAB = (3, 259)  # the tiny model's byte tokens
# few examples per configuration (15 configurations): each example runs a mix and every case
# alone on its own engine
SETTINGS = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


@pytest.mark.parametrize("cache_dtype", ["fp32", "fp16", "bf16", "fp8", "int4"])
@pytest.mark.parametrize("quantization", ["none", "int8", "q4"])
def test_tiny_model_mixes(tiny_model_dir: Path, quantization: str, cache_dtype: str) -> None:
    engine_args = dict(block_size=4, quantization=quantization, cache_dtype=cache_dtype,
                       int4_window_tokens=8, seed=0)

    @SETTINGS
    @given(mix=mixes(TINY_VOCAB, max_prompt=40, max_tokens=10))
    def check(mix: tuple[list[Case], Schedule]) -> None:
        cases, schedule = mix
        assert mismatches(tiny_model_dir, cases, schedule, **engine_args) == []
    check()


def test_tiny_model_preempted_chunked_and_speculated(tiny_model_dir: Path) -> None:
    """One fixed hard schedule: a pool that preempts, a budget of 5 tokens, ngram drafts, a
    warm prefix cache, and an int4 cache whose rows cross super-blocks within a chunk."""
    stem = list(range(10, 40))
    cases = [Case(tuple(stem + [50 + i] * 3), SamplingParams(
        n=1 + i % 2, max_tokens=12, temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
        logprobs=2, ignore_eos=True)) for i in range(4)]
    cases.append(Case(tuple(stem[:9]), BeamSearchParams(beam_width=2, max_tokens=6)))
    schedule = Schedule(max_num_batched_tokens=5, num_blocks=40, max_num_seqs=4, warm=(0,),
                        speculative={"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    for cache_dtype in ("fp16", "int4"):
        assert mismatches(tiny_model_dir, cases, schedule, block_size=4, cache_dtype=cache_dtype,
                          int4_window_tokens=8) == []


CHAT_SYSTEM = ("You are a careful assistant. Answer questions about science, history and "
               "geography in one or two sentences, give numbers with their units, and never "
               "make up facts. If a question is ambiguous, answer the most common reading of "
               "it. Keep answers short, plain and friendly, without lists unless asked. ") * 2


@pytest.mark.parametrize(("quantization", "cache_dtype"),
                         [("auto", "fp16"), ("int8", "bf16"), ("none", "fp8"), ("auto", "int4")])
def test_default_model_cases(default_model_dir: Path, quantization: str,
                             cache_dtype: str) -> None:
    """Chat prompts sharing a ~150-token system prompt (its prefill one long chunk alone, many
    short ones in the mix, a prefix-cache hit for all but the first), greedy and seeded rows,
    ngram drafts, a budget that cuts them and a pool that preempts."""
    from kvcore.engine.llm import engine_config
    from kvcore.engine.setup import load_engine_model

    config = engine_config(str(default_model_dir), quantization=quantization)
    model, _ = load_engine_model(config, "cpu")
    tok = make_tokenizer(default_model_dir)
    questions = ("What is the boiling point of water?", "Name three primary colors.",
                 "How far away is the moon?")
    prompts = [tuple(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": q}])))
        for q in questions]
    cases = [Case(prompts[0], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
             Case(prompts[1], SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=11,
                                             logprobs=1)),
             Case(prompts[2], SamplingParams(max_tokens=8, temperature=0.0,
                                             repetition_penalty=1.1))]
    schedule = Schedule(max_num_batched_tokens=48, num_blocks=30, max_num_seqs=4,
                        warm=(2,), async_scheduling=True,
                        speculative={"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert mismatches(default_model_dir, cases, schedule, model=model, block_size=16,
                      cache_dtype=cache_dtype) == []


def make_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    from kvcore.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)
