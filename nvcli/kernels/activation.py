"""SiLU(gate) * up in one pass over the fused gate_up projection output.

With `scale_rows` (deferred RMSNorm, models/llama.py) gate_up is the projection of the un-normalized rows, the
norm's weight folded into the projection: each program first computes its row's 1 / RMS from the row itself (or
reads it, precomputed once per row where a row spans several programs) and scales gate and up by it, so the norm
needs no kernel of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.pdl import launch_kwargs, pdl_start, use_pdl
from nvcli.kernels.rms_norm import load_row_rstd, row_scale_args


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, rs_ptr, stride_x, stride_o, stride_rs, D, rs_n, rs_eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr, ROW_SCALE: tl.constexpr, RS_BLOCK: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < D
    gate = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row.to(tl.int64) * stride_x + D + col, mask=mask, other=0.0)
    if ROW_SCALE:  # rounded like the torch path: the scaled projection in the model dtype
        rstd = load_row_rstd(rs_ptr + row.to(tl.int64) * stride_rs, rs_n, rs_eps, RS_BLOCK)
        gate = (gate * rstd).to(up.dtype).to(tl.float32)
        up = (up.to(tl.float32) * rstd).to(up.dtype)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # rounded like torch's F.silu in the model dtype
    tl.store(out_ptr + row.to(tl.int64) * stride_o + col, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype),
             mask=mask)


def silu_and_mul_triton(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate then up
    scale_rows: torch.Tensor | None = None,  # [num_tokens, hidden] or [num_tokens] precomputed 1 / RMS: gate and
    # up first times each row's 1 / RMS
    scale_eps: float = 1e-6,
) -> torch.Tensor:  # [num_tokens, d]
    n, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    rs_ptr, rs_stride, rs_n, rs_block = row_scale_args(scale_rows, n, x)
    block = min(1024, triton.next_power_of_2(d))
    pdl = use_pdl(x, n)
    _silu_and_mul_kernel[(n, triton.cdiv(d, block))](
        x, out, rs_ptr, x.stride(0), out.stride(0), rs_stride, d, rs_n, scale_eps, BLOCK=block, PDL=pdl,
        ROW_SCALE=scale_rows is not None, RS_BLOCK=rs_block, num_warps=4, **launch_kwargs(pdl))
    return out
