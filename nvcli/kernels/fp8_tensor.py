"""Per-tensor FP8 (float8_e4m3fn): one float32 scale for a whole weight and one for a whole activation matrix.

The format of `--quantization fp8` checkpoints quantized per tensor (vLLM's "static weight, dynamic activation"):
a weight [N, K] is fp8 times one scale, amax / 448; the activations x [M, K] are quantized on the fly with one
scale, max(amax, 1e-10) / 448, and y = (q_x @ q_w.T) * (s_x * s_w) (+ bias) in x's dtype.

`quantize_per_tensor_triton` gives `quantize_per_tensor_ref`'s bits exactly, in two launches, no atomics, no host
sync, no memset (CUDA graphs capture it; the result does not depend on scheduling), or in one where the activation's
producer wrote maxima of its parts (the add+RMSNorm kernel per row, SiLU-and-mul per block: layers/linear.py):

* `_amax_partials_kernel`: P programs of ROWS consecutive rows each (`_plan`: a pure function of M and K, P at
  most 1024, every program at least ~8k elements), each walking its rows in [BLOCK_M, BLOCK_K] tiles and writing
  its rows' amax to partial[P]. A max is exact in any order, so the split changes no bit.
* `_quant_tensor_kernel`: programs of ~4,096 elements (two an SM at decode sizes); every program reduces the partials to the global amax, takes
  scale = max(amax, 1e-10) / 448 (program 0 stores it), and writes q = clamp(x / scale, -448, 448) as fp8. Both
  divisions are IEEE-rounded (`tl.math.div_rn`; Triton's `/` is approximate), as torch divides.

Before the fp8 cast, `round_to_e4m3` rounds q to the nearest e4m3 value (ties to even) in float32 arithmetic, so
the cast itself is exact on every backend: the GPU's cast rounds the same way (the step changes nothing there), and
Triton 3.6's interpreter casts by truncation (31.0 -> 30, not 32), which would make the CPU tests miss real bits.

The product is torch._scaled_mm (cuBLASLt, tensor-wise scales): it needs compute capability 8.9+ and a torch build
with FP8 GEMMs (`tensor_gemm_supported` probes once per device and dtype), K and N multiples of 16
(`tensor_gemm_eligible`; M is free), a bf16 / fp16 bias of the output dtype (an fp32 output gets its bias added
after). Nothing here imports nvcli.engine.
"""

from __future__ import annotations

from functools import cache
from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX, quantize_weight_per_tensor

MAX_PARTIALS = 1024  # programs of the amax pass, at most
MIN_ELEMENTS = 8192  # elements an amax program handles, at least (fewer programs for small inputs)
QUANT_ELEMENTS = 4096  # elements a quantization program handles, at least: ~2 programs an SM at decode sizes
TILE_ELEMENTS = 4096  # elements of one [BLOCK_M, BLOCK_K] tile


def _eps_scale(device: torch.device) -> torch.Tensor:
    """The scale of an all-zero (or empty) input, ACT_EPS / 448 divided in float32 as the kernel divides."""
    return torch.full((1,), ACT_EPS, device=device) / torch.full((1,), FP8_MAX, device=device)


