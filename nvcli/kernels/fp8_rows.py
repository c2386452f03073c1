"""Row-scaled FP8: activations quantized with one scale per row (token), the weight with one per tensor.

A per-tensor FP8 projection runs cuBLASLt's tensor-scaled GEMM, which streams the weight far faster than the
block-scaled one at a few hundred rows and runs prompt steps faster too (benchmarks/RESULTS.md), but takes one
scale for all of A. So A's rows are
quantized each with its own scale s_i = max(amax_i, 1e-10) / 448, the GEMM runs with A's scale 1, and its output
y'_i = (q_i @ q_w.T) * s_w leaves the row scale pending: the true row is s_i * y'_i, which the kernel that consumes
y' applies as it loads it (the add+RMSNorm kernel's `x_scale`, SiLU-and-mul's and the rotary kernels' precomputed
row scale; layers/fp8.RowScaled carries the pair). The producers of the GEMM's inputs write them quantized in the
same pass (the add+RMSNorm kernel, SiLU-and-mul below); only the attention output takes `quantize_rows_triton`.

`quantize_row` is every kernel's quantization of one row, so all of them give `quantize_rows_ref`'s bits: both
divisions IEEE-rounded (`tl.math.div_rn`, as torch divides), and q rounded to e4m3 in float32 before the cast
(`round_to_e4m3`: Triton 3.6's interpreter casts by truncation, 31.0 -> 30, not 32, which would make the CPU tests
miss real bits; the GPU's cast rounds the same way, so there the step changes nothing).

The GEMM is torch._scaled_mm (cuBLASLt, tensor-wise scales): compute capability 8.9+ and a torch build with FP8
GEMMs (`tensor_gemm_supported` probes once per device and dtype), K and N multiples of 16 (`tensor_gemm_eligible`;
M is free). It runs with fast accumulation: the whole K loop stays in the FP8 MMA's own accumulator instead of
being added into fp32 registers every few steps (vLLM's per-tensor FP8 GEMMs on Hopper do the same): ~3% of the
Qwen3-8B shape's fp8 DESIGN workload on an H200, for an error, against the exact product of the FP8 operands, of
rms 1.5-3e-3 of the output's rms, a twelfth to a twentieth of what FP8 quantization itself costs (3.6e-2;
benchmarks/fp8_accum_gpu.py, RESULTS.md). Nothing here imports nvcli.engine.
"""

from __future__ import annotations

from functools import cache
from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX, quantize_weight_per_tensor

ROW_BLOCK = 2048  # columns a pass of _quant_rows_kernel loads at once


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) -> the nearest e4m3 value, ties to even, still float32: adding 2^(e + 20) (e the
    exponent of v, at least -6: below 2^-6 e4m3's step is 2^-9) leaves 3 fraction bits of v, IEEE-rounded."""
    bits = v.to(tl.int32, bitcast=True)
    step_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # log2 of e4m3's step at |v|
    magic = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # v's sign, -0 too


@triton.jit
def row_scale_of(amax, eps, FP8_MAX: tl.constexpr):
    """A row's FP8 scale from its largest magnitude: max(amax, eps) / 448, IEEE-rounded."""
    return tl.math.div_rn(tl.maximum(amax, eps), FP8_MAX)


@triton.jit
def quantize_with(y, scale, FP8_MAX: tl.constexpr):
    """float32 values y over their row's scale -> e4m3 values, still float32 (cast exactly by the store)."""
    return round_to_e4m3(tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX))


