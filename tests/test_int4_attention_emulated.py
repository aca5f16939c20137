"""The register-tile decode and prefill kernels over an int4 cache, run on the CPU by the
emulation harness, against the float64 oracle over the dequantized cache (kvcore.cache.int4):
sealed int4 blocks and fp16 window blocks mixed per block, GQA groups, contexts crossing tiles
and partitions, block sizes 16 and 32, head_dim 64 and 128."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvcore.cache import int4
from kvcore.kernels.cuda.ops import CudaOps

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402
from int4_problems import int4_f64, int4_problem  # noqa: E402

TOL = {"f16": 3e-3, "bf16": 2e-2}


def ops(defines: tuple[str, ...] = (), seed: int = 0, num_sms: int = 8) -> CudaOps:
    return CudaOps(EmuBackend(defines, order_seed=seed, num_sms=num_sms))


def check(case: tuple, q_lens: list[int] | None = None, sealed_share: float = 0.7) -> None:
    heads, kv_heads, dim, bs, ctx, act, group, parts, window = case
    rng = np.random.default_rng()
    kwargs, dense = int4_problem(rng, ctx, q_lens or [1] * len(ctx), heads, kv_heads, dim, bs,
                                 act, group, sealed_share)
    out = ops().paged_attention_int4(**kwargs, sliding_window=window,
                                     **({} if parts is None else {"partition_tokens": parts}))
    want = int4_f64(dense, window)
    assert out.dtype == kwargs["query"].dtype and out.shape == want.shape
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=TOL[act], atol=TOL[act])


DECODE_CASES = [
    # (H, Hkv, D, block_size, context_lens, activation, int4 group, partition_tokens, window)
    (8, 2, 64, 16, [1, 17, 100, 300], "f16", 32, None, None),  # GQA 4, tiles of 4 blocks
    (16, 2, 128, 32, [513, 64, 40], "f16", 32, 192, None),      # GQA 8, split KV
    (4, 4, 64, 16, [200, 33], "bf16", 64, 32, 50),              # GQA 1, one value group, window
    (32, 1, 128, 16, [150, 9], "f16", 64, None, 70),           # GQA 32: two row blocks
    (6, 2, 128, 32, [700, 5], "bf16", 32, 192, None),            # GQA 3, bf16
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"H{c[0]}kv{c[1]}D{c[2]}bs{c[3]}-{c[5]}-g{c[6]}")
def test_int4_decode(case: tuple) -> None:
    check(case)


def test_int4_decode_tile_over_nine_blocks() -> None:
    """Block size 8 and a window start 7 keys into a block: the first 64-key tile touches 9
    blocks, every full one sealed (the most key scales a tile stages)."""
    check((8, 2, 64, 8, [300, 90], "f16", 32, None, 101), sealed_share=1.0)


PREFILL_CASES = [
    # (H, Hkv, D, block_size, context_lens, activation, group, partitions, window), q_lens
    ((8, 2, 64, 16, [150, 40, 77], "f16", 32, None, None), [70, 40, 1]),  # chunk after prefix
    ((6, 2, 128, 32, [130, 20], "bf16", 32, None, 45), [33, 20]),         # window, GQA 3
    ((16, 1, 64, 16, [90], "f16", 64, None, None), [90]),                 # GQA 16, one group
]


@pytest.mark.parametrize("case,q_lens", PREFILL_CASES,
                         ids=lambda c: "-".join(map(str, c[:6])) if isinstance(c, tuple) else "")
def test_int4_prefill(case: tuple, q_lens: list[int]) -> None:
    check(case, q_lens)


def test_int4_device_metadata_and_thread_order() -> None:
    """Grids from the shapes alone (device metadata) and another thread order: same output."""
    rng = np.random.default_rng()
    kwargs, dense = int4_problem(rng, [200, 45], [1, 1], 8, 2, 64, 16, "f16", 32)
    outs = [ops(seed=seed).paged_attention_int4(**kwargs, sliding_window=None,
                                                partition_tokens=112, host_metadata=host)
            for seed, host in ((0, True), (1, False))]
    assert np.array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0].astype(np.float32), int4_f64(dense), rtol=3e-3,
                               atol=3e-3)


@pytest.mark.parametrize("q_lens", [[1, 1], [40, 41]], ids=["decode", "prefill"])
@pytest.mark.parametrize("defines", [("KVC_BREAK_WAIT",), ("KVC_BREAK_SYNC",),
                                     ("KVC_BREAK_NIBBLE",)])
def test_broken_int4_attention_fails(defines: tuple[str, ...], q_lens: list[int]) -> None:
    """The int4 variants' mutants: a tile unpacked before its copies land, a buffer staged
    again while it is still read, the wrong nibbles paired (decode: in the fragments, prefill:
    in the unpack into the tile)."""
    if defines == ("KVC_BREAK_SYNC",) and q_lens[0] > 1:
        pytest.skip("prefill reads the block records only before its unpack barrier, so the "
                    "stage's own barrier already orders the buffer's reuse: not a bug there")
    rng = np.random.default_rng()
    kwargs, dense = int4_problem(rng, [300, 41], q_lens, 8, 2, 64, 16, "f16", 32, 1.0)
    want = int4_f64(dense)
    try:
        broken = ops(defines).paged_attention_int4(**kwargs, sliding_window=None)
    except RuntimeError as exc:  # the emulator saw a copy land on a destination in use
        assert "cp.async" in str(exc)
        return
    assert not np.allclose(broken.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_int4_attention_checks_arguments() -> None:
    rng = np.random.default_rng()
    kwargs, _ = int4_problem(rng, [40], [1], 4, 2, 64, 16, "f16", 32)
    with pytest.raises(ValueError, match="float16 or bfloat16 activations"):
        ops().paged_attention_int4(**dict(kwargs, query=kwargs["query"].astype(np.float32)),
                                   sliding_window=None)
    with pytest.raises(ValueError, match="window_slot must be int32"):
        ops().paged_attention_int4(**dict(kwargs, window_slot=kwargs["window_slot"]
                                          .astype(np.int64)), sliding_window=None)
    with pytest.raises(ValueError, match="v_cache must be uint8"):
        ops().paged_attention_int4(**dict(kwargs, group=64), sliding_window=None)
    small, _ = int4_problem(rng, [40], [1], 4, 2, 64, 4, "f16", 32)
    with pytest.raises(ValueError, match="power of two >= 8"):
        ops().paged_attention_int4(**small, sliding_window=None)


@dataclass(frozen=True, slots=True)
class Layer:
    """The fields of the engine's int4 layer (kernels.cpu.kv_int4.Int4Layer) the CUDA path reads."""

    rows: Any
    window: Any
    window_slot: Any
    is_key: bool
    group: int


