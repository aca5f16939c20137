"""GraphedDecode's host-side logic on the CPU: bucket choice, padding, static-buffer copies,
replays that read only the static buffers, output slicing and eager fallbacks.

The half model runs through the emulated CUDA kernels (NumPy fp16 standing in for CuPy), and a
CPU stand-in capturer plays the CUDA graph: `capture` records the closure, `replay` re-runs it
into the captured output array. The closure sees the step only through the static buffers, so a
field that is not copied (or copied wrongly padded) changes the replayed logits or the cache.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvcore.cache.kv_cache import KVCache
from kvcore.model import BatchInput, load_model
from kvcore.model.cuda_graph import capture_sizes, is_pure_decode
from kvcore.model.half_llama import HalfLlamaModel

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from graph_helpers import StandInCapturer, route_kernels_through_emulation  # noqa: E402

BLOCK_SIZE = 4


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    route_kernels_through_emulation(monkeypatch)




def test_capture_sizes() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert capture_sizes(256) == capture_sizes(1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        capture_sizes(0)


def test_buckets_and_what_runs_eagerly(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, device="cpu", half=True)
    graphs = model.enable_cuda_graphs(max_num_seqs=8, max_model_len=40, block_size=BLOCK_SIZE,
                                      capturer=StandInCapturer())
    assert graphs.sizes == (1, 2, 4, 8) and graphs.max_blocks == 10
    tables = [[1, 2, 3], [4, 5], [6], [7], [8], [9], [10], [11], [12]]

    def decode(num_seqs: int, computed: int = 4, sample: list[bool] | None = None) -> BatchInput:
        return BatchInput.build([[5]] * num_seqs, [computed % 4] * num_seqs, tables[:num_seqs],
                                BLOCK_SIZE, sample)

    assert [graphs.bucket(decode(n)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.bucket(decode(9)) is None  # more sequences than the largest size
    assert graphs.bucket(decode(2, sample=[True, False])) is None  # a row without logits
    prefill = BatchInput.build([[5, 6, 7]], [0], tables[:1], BLOCK_SIZE)
    mixed = BatchInput.build([[5, 6], [7]], [0, 3], tables[:2], BLOCK_SIZE)
    assert not is_pure_decode(prefill) and not is_pure_decode(mixed)
    assert graphs.bucket(prefill) is None and graphs.bucket(mixed) is None
    wide = BatchInput.build([[5]], [44], [list(range(1, 13))], BLOCK_SIZE)  # 12 > 10 blocks
    assert graphs.bucket(wide) is None
    far = BatchInput.build([[5]], [39], [list(range(1, 11))], BLOCK_SIZE)
    assert graphs.bucket(far) == 1
    beyond = BatchInput.build([[5]], [40], [list(range(1, 12))], BLOCK_SIZE)
    assert graphs.bucket(beyond) is None  # position 40 >= max_model_len
    # growing the rope tables moves them: captured graphs would read freed memory
    graphs._captured[1] = SimpleNamespace()  # type: ignore[assignment]
    model.ensure_rope(10_000)
    assert not graphs._captured


def run_steps(model: HalfLlamaModel, model_dir: Path, cache_dtype: str
              ) -> tuple[list[np.ndarray], KVCache]:
    """Six sequences: prefills (one beside decodes), then decode steps of 5, 3, 2, 1 and 3
    sequences (4 sequences at most are graphed)."""
    c = model.config
    cache = KVCache(c.num_layers, 40, BLOCK_SIZE, c.num_kv_heads, c.head_dim, cache_dtype)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, c.vocab_size, size=n).tolist() for n in (9, 3, 14, 6, 1, 5)]
    # block 0 belongs to nobody: padding rows read it, and nothing may ever write it
    tables = [list(range(1 + 6 * s, 7 + 6 * s)) for s in range(6)]
    lens = [len(p) for p in prompts]
    logits: list[np.ndarray] = []

    def step(seqs: list[int], tokens: list[list[int]]) -> None:
        batch = BatchInput.build(tokens, [lens[s] for s in seqs], [tables[s] for s in seqs],
                                 BLOCK_SIZE)
        out = model.forward(batch, cache)
        logits.append(out)
        for s, t in zip(seqs, tokens, strict=True):
            lens[s] += len(t)
        for s, row in zip(seqs, out, strict=True):
            prompts[s].append(int(np.argmax(row)))
        lens[:] = [min(n, len(prompts[s]) - 1) for s, n in enumerate(lens)]

    lens[:] = [0] * 6
    step([0, 1, 2, 3, 4], [prompts[s][:] for s in range(5)])  # prefill: eager
    for seqs in ([0, 1, 2, 3, 4], [0, 2, 4], [1, 3], [2], [4, 0, 3]):
        step(seqs, [[prompts[s][-1]] for s in seqs])
    # a mixed step: sequence 5's prompt beside two decodes (eager), then a graphed decode again
    step([5, 1, 2], [prompts[5][:], [prompts[1][-1]], [prompts[2][-1]]])
    step([5, 1], [[prompts[s][-1]] for s in (5, 1)])
    return logits, cache


@pytest.mark.parametrize("cache_dtype", ["fp16", "fp8"])
def test_graphed_decode_equals_eager(tiny_model_dir: Path, cache_dtype: str,
                                     emulated: None) -> None:
    eager = load_model(tiny_model_dir, device="cpu", half=True)
    want, want_cache = run_steps(eager, tiny_model_dir, cache_dtype)
    model = load_model(tiny_model_dir, device="cpu", half=True)
    capturer = StandInCapturer()
    # max_model_len 1024: padded tables of 256 blocks, two decode partitions plus the reduction
    graphs = model.enable_cuda_graphs(max_num_seqs=4, max_model_len=1024, block_size=BLOCK_SIZE,
                                      capturer=capturer)
    got, cache = run_steps(model, tiny_model_dir, cache_dtype)
    # graphed: the decodes of 3, 2, 1, 3 and 2 sequences (buckets 4, 2, 1, 4, 2); eager: the
    # prefill, the 5-sequence decode (over the largest size) and the mixed step
    assert graphs.num_replays == 5 and capturer.num_captures == 3
    assert sorted(graphs._captured) == [1, 2, 4]
    assert capturer.num_uploads == 5 * 5  # one copy per changing array per replay
    # the emulated kernels and NumPy's fp16 matmul compute each row on its own, so padding the
    # batch (and the block tables to 256 columns: two decode partitions) changes no bit
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g, w)
    for a, b in zip(cache.key_caches + cache.value_caches,
                    want_cache.key_caches + want_cache.value_caches, strict=True):
        assert not a[0].view(np.uint8).any()  # block 0: padding rows read it, nobody writes it
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_replay_after_new_inputs_and_a_new_cache(tiny_model_dir: Path, emulated: None) -> None:
    """The same graph replayed for different sequences gives each step's eager logits; a
    different KVCache drops the graphs (they hold the old cache's addresses) and recaptures."""
    model = load_model(tiny_model_dir, device="cpu", half=True)
    eager = load_model(tiny_model_dir, device="cpu", half=True)
    capturer = StandInCapturer()
    graphs = model.enable_cuda_graphs(4, 64, BLOCK_SIZE, capturer)
    c = model.config
    caches = [KVCache(c.num_layers, 12, BLOCK_SIZE, c.num_kv_heads, c.head_dim, "fp16")
              for _ in range(3)]
    rng = np.random.default_rng(5)
    for key, value in zip(caches[0].key_caches, caches[0].value_caches, strict=True):
        key[...] = rng.standard_normal(key.shape)  # a random filled cache
        value[...] = rng.standard_normal(value.shape)
    for dst in (caches[1], caches[2]):
        for i in range(c.num_layers):
            dst.key_caches[i][...] = caches[0].key_caches[i]
            dst.value_caches[i][...] = caches[0].value_caches[i]
    cases = [([[7], [9], [11]], [5, 9, 2], [[1, 2], [3, 4, 5], [6]]),
             ([[40], [41]], [6, 1], [[7, 8], [9]]),
             ([[13], [17], [19]], [10, 3, 7], [[10, 11, 1], [2], [3, 4]])]
    for tokens, computed, tables in cases:
        batch = BatchInput.build(tokens, computed, tables, BLOCK_SIZE)
        got = model.forward(batch, caches[1])
        want = eager.forward(batch, caches[2])
        np.testing.assert_array_equal(got, want)
    assert capturer.num_captures == 2 and graphs.num_replays == 3  # sizes 4 and 2
    batch = BatchInput.build(*cases[0][:2], cases[0][2], BLOCK_SIZE)
    model.forward(batch, caches[0])
    assert capturer.num_captures == 3 and list(graphs._captured) == [4]


class FailingCapturer(StandInCapturer):
    def capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        self.num_captures += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_runs_eagerly_from_then_on(tiny_model_dir: Path,
                                                    emulated: None) -> None:
    model = load_model(tiny_model_dir, device="cpu", half=True)
    eager = load_model(tiny_model_dir, device="cpu", half=True)
    capturer = FailingCapturer()
    graphs = model.enable_cuda_graphs(4, 64, BLOCK_SIZE, capturer)
    c = model.config
    caches = [KVCache(c.num_layers, 8, BLOCK_SIZE, c.num_kv_heads, c.head_dim, "fp16")
              for _ in range(2)]
    batch = BatchInput.build([[7], [9]], [0, 0], [[1], [2]], BLOCK_SIZE)
    with capture_logs() as logs:
        for _ in range(2):
            np.testing.assert_array_equal(model.forward(batch, caches[0]),
                                          eager.forward(batch, caches[1]))
    assert graphs.failed and capturer.num_captures == 1 and graphs.num_replays == 0
    assert [e["event"] for e in logs] == ["cuda graph capture failed; decode steps run eagerly"]
