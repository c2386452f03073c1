from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.kernels.ops import use_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * d] -> [n, d]
        if use_triton(x):
            from nvcli.kernels.activation import silu_and_mul_triton

            return silu_and_mul_triton(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
