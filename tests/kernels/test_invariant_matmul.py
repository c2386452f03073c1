"""invariant_linear_triton: F.linear's values, and each row's result bit for bit the same whatever rows share its call
(--batch-invariant). On the CPU through the Triton interpreter, on the GPU in bf16 too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE, on_device
from kernel_device import linear_inputs as _inputs

from nvcli.kernels import invariant_matmul

linear = on_device(invariant_matmul.invariant_linear_triton)


@pytest.mark.parametrize("with_bias", [False, True])
def test_values_match_f_linear(with_bias: bool) -> None:
    """N and K not multiples of the tiles (masked last tiles), rows past one row block."""
    x, w, b = _inputs(70, 150, 80, seed=1)
    bias = b if with_bias else None
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-4)


def test_leading_dims_and_empty() -> None:
    x, w, _ = _inputs(6, 40, 64, seed=2)
    y = linear(x.view(2, 3, 64), w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.view(6, 40), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert linear(x[:0], w).shape == (0, 40)


@pytest.mark.parametrize("tiles", [invariant_matmul.WIDE, invariant_matmul.NARROW, invariant_matmul.VOCAB])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_a_row_does_not_depend_on_its_neighbours(dtype: torch.dtype, tiles: invariant_matmul.Tiles) -> None:
    """One row alone, at another place among other rows, in the second row block: the same bits. (cuBLAS and the
    skinny GEMM change their tiles and K splits with the row count; this GEMM must not.)"""
    x, w, b = _inputs(130, 200, 96, seed=3, dtype=dtype)
    alone = linear(x[5:6], w, b, tiles)[0]
    for rows in (x[:9], x[3:7], torch.cat([x[100:], x[5:6]]), x):
        i = next(j for j in range(rows.shape[0]) if torch.equal(rows[j], x[5]))
        assert torch.equal(linear(rows, w, b, tiles)[i], alone), f"row moved among {rows.shape[0]} rows"

