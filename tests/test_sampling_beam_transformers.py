"""BeamSearch against transformers' own `generate(num_beams=...)` on a bigram torch module whose
next-token logits are a fixed random table indexed by the last token."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvcore.sampling import BeamSearch, BeamSearchParams

torch = pytest.importorskip("torch", reason="the reference extras (torch) are not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the reference extras (transformers) are not installed")

pytestmark = pytest.mark.reference

VOCAB = 24
PAD = 0  # transformers then pads with eos[0] (`pad_token_id or eos[0]`)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Any:
    """Tiny tensors: a thread pool only adds contention on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_bigram(table: np.ndarray) -> Any:
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class BigramConfig(PretrainedConfig):
        model_type = "kvcore_test_bigram"

        def __init__(self, vocab_size: int = VOCAB, **kwargs: Any) -> None:
            self.vocab_size = vocab_size
            super().__init__(**kwargs)

    class Bigram(PreTrainedModel, GenerationMixin):
        config_class = BigramConfig

        def __init__(self, config: BigramConfig) -> None:
            super().__init__(config)
            self.table = torch.nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))

        def forward(self, input_ids: Any = None, attention_mask: Any = None,
                    **kwargs: Any) -> CausalLMOutput:
            return CausalLMOutput(logits=self.table[input_ids])  # (B, T, V): a pure lookup

    model = Bigram(BigramConfig(vocab_size=table.shape[0])).eval()
    with torch.no_grad():
        model.table.copy_(torch.from_numpy(table))
    return model


def bigram_table(seed: int, eos: list[int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((VOCAB, VOCAB)) * 2.0).astype(np.float32)  # (V, V)
    for e in eos:  # EOS fairly likely, so hypotheses finish at different lengths
        table[:, e] += rng.uniform(-1.0, 3.0, size=VOCAB).astype(np.float32)
    return table


def kvcore_search(table: np.ndarray, prompt: list[int],
                  params: BeamSearchParams, eos: list[int]) -> list[tuple[list[int], float]]:
    search = BeamSearch(params, eos)
    last = [prompt[-1]]
    while not search.done:
        # log_softmax as transformers computes it (float32 torch), so ties break identically
        rows = torch.log_softmax(torch.from_numpy(table[last]), dim=-1).numpy()  # (L, V)
        step = search.step(rows)
        last = [c.token_id for c in step.survivors]
    return [(list(h.token_ids), h.score) for h in search.results()]


def transformers_search(model: Any, prompt: list[int], params: BeamSearchParams,
                        eos: list[int]) -> list[tuple[list[int], float]]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        num_beams=params.beam_width, num_return_sequences=params.beam_width,
        max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
        early_stopping=params.early_stopping, do_sample=False, eos_token_id=eos,
        pad_token_id=PAD, use_cache=False, return_dict_in_generate=True, output_scores=True)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config)
    # beam_indices is -1 past each hypothesis' end: it gives the true generated lengths
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    generated = out.sequences[:, len(prompt):].tolist()
    return [(ids[:n], score) for ids, n, score
            in zip(generated, lengths, out.sequences_scores.tolist(), strict=True)]


CASES = list(itertools.product([2, 4], [1.0, 0.0, 2.0, -0.5], [False, True, "never"]))


@pytest.mark.parametrize(("beam_width", "length_penalty", "early_stopping"), CASES)
def test_beam_search_equals_transformers(beam_width: int, length_penalty: float,
                                         early_stopping: bool | str) -> None:
    # six tables: enough that the early-stopping heuristic's length and "never" change results
    for seed in range(6):
        eos = [1] if seed % 3 else [1, 7]
        table = bigram_table(seed, eos)
        model = make_bigram(table)
        prompt = [5, 9, 3 + seed]
        params = BeamSearchParams(beam_width=beam_width, max_tokens=12,
                                  length_penalty=length_penalty, early_stopping=early_stopping)
        got = kvcore_search(table, prompt, params, eos)
        want = transformers_search(model, prompt, params, eos)
        assert len(got) == len(want) == beam_width
        assert [ids for ids, _ in got] == [ids for ids, _ in want], f"seed {seed}"
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-6)
