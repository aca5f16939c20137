"""The quantized-weight kernels against their NumPy reference, on both instruction-set paths the
CPU has (AVX2 forced where VNNI is present), at every shape the models use, odd sizes too."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.kernels.cpu import quant
from kvcore.kernels.cpu.quant import FORMATS, QUANTIZERS, dequantize, dequantize_rows, linear
from quant_reference import reference_linear

# the CPU's paths: a path it lacks is never run (it would fault), so it is skipped here
PATHS = quant.AVAILABLE_ISAS
# (out_features, in_features): SmolLM2-135M's q/k/v fused, o, gate/up fused, down; the tiny test
# model's; and odd sizes (rows not a multiple of the tile, K not a multiple of 64 or of 32)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (128, 64), (64, 128), (518, 64),
          (37, 96), (101, 200), (3, 33)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 37]

pytestmark = pytest.mark.skipif(not PATHS, reason="the CPU has neither AVX2 nor AVX-512 VNNI")


def _check(x: np.ndarray, weight: quant.QuantizedWeight, isa: str) -> None:
    out = linear(x, weight, isa)
    expected = reference_linear(x, weight)
    assert out.shape == expected.shape and out.dtype == np.float32
    # integer dot products are exact; what is left is float32 scaling and block-sum rounding
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5 * np.abs(expected).max() + 1e-30)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_match_reference_every_shape(isa: str, fmt: str) -> None:
    rng = np.random.default_rng([FORMATS.index(fmt), len(isa)])
    for n, k in SHAPES:
        weight = QUANTIZERS[fmt](rng.standard_normal((n, k)).astype(np.float32))
        for rows in ROWS if n * k <= 600_000 else (1, 5, 8):
            _check(rng.standard_normal((rows, k)).astype(np.float32) * 3, weight, isa)


@pytest.mark.parametrize("isa", PATHS)
def test_large_rows_and_lm_head_shapes(isa: str) -> None:
    """Prefill (M = 256) and an LM-head-sized matrix (many tiles over the threads)."""
    rng = np.random.default_rng(7)
    for fmt in FORMATS:
        weight = QUANTIZERS[fmt](rng.standard_normal((576, 576)).astype(np.float32))
        _check(rng.standard_normal((256, 576)).astype(np.float32), weight, isa)
        head = QUANTIZERS[fmt](rng.standard_normal((4099, 576)).astype(np.float32))
        _check(rng.standard_normal((3, 576)).astype(np.float32), head, isa)


def test_quantized_product_close_to_float() -> None:
    """The formats approximate the float product (int8 ~1%, q4 ~10% of the output scale)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 576)).astype(np.float32)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    exact = x @ w.T
    for fmt, tol in (("int8", 0.03), ("q8", 0.03), ("q4", 0.2)):
        out = linear(x, QUANTIZERS[fmt](w))
        assert np.abs(out - exact).max() < tol * np.abs(exact).max(), fmt


def test_zero_rows_and_zero_weights() -> None:
    weight = QUANTIZERS["q4"](np.zeros((20, 64), np.float32))
    assert np.all(linear(np.ones((2, 64), np.float32), weight) == 0)
    assert np.all(linear(np.zeros((3, 64), np.float32), QUANTIZERS["int8"](
        np.ones((20, 64), np.float32))) == 0)
    assert linear(np.zeros((0, 64), np.float32), weight).shape == (0, 20)


def test_dequantize_rows_gathers_and_round_trips() -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((50, 70)).astype(np.float32)
    for fmt in FORMATS:
        weight = QUANTIZERS[fmt](w)
        full = dequantize(weight)
        assert full.shape == (50, 70)
        rows = np.array([3, 0, 49, 3])
        np.testing.assert_array_equal(dequantize_rows(weight, rows), full[rows])
        np.testing.assert_allclose(full, w, atol=0.2 * np.abs(w).max())


def test_bad_input_shape_is_refused() -> None:
    weight = QUANTIZERS["int8"](np.ones((16, 64), np.float32))
    with pytest.raises(ValueError, match=r"x must have shape \(T, 64\)"):
        linear(np.ones((2, 63), np.float32), weight)


def test_forced_isa_the_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_QUANT_ISA", "avx2")
    if "avx2" in PATHS:
        assert quant.cpu_isa() == "avx2"
    else:
        with pytest.raises(quant.QuantizationError, match="lacks"):
            quant.cpu_isa()
    lacking = [isa for isa in quant.ISA_NAMES if isa not in PATHS]
    for isa in lacking:
        with pytest.raises(quant.QuantizationError, match="this CPU has only"):
            linear(np.ones((1, 64), np.float32), QUANTIZERS["int8"](np.ones((16, 64))), isa)
    monkeypatch.setenv("KVCORE_QUANT_ISA", "sse")
    with pytest.raises(quant.QuantizationError, match="KVCORE_QUANT_ISA"):
        quant.cpu_isa()
