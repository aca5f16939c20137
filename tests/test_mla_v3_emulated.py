"""The register-tile MLA kernel (mla_attention.cu: 64 query rows per block, cp.async double
buffering, mma.sync with S / O in registers, O split by latent columns over 8 warps), emulated
on the CPU, against the float64 oracle: the head counts of DeepSeek-V2-Lite / V3 (16, 64, 128)
and ones that cut the 64-row tiles, contexts crossing key tiles and partitions, fp16 / bf16 /
fp8 caches, rows wider than 576 (16-key tiles), block sizes that are not powers of two; and the
mutants the emulator must catch (a missing cp.async wait, a missing barrier between buffer
swaps, a wrong fragment index, a rescale vote that never rescales)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvcore.kernels.cuda.mla import mla_key_tile
from kvcore.kernels.cuda.ops import CudaOps

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402
from kernel_problems import BF16, mla_f64, mla_problem  # noqa: E402

TOL = {np.dtype(np.float16): 2e-3, BF16: 1.6e-2}


SM80_OPT_IN = 163 * 1024


def run(problem: dict, num_partitions: int | None = None, defines: tuple[str, ...] = (),
        seed: int = 0, smem_opt_in: int = 227 * 1024) -> np.ndarray:
    backend = EmuBackend(defines, order_seed=seed, num_sms=8, smem_opt_in=smem_opt_in)
    return CudaOps(backend).mla_paged_attention(**problem, num_partitions=num_partitions)


def close(out: np.ndarray, problem: dict) -> bool:
    tol = TOL[out.dtype]
    return bool(np.allclose(out.astype(np.float32), mla_f64(problem), rtol=tol, atol=tol))


SM90 = 227 * 1024
CASES = [
    # (H, kv_lora_rank, rope dim, block_size, context_lens, q_lens, dtypes, num_partitions,
    #  the device's shared-memory opt-in: sm_90 takes 64-key tiles at 576 wide, sm_80 32)
    (128, 512, 64, 16, [97, 33], [1, 1], "bf16", None, SM90),     # V3: 2 row tiles, swizzled
    (128, 512, 64, 16, [97, 33], [1, 1], "f16", 2, SM80_OPT_IN),  # V3 on sm_80: 32-key tiles
    (128, 512, 64, 16, [200], [1], "f16-fp8", 3, SM90),           # V3, fp8, split partitions
    (64, 512, 64, 64, [65, 64, 1], [1, 1, 1], "f16", 2, SM90),    # one row tile; tile edges
    (16, 512, 64, 16, [40, 9], [1, 9], "bf16-fp8", None, SM80_OPT_IN),  # V2-Lite: partial tile
    (16, 960, 64, 8, [37, 20], [1, 3], "f16", 2, SM90),           # width 1024: 16-key tiles
    (48, 128, 64, 12, [61, 30], [1, 4], "f16", 2, SM90),          # block size 12: division
    (20, 96, 32, 8, [45, 19], [7, 19], "bf16", None, SM90),       # prefill: tiles cut positions
]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"H{c[0]}r{c[1]}p{c[2]}b{c[3]}-{c[6]}-{c[8] // 1024}K")
def test_matches_the_float64_oracle(case: tuple) -> None:
    heads, rank, rope, bs, ctx, q_lens, dtypes, parts, opt_in = case
    rng = np.random.default_rng()
    kv_scale = 0.05 if dtypes.endswith("fp8") else 1.0
    problem = mla_problem(rng, ctx, q_lens, heads, rank, rope, bs, dtypes, kv_scale)
    out = run(problem, parts, smem_opt_in=opt_in)
    assert out.dtype == problem["query"].dtype and out.shape == mla_f64(problem).shape
    tol = TOL[out.dtype]
    np.testing.assert_allclose(out.astype(np.float32), mla_f64(problem), rtol=tol, atol=tol)


def test_key_tiles() -> None:
    assert mla_key_tile(576) == 64 and mla_key_tile(576, 2, SM80_OPT_IN) == 32
    assert mla_key_tile(576, 1, SM80_OPT_IN) == 64 and mla_key_tile(592) == 16
    assert mla_key_tile(80, 2, SM80_OPT_IN) == 64 and mla_key_tile(1024, 1) == 16


@pytest.fixture(scope="module")
def mutant_problem() -> dict:
    """Two decode rows over several key tiles and a prefill chunk beside them."""
    rng = np.random.default_rng(7)
    return mla_problem(rng, [70, 45, 23], [1, 1, 7], 16, 64, 16, 8, "f16")


def test_the_mutants_problem_passes_unchanged(mutant_problem: dict) -> None:
    assert close(run(mutant_problem, 2), mutant_problem)


@pytest.mark.parametrize("mutant", ["KVC_BREAK_WAIT", "KVC_BREAK_SYNC", "KVC_BREAK_FRAGMENT",
                                    "KVC_BREAK_LDMATRIX", "KVC_BREAK_TRANS"])
def test_mutants_fail(mutant_problem: dict, mutant: str) -> None:
    """A tile read before its cp.async wait (NaN until the copy completes), a buffer re-staged
    without the barrier between swaps, P's A fragment with rows g + 8 and keys 8-15 swapped:
    each gives wrong numbers (or a launch the emulator rejects)."""
    try:
        broken = run(mutant_problem, 2, (mutant,), seed=3)
    except RuntimeError as exc:  # the emulator refused the launch: caught too (not a build)
        assert "g++ failed" not in str(exc)
        return
    assert not close(broken, mutant_problem)


def test_rescale_vote_mutant_fails() -> None:
    """Whole sequences over 3-4 key tiles (one partition), so running maxima grow after the
    first tile: the kernel passes, and the mutant whose vote never rescales O does not."""
    problem = mla_problem(np.random.default_rng(11), [200, 130], [1, 5], 16, 64, 16, 8, "f16")
    assert close(run(problem, 1), problem)
    assert not close(run(problem, 1, ("KVC_BREAK_VOTE",)), problem)
