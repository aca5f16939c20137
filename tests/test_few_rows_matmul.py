"""The compiled few-rows matmul (kvcore.kernels.few_rows_numba) that the CPU forward uses for
2-16 rows: equal to NumPy's product within float32 rounding, and a row's result independent of
the other rows of the batch."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.kernels import cpu_numba
from kvcore.kernels.cpu_numba import FEW_ROWS_MAX, few_rows_matmul

pytestmark = pytest.mark.skipif(not cpu_numba.active(), reason="numba unavailable")


@pytest.mark.parametrize("num_rows", [2, 5, FEW_ROWS_MAX])
def test_equals_numpy(num_rows: int) -> None:
    rng = np.random.default_rng(num_rows)
    weight = rng.standard_normal((300, 96), dtype=np.float32)  # out 300: a partial last block
    x = rng.standard_normal((num_rows, 96), dtype=np.float32)
    out = few_rows_matmul(x, weight)
    assert out is not None and out.shape == (num_rows, 300) and out.dtype == np.float32
    np.testing.assert_allclose(out, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_rows_independent_of_batch() -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((200, 64), dtype=np.float32)
    x = rng.standard_normal((7, 64), dtype=np.float32)
    whole = few_rows_matmul(x, weight)
    part = few_rows_matmul(x[3:5], weight)
    assert whole is not None and part is not None
    assert np.array_equal(whole[3:5], part)  # bit for bit


def test_declines_what_it_does_not_take() -> None:
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((50, 32), dtype=np.float32)
    x = rng.standard_normal((4, 32), dtype=np.float32)
    assert few_rows_matmul(x[:1], weight) is None  # one row: the GEMV
    assert few_rows_matmul(np.zeros((FEW_ROWS_MAX + 1, 32), np.float32), weight) is None
    assert few_rows_matmul(x.astype(np.float64), weight.astype(np.float64)) is None
    assert few_rows_matmul(x, np.asfortranarray(weight)) is None
    # a non-contiguous x (a slice of columns) is taken: copied first
    wide = rng.standard_normal((4, 64), dtype=np.float32)
    out = few_rows_matmul(wide[:, :32], weight)
    assert out is not None
    np.testing.assert_allclose(out, wide[:, :32] @ weight.T, rtol=1e-4, atol=1e-4)