def test_engine_seam_takes_int4_layers() -> None:
    """paged_attention / reshape_and_cache given int4 layers, and the per-layer seal, as
    kvcore.kernels dispatches them to kvcore.kernels.cuda."""
    rng = np.random.default_rng()
    kwargs, dense = int4_problem(rng, [100, 35], [1, 1], 8, 2, 64, 16, "f16", 32)
    k = Layer(kwargs["k_cache"], kwargs["k_window"], kwargs["window_slot"], True, 32)
    v = Layer(kwargs["v_cache"], kwargs["v_window"], kwargs["window_slot"], False, 32)
    meta = {name: kwargs[name] for name in ("block_tables", "context_lens", "query_start_loc")}
    out = ops().paged_attention(kwargs["query"], k, v, **meta, scale=kwargs["scale"])
    np.testing.assert_allclose(out.astype(np.float32), int4_f64(dense), rtol=3e-3, atol=3e-3)
    # the write: sequence 1's token 35 lands in its third block's window slot
    block = int(kwargs["block_tables"][1, 2])
    slot = int(kwargs["window_slot"][block])
    assert slot >= 0  # a partial block stays in the window
    key, value = (rng.standard_normal((1, 2, 64)).astype(np.float16) for _ in range(2))
    ops().reshape_and_cache(key, value, k, v, np.array([block * 16 + 3], np.int64))
    assert np.array_equal(k.window[slot, 3], key[0]) and np.array_equal(v.window[slot, 3],
                                                                          value[0])
    # the seal of that slot into the block's rows, one layer
    k.window[slot], v.window[slot] = (rng.standard_normal((16, 2, 64)).astype(np.float16)
                                      for _ in range(2))
    ops().seal_int4_blocks(k.window, v.window, k.rows, v.rows, np.array([block]),
                           np.array([slot]), 32)
    assert k.rows[block].tobytes() == int4.quantize_key_block(k.window[slot]).tobytes()
    assert v.rows[block].tobytes() == int4.quantize_value_block(v.window[slot], 32).tobytes()
    with pytest.raises(ValueError, match="no k_scale"):
        ops().paged_attention(kwargs["query"], k, v, **meta, scale=kwargs["scale"], k_scale=2.0)