@triton.jit
def quantize_row(y, eps, FP8_MAX: tl.constexpr):
    """y: one row's values, float32 (masked lanes 0) -> (q: e4m3 values in float32, scale = max(amax, eps) / 448)."""
    scale = row_scale_of(tl.max(tl.abs(y), axis=0), eps, FP8_MAX)
    return quantize_with(y, scale, FP8_MAX), scale


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                       ACT_EPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if K <= BLOCK:  # the row in one load
        y = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q, scale = quantize_row(y, ACT_EPS, FP8_MAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:  # two passes: the row's amax, then its quantization (the row stays in L1 / L2 between them)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, K, BLOCK):
            y = tl.load(x_ptr + row * stride_x + c + offs, mask=c + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = row_scale_of(tl.max(amax, axis=0), ACT_EPS, FP8_MAX)
        for c in range(0, K, BLOCK):
            y = tl.load(x_ptr + row * stride_x + c + offs, mask=c + offs < K, other=0.0).to(tl.float32)
            q = quantize_with(y, scale, FP8_MAX)
            tl.store(q_ptr + row * stride_q + c + offs, q.to(q_ptr.dtype.element_ty), mask=c + offs < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scales [M] float32): s_i = max(amax_i, 1e-10) / 448, q_i = clamp(x_i / s_i). The
    divisor is a tensor (torch's CUDA division by a Python number multiplies by its reciprocal)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1) if xf.shape[1] else torch.zeros(xf.shape[0], device=x.device)
    scale = amax.clamp(min=ACT_EPS) / torch.full_like(amax, FP8_MAX)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref's bits, one program per row; x [M, K] with contiguous rows."""
    m, k = x.shape
    assert x.stride(-1) == 1 or k <= 1
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(ROW_BLOCK, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
                                 ACT_EPS=ACT_EPS, num_warps=8 if block >= 2048 else 4)
    return q, scale


@cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def rows_linear_gpu(q: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(q @ wq.T) * w_scale [M, N] in out_dtype, the rows' own scales left pending: cuBLASLt's tensor-scaled FP8
    GEMM (torch._scaled_mm) with A's scale 1, fast accumulation (module docstring). q [M, K] fp8, wq [N, K] fp8,
    w_scale [1] float32."""
    n = wq.shape[0]
    if q.shape[0] == 0:
        return torch.empty((0, n), dtype=out_dtype, device=q.device)
    out = torch._scaled_mm(q, wq.t(), scale_a=_one(q.device), scale_b=w_scale.reshape(1), out_dtype=out_dtype,
                           use_fast_accum=True)
    return out[0] if isinstance(out, tuple) else out


def rows_linear_ref(q: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What rows_linear_gpu computes, accumulated in float32 (the CPU path and the tests' reference; the GPU's fast
    accumulation differs from it by a fraction of the FP8 quantization's own error)."""
    return ((q.float() @ wq.float().T) * w_scale.float()).to(out_dtype)


def rows_linear(q: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The row-scaled product of rows already quantized: rows_linear_gpu on a GPU, its reference elsewhere."""
    return (rows_linear_gpu if q.is_cuda else rows_linear_ref)(q, wq, w_scale, out_dtype)


def apply_row_scale(y: torch.Tensor, scale: Optional[torch.Tensor], col_scale: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """y [M, N] times each row's pending scale [M] (and each column's factor [N], where a fused weight's parts kept
    a scale each: the two multiplied first), rounded to y's dtype: what the consuming kernels compute."""
    if scale is None:
        return y
    factor = scale[:, None] if col_scale is None else scale[:, None] * col_scale[None, :]
    return (y.float() * factor).to(y.dtype)


def rows_product(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row and times the per-tensor fp8 weight: (the product with its row scales pending
    [M, N] in x's dtype, the row scales [M]). The Triton quantization and cuBLASLt on a GPU, the references
    elsewhere (the same bits for the quantization)."""
    q, scale = quantize_rows_triton(x) if x.is_cuda else quantize_rows_ref(x)
    return rows_linear(q, wq, w_scale, x.dtype), scale


def tensor_gemm_eligible(n: int, k: int) -> bool:
    """torch._scaled_mm takes K and N in multiples of 16 (any M)."""
    return n % 16 == 0 and k % 16 == 0


@cache
def _tensor_gemm_works(device_index: int, dtype: torch.dtype) -> bool:
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    q, _ = quantize_rows_ref(torch.randn(16, 16, device=device, generator=gen))
    wq, ws = quantize_weight_per_tensor(torch.randn(16, 16, device=device, generator=gen))
    try:
        got = rows_linear_gpu(q, wq, ws, dtype).float()
        torch.cuda.synchronize(device)
    except RuntimeError:  # this torch / CUDA build has no FP8 GEMM
        return False
    want = rows_linear_ref(q, wq, ws, torch.float32)
    return bool(torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()))


def tensor_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm's tensor-scaled FP8 GEMM runs, and right, on `device` with `dtype` output: probed
    once per device and dtype on a 16 x 16 x 16 product, before any graph capture. False off CUDA."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tensor_gemm_works(index, dtype)
