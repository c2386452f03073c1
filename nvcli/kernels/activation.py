"""SiLU(gate) * up in one pass over the fused gate_up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.pdl import launch_kwargs, pdl_start, use_pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < D
    gate = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row.to(tl.int64) * stride_x + D + col, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # rounded like torch's F.silu in the model dtype
    tl.store(out_ptr + row.to(tl.int64) * stride_o + col, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    n, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    pdl = use_pdl(x, n)
    _silu_and_mul_kernel[(n, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block, PDL=pdl,
                                                      num_warps=4, **launch_kwargs(pdl))
    return out
