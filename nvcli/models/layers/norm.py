"""RMSNorm with the residual add fused in (one read of the hidden states instead of two)."""

from __future__ import annotations

import torch
from torch import nn

from nvcli.kernels.ops import use_triton


def row_rstd(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., 1] float32: 1 / RMS of each row (last dimension), as RMSNorm computes it."""
    x = rows.float()
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def row_rstd_vector(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows] float32: `row_rstd` of rows [rows, hidden] in one pass (a Triton kernel on the GPU). The deferred norm
    passes it as a precomputed row scale (`row_scale`) where several programs per row would each read the row."""
    if use_triton(rows):
        from nvcli.kernels.rms_norm import row_rstd_triton

        return row_rstd_triton(rows, eps)
    return row_rstd(rows, eps).squeeze(-1)


def row_scale(scale_rows: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows, 1] float32 row scale of the deferred norm from its rows [rows, hidden] or from `row_rstd_vector`'s
    precomputed [rows] (the kernels' `scale_rows` takes either, see kernels/rms_norm.row_scale_args)."""
    return scale_rows[:, None].float() if scale_rows.dim() == 1 else row_rstd(scale_rows, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * row_rstd(x, self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from nvcli.kernels.rms_norm import rms_norm_triton

            out, new_residual = rms_norm_triton(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        x = (x.float() + residual.float()).to(x.dtype)
        return self._norm(x), x
