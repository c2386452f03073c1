from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.kernels.ops import use_triton
from nvcli.models.layers.norm import row_scale


class SiluAndMul(nn.Module):
    def forward(
        self,
        x: torch.Tensor,  # [n, 2 * d]
        scale_rows: torch.Tensor | None = None,  # [n, hidden] or [n] precomputed: gate and up times each row's 1 / RMS
        scale_eps: float = 1e-6,
    ) -> torch.Tensor:  # [n, d]
        if use_triton(x):
            from nvcli.kernels.activation import silu_and_mul_triton

            return silu_and_mul_triton(x, scale_rows, scale_eps)
        if scale_rows is not None:
            x = (x.float() * row_scale(scale_rows, scale_eps)).to(x.dtype)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
