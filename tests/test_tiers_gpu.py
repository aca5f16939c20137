"""On a GPU: the KV tiers' copy path over CuPy (the tier's own stream, pinned host buffers,
events ordering it around the compute) round trips pages bit for bit for fp16, fp8 and int4
caches, and the cuda engine gives the same tokens with a host and a disk tier as without.
Marked `gpu`; skipped without a CUDA device (run by tools/gpu_check.sh)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_helpers import run_all
from kvcore.cache.kv_cache import KVCache
from kvcore.cache.tiers import PageCopier
from kvcore.device import cuda_available
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.sampling import SamplingParams
from tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tiers"), seed=5, head_dim=64)


def device_blocks(cache: KVCache, block_id: int) -> bytes:
    import cupy  # type: ignore[import-not-found]

    return b"".join(cupy.asnumpy(a[block_id]).tobytes() for pair in zip(
        cache.key_caches, cache.value_caches, strict=True) for a in pair)


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "int4"])
def test_cupy_copy_path_round_trips_pages_bit_exact(dtype: str) -> None:
    import cupy

    from kvcore.cache.tiers.cuda_copy import CupyTierStreams

    cache = KVCache(2, 16, 16, 2, 64, dtype, "cuda",
                    num_window_slots=4 if dtype == "int4" else None)
    rng = np.random.default_rng(1)
    for array in (*cache.key_caches, *cache.value_caches):
        raw = array.view(cupy.uint8)
        raw[...] = cupy.asarray(rng.integers(0, 256, raw.shape, dtype=np.uint8))
    copier = PageCopier(cache, CupyTierStreams())
    pages = copier.gather([3, 7, 1]).wait()  # the writer's wait: the download's event
    assert isinstance(pages, np.ndarray)
    assert [row.tobytes() for row in pages] == [device_blocks(cache, b) for b in (3, 7, 1)]
    buffer = copier.host_buffer(3)  # pinned, as a load fills it
    buffer[...] = pages
    copier.scatter([0, 2, 4], buffer)
    cupy.cuda.get_current_stream().synchronize()  # the compute stream waited for the tier's
    assert [device_blocks(cache, b) for b in (0, 2, 4)] == [row.tobytes() for row in pages]


def test_cuda_engine_gives_the_same_tokens_with_tiers(model_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    system = rng.integers(3, 259, 48).tolist()
    prompts = [system + rng.integers(3, 259, 16).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**tiers: object) -> list[list[int]]:
        engine = Engine(engine_config(str(model_dir), device="cuda", block_size=16,
                                      num_blocks=16, max_num_seqs=2, **tiers))
        # every prompt twice: its pages come back
        done = [out.outputs[0].token_ids for out in run_all(engine, prompts * 2, params)]
        if tiers:
            stats = engine.stats().tiers
            assert stats is not None and sum(stats.hit_tokens.values()) > 0
        engine.close()
        return done

    assert run(kv_offload_size=1 << 24, kv_tier_dir=str(tmp_path)) == run()
