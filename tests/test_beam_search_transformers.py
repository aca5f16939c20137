"""In-engine beam search (beams as copy-on-write sequences) against transformers' beam search on
the same weights: the tiny random-weight Llama and the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import assert_pool_empty, make_engine, run_all
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling import BeamSearchParams

torch = pytest.importorskip("torch", reason="the reference extras (torch) are not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the reference extras (transformers) are not installed")

pytestmark = pytest.mark.reference


def hf_beam_search(model: Any, prompt: list[int], params: BeamSearchParams,
                   eos: list[int]) -> list[tuple[list[int], float]]:
    config = transformers.GenerationConfig(
        num_beams=params.beam_width, num_return_sequences=params.beam_width,
        max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
        early_stopping=params.early_stopping, do_sample=False, eos_token_id=eos,
        pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # -1 past each hypothesis' end
    generated = out.sequences[:, len(prompt):].tolist()
    return [(ids[:n], score) for ids, n, score
            in zip(generated, lengths, out.sequences_scores.tolist(), strict=True)]


def check_equal(engine_outputs: list[Any], model: Any, prompts: list[list[int]],
                params: BeamSearchParams, eos: list[int]) -> None:
    for out, prompt in zip(engine_outputs, prompts, strict=True):
        want = hf_beam_search(model, prompt, params, eos)
        got = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
        scores = [cum / len(ids) ** params.length_penalty for ids, cum in got]
        np.testing.assert_allclose(scores, [s for _, s in want], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def one_torch_thread() -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(("beam_width", "length_penalty", "early_stopping"),
                         [(2, 1.0, False), (4, 0.5, True), (3, 2.0, "never")])
def test_tiny_model_beams_equal_transformers(tiny_model_dir: Path, one_torch_thread: Any,
                                             beam_width: int, length_penalty: float,
                                             early_stopping: bool | str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(beam_width)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (5, 11, 17)]
    # EOS (2) and a frequent token as stop ids, so hypotheses end at different lengths
    params = BeamSearchParams(beam_width=beam_width, max_tokens=10,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    outputs = run_all(engine, prompts, params)
    assert_pool_empty(engine)
    check_equal(outputs, model, prompts, params, [2])


def test_beams_share_blocks_and_survive_preemption(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (9, 14, 21, 6)]
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    roomy = run_all(make_engine(tiny_model_dir), prompts, params)
    engine = make_engine(tiny_model_dir, num_blocks=24)  # one group of 4 beams fits, not four
    tight = run_all(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_pool_empty(engine)
    # mid-search, live beams share their common history by refcount
    engine.add_request("b", prompts[2], params)
    for _ in range(4):
        engine.step()
    tables = [engine.kv.block_table(s.seq_id) for s in engine.beams._policies["b"].live]
    assert len(tables) == 4
    first_blocks = {t[0] for t in tables}
    assert len(first_blocks) == 1 and engine.kv.pool.blocks[first_blocks.pop()].ref_count == 4
    engine.abort_request("b")
    assert_pool_empty(engine)


def test_default_model_beams_equal_transformers(default_model_dir: Path,
                                                one_torch_thread: Any) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_dir(default_model_dir)
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a haiku about the sea."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in questions]
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=1.0)
    # an fp32 cache, as transformers': the subject is beam search, and its scores are compared
    # at 1e-4 (the CPU default fp16 cache keeps the beams but moves the scores by ~5e-4), and
    # fp32 weights (the default keeps the GGUF's q4 blocks)
    engine = make_engine(default_model_dir, block_size=16, num_blocks=64, cache_dtype="fp32",
                         quantization="none")
    outputs = run_all(engine, prompts, params)
    assert_pool_empty(engine)
    eos = list(engine.eos_token_ids)
    check_equal(outputs, model, prompts, params, eos)


def test_aborted_beam_search_reports_its_live_beams(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request("b", [5, 6, 7, 8], BeamSearchParams(beam_width=3, max_tokens=20))
    for _ in range(3):
        assert engine.step() == []  # nothing is streamed while the search runs
    out = engine.abort_request("b")
    assert out is not None and out.finished and len(out.outputs) == 3
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 3 for c in out.outputs)
    assert_pool_empty(engine)
