"""`--kv-cache-dtype int4` on the GPU path, with every kernel emulated: the engine over the fp16
model (HalfLlamaModel) with an int4 cache whose writes, seals, window copies and attention run
the CUDA kernels gives the tokens of the same engine whose int4 operations run the CPU kernels
and whose attention reads blocks as the CUDA kernels do (the NumPy oracle of their rule: a
block in fp16 while it holds a window slot), with blocks sealed behind the window, prefix-cache
hits and n > 1 forks that copy an open block; and the numba attention agrees with the CUDA
kernels on a cache state where the two rules read every block alike."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcore.kernels as kernels
from int4_engine_runs import attention_by_table, run
from kvcore.cache.int4_window import COPY, SEAL
from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.engine.setup import int4_group
from kvcore.kernels import cpu
from kvcore.kernels.cpu import kv_int4, kv_int4_blocks
from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.kernels.cuda.ops import CudaOps
from kvcore.model import load_model
from kvcore.model.half_llama import HalfLlamaModel
from tiny_model import make_tiny_model

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402

BLOCK_SIZE = 8  # the CUDA int4 kernels' smallest block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with head_dim 64 (GQA 4 / 2): a width the CUDA int4 kernels compile for."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_d64"), seed=3, head_dim=64)


def int4_engine(model_dir: Path) -> Engine:
    config = engine_config(str(model_dir), block_size=BLOCK_SIZE, num_blocks=96,
                           cache_dtype="int4", int4_window_tokens=4, max_num_seqs=8,
                           max_num_batched_tokens=24, enable_prefix_caching=True, seed=0)
    return Engine(config, model=load_model(model_dir, device="cpu", half=True))


def route_int4_kernels_through_emulation(monkeypatch: pytest.MonkeyPatch,
                                         int4_on_cpu: bool = False) -> list[str]:
    """Every kernel through the emulated CUDA kernels; `int4_on_cpu`: the int4 cache's own
    (writes, seals, window copies, attention) through the CPU path's instead, so both runs
    feed them bit-identical K/V (a nibble is a coarse step: a last-bit difference upstream
    can move one). Returns a list that records each int4 seal launch."""
    from graph_helpers import route_kernels_through_emulation

    route_kernels_through_emulation(monkeypatch)
    impl = kernels._cuda()
    ops = impl.rms_norm.__self__  # the CudaOps the routing built
    seals: list[str] = []

    def seal_blocks(k_rows: list, v_rows: list, k_windows: list, v_windows: list,
                    pairs: np.ndarray, group: int) -> None:
        seals.append("cpu" if int4_on_cpu else "emulated")
        if not int4_on_cpu:
            ops.seal_blocks(k_rows, v_rows, k_windows, v_windows, pairs, group)
            return
        for layer in zip(k_windows, v_windows, k_rows, v_rows, strict=True):
            kv_int4_blocks.seal_blocks(layer[0].view("uint16"), layer[1].view("uint16"), layer[2],
                                       layer[3], pairs[:, 0].copy(), pairs[:, 1].copy(), group)
    impl.seal_blocks = seal_blocks
    if int4_on_cpu:
        emulated_write, emulated_attention = impl.reshape_and_cache, impl.paged_attention

        def write(key: np.ndarray, value: np.ndarray, k: Any, v: Any, slots: Any,
                  *scales: float) -> None:
            if not isinstance(k, Int4Layer):
                return emulated_write(key, value, k, v, slots, *scales)  # type: ignore[no-any-return]
            kv_int4.reshape_and_cache(key, value, k, v, np.asarray(slots))

        def attention(query: np.ndarray, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(k, Int4Layer):
                return emulated_attention(query, k, v, *args, **kwargs)
            out = attention_by_table(query.astype(np.float32), k, v, *args, **kwargs)
            return out.astype(query.dtype)
        impl.reshape_and_cache, impl.paged_attention = write, attention
        impl.copy_blocks = cpu.copy_blocks
    return seals


def test_engine_int4_on_emulated_cuda_equals_the_cpu_path(model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        seals = route_int4_kernels_through_emulation(patch, int4_on_cpu=True)
        want, cpu_ops = run(int4_engine(model_dir))
        assert seals and set(seals) == {"cpu"}
    seals = route_int4_kernels_through_emulation(monkeypatch)
    engine = int4_engine(model_dir)
    assert engine.kv_cache.dtype == "int4" and engine.kv_cache.int4_group == 32
    got, gpu_ops = run(engine)
    assert set(seals) == {"emulated"}
    assert got == want
    assert [len(t) for t in got] == [12] * 4 and got[2] == got[3]  # greedy forks agree
    assert gpu_ops == cpu_ops  # the same slot moves, seals and copies on both paths
    assert sum(kind == SEAL for kind, _, _ in gpu_ops) >= 8
    assert any(kind == COPY for kind, _, _ in gpu_ops)  # the forks copied an open block
    assert engine.kv.num_prefix_hits >= 24  # the second prompt read the first's int4 blocks


def test_cpu_and_emulated_cuda_int4_attention_agree(model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One cache state, as an engine leaves it mid-run (sealed blocks and window blocks) with a
    window of one block: each decode row's own block in its slot, every earlier one sealed (the
    two rules read every block alike). The numba attention over its Int4Layers and the
    emulated CUDA kernels give one answer."""
    rng = np.random.default_rng(5)
    config = ModelConfig.from_dir(model_dir)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    group = int4_group(config, BLOCK_SIZE, "cuda")
    num_blocks, num_slots = 12, 6
    cache = KVCache(1, num_blocks, BLOCK_SIZE, kv_heads, dim, "int4", num_window_slots=num_slots,
                    window_tokens=BLOCK_SIZE, int4_group=group)
    k, v, _, _ = cache.layer(0)
    tables = np.array([[4, 9, 1, 7, 0, 0], [2, 11, 5, 0, 0, 0]], np.int32)  # (S, max_blocks)
    context_lens = np.array([29, 20], np.int32)
    window = {7: 0, 5: 1}  # the partial last blocks
    for s, ctx in enumerate(context_lens.tolist()):
        for i in range(-(-ctx // BLOCK_SIZE)):
            block = int(tables[s, i])
            kv = rng.standard_normal((2, BLOCK_SIZE, kv_heads, dim)).astype(np.float16)
            slot = window.get(block, 5)  # sealed blocks pass through scratch slot 5
            k.window[slot], v.window[slot] = kv[0] * 2, kv[1]
            if block not in window:
                kernels.seal_int4_blocks(k.window, v.window, k.rows, v.rows,
                                         np.array([block]), np.array([slot]), group)
    for block, slot in window.items():
        cache.window_slot[block] = slot
    query = rng.standard_normal((2, heads, dim)).astype(np.float16)  # one decode row each
    meta = dict(block_tables=tables, context_lens=context_lens,
                query_start_loc=np.array([0, 1, 2], np.int32), scale=dim ** -0.5)
    want = cpu.paged_attention(query.astype(np.float32), k, v, **meta)
    ops = CudaOps(EmuBackend())
    got = ops.paged_attention(query, Int4Layer(k.rows, k.window, k.window_slot, True, group),
                              v, **meta)
    assert isinstance(got, np.ndarray) and got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=3e-3, atol=3e-3)


def test_graphed_decode_with_an_int4_cache_equals_eager(model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graphs of decode steps (the stand-in capturer) over an int4 cache: the graphs read
    the window_slot table and windows that the window operations update in place between
    replays, so the tokens are the eager run's."""
    from graph_helpers import StandInCapturer

    route_int4_kernels_through_emulation(monkeypatch)
    want, _ = run(int4_engine(model_dir))
    engine = int4_engine(model_dir)
    assert isinstance(engine.model, HalfLlamaModel)
    graphs = engine.model.enable_cuda_graphs(8, 256, BLOCK_SIZE, StandInCapturer())
    got, _ = run(engine)
    assert got == want
    assert graphs.num_replays >= 20