def quantize_per_tensor_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale float32 [1]): scale = max(amax, 1e-10) / 448, fp8 = clamp(x / scale). The
    divisor is a tensor on x's device (torch's CUDA division by a Python number multiplies by its reciprocal)."""
    xf = x.float()
    if xf.numel() == 0:
        scale = _eps_scale(x.device)
    else:
        amax = xf.abs().amax().clamp(min=ACT_EPS)
        scale = (amax / torch.full_like(amax, FP8_MAX)).reshape(1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


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
def _amax_partials_kernel(x_ptr, partial_ptr, M, K, stride_xm, ROWS,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    first = pid * ROWS
    end = tl.minimum(first + ROWS, M)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r0 in range(first, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = (rows < end)[:, None] & (cols < K)[None, :]
            acc = tl.maximum(acc, tl.abs(tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _quant_tensor_kernel(x_ptr, q_ptr, partial_ptr, scale_ptr, M, K, stride_xm, stride_qm, ROWS, P, eps,
                         FP8_MAX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    part = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        part = tl.maximum(part, tl.load(partial_ptr + p0 + offs_p, mask=p0 + offs_p < P, other=0.0))
    amax = tl.max(part, axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, eps), FP8_MAX)
    if pid == 0:
        tl.store(scale_ptr, scale)
    first = pid * ROWS
    end = tl.minimum(first + ROWS, M)
    for r0 in range(first, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        q_base = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = (rows < end)[:, None] & (cols < K)[None, :]
            x = tl.load(x_base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            q = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
            tl.store(q_base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)


def _plan(m: int, k: int, min_elements: int = MIN_ELEMENTS) -> tuple[int, int, int, int]:
    """(rows a program, programs P, BLOCK_M, BLOCK_K) of an [m, k] input (m, k > 0): a pure function of the shape."""
    rows = max(triton.cdiv(m, MAX_PARTIALS), triton.cdiv(min_elements, k))
    block_k = min(triton.next_power_of_2(k), 1024)
    block_m = min(triton.next_power_of_2(min(rows, m)), max(1, TILE_ELEMENTS // block_k))
    return rows, triton.cdiv(m, rows), block_m, block_k


def quantize_per_tensor_triton(x: torch.Tensor, amax_parts: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, rows contiguous) -> (fp8 [M, K], scale float32 [1]), bit for bit
    quantize_per_tensor_ref's: in two kernel launches, or in one given `amax_parts` (float32, contiguous, any shape:
    maxima of |x| over parts that cover x, as the norm and SiLU kernels write them); none for an empty x."""
    m, k = x.shape
    assert x.stride(-1) == 1 or k <= 1, x.stride()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if m == 0 or k == 0:
        return q, _eps_scale(x.device)
    scale = torch.empty((1,), dtype=torch.float32, device=x.device)
    if amax_parts is None:
        rows, programs, block_m, block_k = _plan(m, k)
        amax_parts = torch.empty((programs,), dtype=torch.float32, device=x.device)
        _amax_partials_kernel[(programs,)](x, amax_parts, m, k, x.stride(0), rows, BLOCK_M=block_m, BLOCK_K=block_k)
    assert amax_parts.dtype == torch.float32 and amax_parts.is_contiguous() and amax_parts.device == x.device
    parts = amax_parts.numel()
    rows, programs, block_m, block_k = _plan(m, k, QUANT_ELEMENTS)
    _quant_tensor_kernel[(programs,)](
        x, q, amax_parts, scale, m, k, x.stride(0), q.stride(0), rows, parts, ACT_EPS,
        FP8_MAX=FP8_MAX, BLOCK_P=min(triton.next_power_of_2(parts), 1024), BLOCK_M=block_m, BLOCK_K=block_k)
    return q, scale


def fp8_tensor_linear_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What fp8_tensor_linear_gpu computes: x [..., K] quantized per tensor, (q_x @ wq.T) * (s_x * s_w) + bias in
    float32, cast to x's dtype -> [..., N]."""
    k = x.shape[-1]
    q, s = quantize_per_tensor_ref(x.reshape(-1, k))
    y = (q.float() @ wq.float().T) * (s * w_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


def tensor_gemm_eligible(n: int, k: int) -> bool:
    """torch._scaled_mm takes K and N in multiples of 16 (any M)."""
    return n % 16 == 0 and k % 16 == 0


def fp8_tensor_linear_gpu(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, amax_parts: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) times the fp8 weight wq [N, K] (scale w_scale float32 [1]) plus bias
    -> [..., N] in x's dtype: the Triton per-tensor quantization (one kernel given `amax_parts`, the maxima of |x|
    its producer wrote: quantize_per_tensor_triton), then cuBLASLt's FP8 GEMM (torch._scaled_mm)."""
    k = x.shape[-1]
    n = wq.shape[0]
    assert wq.dtype == FP8_DTYPE and wq.shape == (n, k) and wq.stride(1) == 1, (wq.dtype, wq.shape, wq.stride())
    assert w_scale.dtype == torch.float32 and w_scale.numel() == 1
    assert tensor_gemm_eligible(n, k), f"torch._scaled_mm needs N and K in multiples of 16, got N={n}, K={k}"
    assert bias is None or bias.shape == (n,)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or n == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    q, s = quantize_per_tensor_triton(x2, amax_parts)
    fused = bias is not None and x.dtype in (torch.bfloat16, torch.float16)  # no fused bias into fp32
    out = torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=w_scale.reshape(1), out_dtype=x.dtype,
                           bias=bias.to(x.dtype) if fused else None)
    if isinstance(out, tuple):  # torch < 2.4 also returned the amax
        out = out[0]
    if bias is not None and not fused:
        out += bias
    return out.view(*x.shape[:-1], n)


@cache
def _tensor_gemm_works(device_index: int, dtype: torch.dtype) -> bool:
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(16, 16, device=device, generator=gen).to(dtype)
    wq, ws = quantize_weight_per_tensor(torch.randn(16, 16, device=device, generator=gen))
    bias = torch.randn(16, device=device, generator=gen).to(dtype)
    try:
        got = fp8_tensor_linear_gpu(x, wq, ws, bias).float()
        want = fp8_tensor_linear_ref(x, wq, ws, bias).float()
        torch.cuda.synchronize(device)
    except RuntimeError:  # this torch / CUDA build has no FP8 GEMM
        return False
    return bool(torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()))


def tensor_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm's per-tensor FP8 GEMM runs, and right, on `device` with `dtype` output (bias
    included): probed once per device and dtype on a 16 x 16 x 16 product, before any graph capture. False off
    CUDA."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tensor_gemm_works(index, dtype)
