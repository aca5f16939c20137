"""On a GPU: `--kv-cache-dtype int4` end to end. The cuda engine (fp16 model, CUDA graphs,
int4 cache in CuPy arrays) runs the emulated test's requests (blocks sealed behind the window,
prefix-cache hits, n = 2 forks copying an open block) with the CPU engine's window operations
and greedy tokens close to its; a device cache state written and sealed by the window
operations reads the same through the CUDA and the CPU attention. Marked `gpu`; skipped without
a CUDA device (run by tools/gpu_check.sh)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from int4_engine_runs import run
from kvcore import kernels
from kvcore.cache.int4_window import ASSIGN, COPY, SEAL, WindowOp
from kvcore.cache.kv_cache import KVCache
from kvcore.device import cuda_available
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.kernels import cpu
from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.model import load_model
from tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_d64"), seed=3, head_dim=64)


def int4_engine(model_dir: Path, device: str) -> Engine:
    config = engine_config(str(model_dir), block_size=BLOCK_SIZE, num_blocks=64,
                           cache_dtype="int4", int4_window_tokens=16, max_num_seqs=8,
                           max_num_batched_tokens=32, enable_prefix_caching=True, seed=0,
                           device=device)
    # the CPU reference runs the same fp16 model (NumPy) on the CPU int4 kernels
    model = None if device == "cuda" else load_model(model_dir, device="cpu", half=True)
    return Engine(config, model=model)


def test_cuda_engine_with_an_int4_cache(model_dir: Path) -> None:
    import cupy  # type: ignore[import-not-found]

    engine = int4_engine(model_dir, "cuda")
    kv_cache = engine.kv_cache
    assert kv_cache.device == "cuda" and kv_cache.dtype == "int4"
    for array in (*kv_cache.key_caches, *kv_cache.key_windows, kv_cache.window_slot):
        assert isinstance(array, cupy.ndarray)
    got, gpu_ops = run(engine)
    want, cpu_ops = run(int4_engine(model_dir, "cpu"))
    # the same slot moves and copies (the CPU path seals within steps, the GPU path when a
    # slot goes back)
    assert slot_moves(gpu_ops) == slot_moves(cpu_ops)
    assert sum(kind == SEAL for kind, _, _ in gpu_ops) >= 4
    assert any(kind == COPY for kind, _, _ in gpu_ops)
    assert engine.kv.num_prefix_hits >= BLOCK_SIZE
    assert [len(t) for t in got] == [12] * 4 and got[2] == got[3]
    # cuBLAS and NumPy round the fp16 K/V apart in the last bit, which can move a nibble:
    # the tokens agree at the start, near ties of the random model may part them later
    agree = [next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(g))
             for g, w in zip(got, want, strict=True)]
    print(f"int4 cuda vs cpu: greedy tokens equal before the first difference: {agree} of 12")
    assert sum(a >= 1 for a in agree) >= 3, agree


def slot_moves(ops: list[WindowOp]) -> list[WindowOp]:
    return [op for op in ops if op[0] in (ASSIGN, COPY)]


def test_device_window_ops_and_attention_match_the_cpu(model_dir: Path) -> None:
    """Tokens written into device window slots, every block behind a decode row's own block
    sealed by one batched launch (where the CUDA rule, a block in fp16 while it holds a slot,
    and the CPU's rule of positions read alike): the CUDA attention over the device cache
    equals the CPU attention over its host copy."""
    import cupy

    rng = np.random.default_rng(3)
    heads, kv_heads, dim, group = 4, 2, 64, 32
    cache = KVCache(2, 8, BLOCK_SIZE, kv_heads, dim, "int4", "cuda", num_window_slots=8,
                    int4_group=group)
    cache.apply_window_ops([(ASSIGN, b, s) for b, s in zip(range(6), (3, 0, 5, 1, 7, 2),
                                                           strict=True)])
    tables = np.array([[4, 1, 0], [2, 5, 3]], np.int32)
    context_lens = np.array([40, 37], np.int32)
    slots = np.concatenate([tables[s, :3].astype(np.int64)[:, None] * BLOCK_SIZE
                            + np.arange(BLOCK_SIZE) for s in range(2)]).reshape(-1)
    slots = np.concatenate([slots[:40], slots[48:48 + 37]])  # (77,) tokens written
    for layer in range(2):
        k, v, _, _ = cache.layer(layer)
        key, value = (cupy.asarray(rng.standard_normal((77, kv_heads, dim)).astype(np.float16))
                      for _ in range(2))
        kernels.reshape_and_cache(key, value, k, v, cupy.asarray(slots))
    cache.apply_window_ops([(SEAL, 4, 7), (SEAL, 1, 0), (SEAL, 2, 5), (SEAL, 5, 2)])
    assert cupy.asnumpy(cache.window_slot)[[4, 1, 2, 5, 0, 3]].tolist() == [-1] * 4 + [3, 1]
    query = rng.standard_normal((2, heads, dim)).astype(np.float16)
    meta = dict(block_tables=tables, context_lens=context_lens,
                query_start_loc=np.array([0, 1, 2], np.int32), scale=dim ** -0.5)
    for layer in range(2):
        k, v, _, _ = cache.layer(layer)
        got = kernels.paged_attention(cupy.asarray(query), k, v,
                                      **{n: cupy.asarray(a) if isinstance(a, np.ndarray) else a
                                         for n, a in meta.items()})
        host = [Int4Layer(cupy.asnumpy(x.rows), cupy.asnumpy(x.window),
                          cupy.asnumpy(x.window_slot), x.is_key, x.group) for x in (k, v)]
        want = cpu.paged_attention(query.astype(np.float32), *host, **meta)
        np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want, rtol=3e-3,
                                   atol=3e-3)
