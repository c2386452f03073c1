"""rms_norm_triton against the torch RMSNorm layer (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import on_device

from nvcli.kernels import rms_norm

rms_norm_triton = on_device(rms_norm.rms_norm_triton)


def _ref(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return w * normed, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_2d(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(dtype)  # hidden not a power of two
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    res = torch.randn(5, 96, generator=gen).to(dtype) if with_residual else None
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref_out, ref_res = _ref(x, w, 1e-6, res)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)


def test_rms_norm_strided_heads() -> None:
    """Per-head norm on a strided [tokens, heads, head_dim] view of a fused qkv tensor."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 8 * 32, generator=gen)
    q = qkv[:, : 4 * 32].view(3, 4, 32)
    w = torch.randn(32, generator=gen)
    out, _ = rms_norm_triton(q, w, 1e-6)
    ref_out, _ = _ref(q, w, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_row_rstd_matches_the_norm() -> None:
    """row_rstd_triton: each row's 1 / RMS as RMSNorm computes it (the deferred norm's precomputed row scale), for
    rows whose RMS differ by 64x (several rows per program, the last one partial) and a hidden size that is not a power of two; no rows, no launch."""
    from nvcli.models.layers.norm import row_rstd

    row_rstd_triton = on_device(rms_norm.row_rstd_triton)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, 100, generator=gen) * torch.logspace(-1, 0.8, 19)[:, None]  # 19: a partial program
    got = row_rstd_triton(x, 1e-6)
    assert got.shape == (19,) and got.dtype == torch.float32
    torch.testing.assert_close(got, row_rstd(x, 1e-6).squeeze(-1), atol=0, rtol=1e-5)
    assert row_rstd_triton(torch.zeros(0, 100), 1e-6).shape == (0,)
