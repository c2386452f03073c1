"""SiLU(gate) * up in one pass over the fused gate_up projection output.

With `scale_rows` (deferred RMSNorm, models/llama.py) gate_up is the projection of the un-normalized rows, the
norm's weight folded into the projection: each program first computes its row's 1 / RMS from the row itself (or
reads it, precomputed once per row where a row spans several programs) and scales gate and up by it, so the norm
needs no kernel of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, M_ALIGN
from nvcli.kernels.fp8_gemm import quantize_groups
from nvcli.kernels.fp8_rows import quantize_row, quantize_with, row_scale_of
from nvcli.kernels.pdl import launch_kwargs, pdl_start, use_pdl
from nvcli.kernels.rms_norm import load_row_rstd, row_scale_args

QUANT_ROW_BLOCK = 16384  # columns silu_and_mul_quant_rows_triton holds at once (past it: two passes over the row)


@triton.jit
def _silu_mul(x_ptr, row, col, mask, stride_x, D, g_scale, u_scale, ROW_SCALE: tl.constexpr):
    """SiLU(gate) * up of one row's columns `col`, in the model dtype (both kernels' math, so their bits agree);
    with ROW_SCALE gate and up first times g_scale and u_scale."""
    gate = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row.to(tl.int64) * stride_x + D + col, mask=mask, other=0.0)
    if ROW_SCALE:  # rounded like the torch path: the scaled projection in the model dtype
        gate = (gate * g_scale).to(up.dtype).to(tl.float32)
        up = (up.to(tl.float32) * u_scale).to(up.dtype)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # rounded like torch's F.silu in the model dtype
    return (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_quant_rows_kernel(x_ptr, q_ptr, s_ptr, rs_ptr, ratio_ptr, stride_x, stride_q, stride_rs, D, rs_n,
                                    rs_eps, BLOCK: tl.constexpr, ROW_SCALE: tl.constexpr, RS_BLOCK: tl.constexpr,
                                    RATIOS: tl.constexpr, FP8_MAX: tl.constexpr, ACT_EPS: tl.constexpr):
    """One program per row: the row's amax over all its columns, then the row quantized with it
    (kernels/fp8_rows.py: what quantize_rows_triton makes of silu_and_mul_triton's output, bit for bit). RATIOS:
    gate and up take their own factors [2] beside the row scale (the factors first, as fp8_rows.apply_row_scale)."""
    row = tl.program_id(0)
    rstd = tl.full((), 1.0, tl.float32)
    if ROW_SCALE:
        rstd = load_row_rstd(rs_ptr + row.to(tl.int64) * stride_rs, rs_n, rs_eps, RS_BLOCK)
    g_scale = rstd
    u_scale = rstd
    if RATIOS:
        g_scale = rstd * tl.load(ratio_ptr)
        u_scale = rstd * tl.load(ratio_ptr + 1)
    offs = tl.arange(0, BLOCK)
    if D <= BLOCK:  # the row in registers: one pass
        h = _silu_mul(x_ptr, row, offs, offs < D, stride_x, D, g_scale, u_scale, ROW_SCALE).to(tl.float32)
        q, scale = quantize_row(h, ACT_EPS, FP8_MAX)
        tl.store(q_ptr + row.to(tl.int64) * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < D)
    else:  # the amax over the row's blocks, then each block again, quantized
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, D, BLOCK):
            h = _silu_mul(x_ptr, row, c + offs, c + offs < D, stride_x, D, g_scale, u_scale, ROW_SCALE)
            amax = tl.maximum(amax, tl.abs(h.to(tl.float32)))
        scale = row_scale_of(tl.max(amax, axis=0), ACT_EPS, FP8_MAX)
        for c in range(0, D, BLOCK):
            h = _silu_mul(x_ptr, row, c + offs, c + offs < D, stride_x, D, g_scale, u_scale, ROW_SCALE).to(
                tl.float32)
            q = quantize_with(h, scale, FP8_MAX)
            tl.store(q_ptr + row.to(tl.int64) * stride_q + c + offs, q.to(q_ptr.dtype.element_ty), mask=c + offs < D)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, rs_ptr, stride_x, stride_o, stride_rs, D, rs_n, rs_eps, rows, s_ptr,
                         stride_sg, BLOCK: tl.constexpr, PDL: tl.constexpr, ROW_SCALE: tl.constexpr,
                         RS_BLOCK: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr = 448.0,
                         ACT_EPS: tl.constexpr = 1e-10):
    pdl_start(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (col < D) & (row < rows)  # QUANT's padding rows (row >= rows) quantize zeros
    rstd = tl.full((), 1.0, tl.float32)
    if ROW_SCALE:
        rstd = load_row_rstd(rs_ptr + row.to(tl.int64) * stride_rs, rs_n, rs_eps, RS_BLOCK)
    h = _silu_mul(x_ptr, row, col, mask, stride_x, D, rstd, rstd, ROW_SCALE)
    if QUANT:  # what quantize_activations_triton makes of h, bit for bit (BLOCK is a multiple of 128)
        g = tl.reshape(h.to(tl.float32), (BLOCK // 128, 128))
        q, scale = quantize_groups(g, ACT_EPS, FP8_MAX)
        cols = tl.reshape(col, (BLOCK // 128, 128))
        tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=cols < D)
        groups = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
        tl.store(s_ptr + row + groups.to(tl.int64) * stride_sg, scale, mask=groups * 128 < D)
    else:
        tl.store(out_ptr + row.to(tl.int64) * stride_o + col, h, mask=mask)


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
        x, out, rs_ptr, x.stride(0), out.stride(0), rs_stride, d, rs_n, scale_eps, n, out, 0, BLOCK=block, PDL=pdl,
        ROW_SCALE=scale_rows is not None, RS_BLOCK=rs_block, QUANT=False, num_warps=4, **launch_kwargs(pdl))
    return out


def silu_and_mul_quant_rows_triton(x: torch.Tensor, scale_rows: torch.Tensor | None = None, scale_eps: float = 1e-6,
                                   ratios: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate) * up of x [num_tokens, 2 * d] (times `scale_rows` first, as silu_and_mul_triton) quantized with
    one scale per row -> (fp8 [num_tokens, d], scales [num_tokens] float32): kernels/fp8_rows.py's format, bit for
    bit what quantize_rows_triton makes of silu_and_mul_triton's output, in one kernel. `ratios` ([2] float32, with
    scale_rows): gate's and up's own factors beside the row scale (fp8_rows: a gate_up weight with a scale each)."""
    n, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    q = torch.empty((n, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((n,), dtype=torch.float32, device=x.device)
    if n == 0:
        return q, scale
    assert ratios is None or (scale_rows is not None and ratios.shape == (2,) and ratios.dtype == torch.float32)
    rs_ptr, rs_stride, rs_n, rs_block = row_scale_args(scale_rows, n, x)
    block = min(QUANT_ROW_BLOCK, triton.next_power_of_2(d))  # a whole row of up to 16k columns in registers
    _silu_and_mul_quant_rows_kernel[(n,)](
        x, q, scale, rs_ptr, ratios if ratios is not None else scale, x.stride(0), q.stride(0), rs_stride, d, rs_n,
        scale_eps, BLOCK=block, ROW_SCALE=scale_rows is not None, RS_BLOCK=rs_block, RATIOS=ratios is not None,
        FP8_MAX=FP8_MAX, ACT_EPS=ACT_EPS,
        num_warps=16 if block >= 8192 else (8 if block >= 2048 else 4))
    return q, scale


def silu_and_mul_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate) * up of x [num_tokens, 2 * d] quantized per row per 128 columns as an FP8 projection takes it
    (kernels/fp8_gemm.fp8_gemm_quantized): (fp8 [padded rows, d], scales [padded rows, ceil(d / 128)] M-major), bit
    for bit what quantize_activations_triton(m_major=True) makes of silu_and_mul_triton's output, in one kernel."""
    n, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    padded = triton.cdiv(n, M_ALIGN) * M_ALIGN
    q = torch.empty((padded, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((triton.cdiv(d, BLOCK), padded), dtype=torch.float32, device=x.device).t()
    if n == 0:
        return q, scale
    block = min(1024, max(BLOCK, triton.next_power_of_2(d)))
    _silu_and_mul_kernel[(padded, triton.cdiv(d, block))](
        x, q, x, x.stride(0), q.stride(0), 0, d, 0, 0.0, n, scale, scale.stride(1), BLOCK=block, PDL=False,
        ROW_SCALE=False, RS_BLOCK=1, QUANT=True, FP8_MAX=FP8_MAX, ACT_EPS=ACT_EPS, num_warps=4)
    return q, scale
