"""The tensor-parallel sum of a row-parallel projection fused with the residual add and RMSNorm that follow it.

Each rank's GEMM wrote its partial sums into its own peer-mapped buffer (distributed.Partial); after a barrier every
rank reads all WORLD buffers itself (one shot), in rank order, and per row

    s = p_0 + p_1 + ... + p_{WORLD-1}      (fp32, rounded to the model dtype: the all-reduced projection)
    x = s + residual                        (fp32 add, rounded: the new residual)
    out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)

exactly as kernels/rms_norm.py rounds (without `weight`: out = s, and x = s + residual where there is one). Every
rank adds the same values in the same order, so all ranks get the same bits, as the replicated residual stream
needs. One program per row; the peers' rows are read over NVLink through their mapped addresses (up to 8 ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.rms_norm import norm_row

MAX_WORLD = 8


@triton.jit
def _sum_add_norm_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # each rank's [rows, N] partial sums (the unused ones alias p0)
    res_ptr,  # [rows, N] residual (HAS_RES)
    w_ptr,  # [N] norm weight (NORM)
    out_ptr,  # [rows, N]: the normed rows (NORM) or the sum (+ residual)
    new_res_ptr,  # [rows, N]: sum + residual (NORM)
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RES: tl.constexpr,
    NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    base = row * N + offs
    acc = tl.load(p0 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 1:
        acc += tl.load(p1 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 2:
        acc += tl.load(p2 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 3:
        acc += tl.load(p3 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 4:
        acc += tl.load(p4 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 5:
        acc += tl.load(p5 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 6:
        acc += tl.load(p6 + base, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 7:
        acc += tl.load(p7 + base, mask=mask, other=0.0).to(tl.float32)
    x = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + base, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if NORM:
        tl.store(new_res_ptr + base, x, mask=mask)
        tl.store(out_ptr + base, norm_row(x, w_ptr, offs, mask, eps, N).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + base, x, mask=mask)


def sum_add_norm_triton(
    parts: Sequence[torch.Tensor],  # each rank's [rows, N] partial sums, rank order (peer-mapped views on a GPU)
    residual: Optional[torch.Tensor],  # [rows, N] or None
    weight: Optional[torch.Tensor],  # [N] RMSNorm weight, or None: no norm
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum + residual), sum + residual) with `weight`; (sum + residual, the same tensor) without. The sum
    is taken in rank order in fp32 and rounded to the parts' dtype first, as an all-reduce returns it."""
    assert 1 <= len(parts) <= MAX_WORLD, f"{len(parts)} ranks: at most {MAX_WORLD}"
    first = parts[0]
    rows, n = first.shape
    assert all(p.shape == (rows, n) and p.is_contiguous() and p.dtype == first.dtype for p in parts)
    assert residual is None or (residual.shape == (rows, n) and residual.is_contiguous())
    assert weight is None or (weight.shape == (n,) and weight.is_contiguous())
    out = torch.empty((rows, n), dtype=first.dtype, device=first.device)
    new_res = torch.empty_like(out) if weight is not None else out
    if rows == 0:
        return out, new_res
    ptrs = list(parts) + [first] * (MAX_WORLD - len(parts))
    block = triton.next_power_of_2(n)
    _sum_add_norm_kernel[(rows,)](
        *ptrs, residual if residual is not None else first, weight if weight is not None else first, out, new_res,
        eps, N=n, BLOCK=block, WORLD=len(parts), HAS_RES=residual is not None, NORM=weight is not None,
        num_warps=8 if block >= 1024 else 4,
    )
    return out, new_res
