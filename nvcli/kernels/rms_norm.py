"""Fused residual-add + RMSNorm in Triton, matching `nvcli.models.layers.norm.RMSNorm`.

    x = x + residual            (fp32 add, rounded to x.dtype: the new residual)
    out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)   (fp32 math, out in x.dtype)

One program per row of the last dimension; 2-D `[rows, hidden]` or 3-D `[tokens, heads,
head_dim]` inputs (e.g. per-head q/k norms on a strided view of a fused qkv tensor) are
read through their strides without copies.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX
from nvcli.kernels.fp8_rows import quantize_row
from nvcli.kernels.pdl import launch_kwargs, pdl_start, use_pdl


@triton.jit
def norm_row(x, w_ptr, offs, mask, eps, N: tl.constexpr):
    """weight * (x * rsqrt(mean(x^2) + eps)) of one row x (its model dtype; masked lanes 0), float32: the normed row
    rounded to x's dtype before the weight multiplies, as the torch RMSNorm layer rounds."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    return normed * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    eps,
    inner,  # rows per outer index (heads for 3-D inputs, 1 for 2-D)
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    xs_ptr,  # [rows] float32 (X_SCALE): x's rows times these first (a row-scaled FP8 GEMM's output)
    qs_ptr,  # [rows] float32 (QUANT): receives each output row's FP8 scale
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see pdl.py)
    X_SCALE: tl.constexpr = False,
    QUANT: tl.constexpr = False,  # out is float8_e4m3fn: the normed row quantized with one scale (fp8_rows.py)
    FP8_MAX: tl.constexpr = 448.0,
    ACT_EPS: tl.constexpr = 1e-10,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    sub = row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + outer * stride_x0 + sub * stride_x1 + offs, mask=mask, other=0.0)
    if X_SCALE:  # rounded to the model dtype, as the torch reference scales the GEMM's output
        x = (x.to(tl.float32) * tl.load(xs_ptr + row)).to(x_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + outer * stride_r0 + sub * stride_r1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if HAS_RES or X_SCALE:  # the new residual (contiguous): x + residual, or the scaled x
        tl.store(new_res_ptr + row * N + offs, x, mask=mask)
    y = norm_row(x, w_ptr, offs, mask, eps, N).to(x_ptr.dtype.element_ty)
    if QUANT:  # what quantize_rows_triton makes of the normed row in the model dtype, bit for bit
        q, scale = quantize_row(y.to(tl.float32), ACT_EPS, FP8_MAX)
        tl.store(out_ptr + row * N + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(qs_ptr + row, scale)
    else:
        tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# RS_BLOCK of a precomputed row scale: the kernel reads the row's 1 / RMS itself (row_rstd_triton's output). A
# tl.constexpr: a jit function may read no other kind of global (the interpreter does not check this; the GPU does)
PRECOMPUTED_RSTD = tl.constexpr(1)


@triton.jit
def load_row_rstd(row_ptr, n, eps, BLOCK: tl.constexpr):
    """1 / RMS (fp32) of the n elements at row_ptr, as the kernel above computes it: the deferred norm's row scale
    (models/llama.py), for kernels that read a projection of the un-normalized row. BLOCK == PRECOMPUTED_RSTD:
    row_ptr points at that value, computed once per row by `row_rstd_triton` (prompt steps, where a kernel runs
    several programs per row and each would read the row again)."""
    if BLOCK == PRECOMPUTED_RSTD:
        return tl.load(row_ptr).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


def row_scale_args(scale_rows: Optional[torch.Tensor], num_rows: int, unused: torch.Tensor) -> tuple:
    """(pointer, row stride, row length, BLOCK) for `load_row_rstd` over `scale_rows`: the rows [num_rows, hidden],
    or their 1 / RMS precomputed [num_rows] float32; without them, placeholders (`unused` as the pointer) for a
    kernel compiled without its row scale."""
    if scale_rows is None:
        return unused, 0, 1, 16
    assert scale_rows.shape[0] == num_rows and scale_rows.stride(-1) == 1, "scale_rows: one contiguous row per row"
    if scale_rows.dim() == 1:
        assert scale_rows.dtype == torch.float32, "a precomputed row scale is float32 (row_rstd_triton)"
        return scale_rows, 1, 1, PRECOMPUTED_RSTD.value
    return scale_rows, scale_rows.stride(0), scale_rows.shape[1], max(2, triton.next_power_of_2(scale_rows.shape[1]))


@triton.jit
def _row_rstd_kernel(x_ptr, out_ptr, rows, stride_x, n, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows per program: a prompt step has ~16k rows of 2 KB, too little work for one program each."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    offs = tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (offs < n)[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.rsqrt(tl.sum(x * x, axis=1) / n + eps), mask=r < rows)  # as load_row_rstd


def row_rstd_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows] float32: 1 / RMS of each row of x [rows, hidden], as RMSNorm computes it (one read of the rows)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        per_program = max(1, min(8, 8192 // block))
        _row_rstd_kernel[(triton.cdiv(rows, per_program),)](x, out, rows, x.stride(0), n, eps, ROWS=per_program,
                                                             BLOCK=block, num_warps=8 if block >= 1024 else 4)
    return out


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(inner, stride0, stride1) addressing row r at (r // inner) * stride0 + (r % inner) * stride1."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def rms_norm_triton(
    x: torch.Tensor,  # [rows, hidden] or [tokens, heads, head_dim]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # like x
    x_scale: Optional[torch.Tensor] = None,  # [rows] float32: x's rows times these first (2-D x)
    quantize: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(RMSNorm(x + residual), x + residual); without residual the second item is x itself (with `x_scale`, the
    scaled x, stored by the kernel). `quantize`: (the
    normed rows quantized per row as fp8, their scales [rows] float32, x + residual) instead, as
    kernels/fp8_rows.quantize_rows_triton quantizes the model-dtype output."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, n).contiguous() if x.dim() not in (2, 3) else x.contiguous()
    if residual is not None:
        assert residual.shape[-1] == n and residual.numel() == x.numel()
        residual = residual.reshape(x.shape)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    shape = x.shape
    out = torch.empty(shape, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    rows = x.numel() // n
    if x_scale is not None:
        assert x.dim() == 2 and x_scale.shape == (rows,) and x_scale.dtype == torch.float32, "x_scale: [rows] fp32"
    # the new residual: x + residual, or the scaled x, which the kernel stores; else x itself
    stored = residual is not None or x_scale is not None
    new_res = torch.empty(shape, dtype=x.dtype, device=x.device) if stored else x
    scales = torch.empty(rows if quantize else 0, dtype=torch.float32, device=x.device)
    if rows == 0:
        return (out, scales, new_res) if quantize else (out, new_res)
    inner, sx0, sx1 = _row_strides(x)
    if residual is not None:
        r_inner, sr0, sr1 = _row_strides(residual)
        assert r_inner == inner
    else:
        sr0 = sr1 = 0
    block = triton.next_power_of_2(n)
    pdl = use_pdl(x, rows)
    num_warps = 1 if block <= 256 else (4 if block <= 2048 else (8 if block <= 8192 else 16))
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_res,
        eps,
        inner,
        sx0,
        sx1,
        sr0,
        sr1,
        x_scale if x_scale is not None else weight,
        scales if quantize else weight,
        N=n,
        BLOCK=block,
        HAS_RES=residual is not None,
        PDL=pdl,
        X_SCALE=x_scale is not None,
        QUANT=quantize,
        FP8_MAX=FP8_MAX,
        ACT_EPS=ACT_EPS,
        num_warps=num_warps,
        **launch_kwargs(pdl),
    )
    return (out, scales, new_res) if quantize else (out, new_res)
