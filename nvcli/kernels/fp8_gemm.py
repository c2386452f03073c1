"""Block-scaled FP8 GEMM: y = x @ dequant(weight).T (+ bias) with x quantized to FP8 on the fly.

The weights are float8_e4m3fn with one float32 scale per 128 x 128 block (or per row and 128 columns:
`scale_rows`; kernels/block_fp8.py describes the format). Two kernels per projection:

* `_quant_act_kernel`: one program per row and 128 columns: scale = max(amax, 1e-10) / 448, fp8 = clamp(x / scale)
  (an IEEE-rounded division, as torch divides: the result matches `block_fp8.quantize_activations_ref` bit for bit).
  The scales are written M-major ([ceil(K / 128), M] viewed as [M, ceil(K / 128)]) and the rows padded to a multiple
  of 4 (zeros), the layout both GEMMs below read.
* the product: cuBLASLt's block-scaled FP8 GEMM through torch's scaled_mm (1x128 activation blocks, 128 x 128 or
  1 x 128 weight blocks; CUDA 12.9+ on compute capability 9.0) wherever `cublas_supported` finds it working, reading the
  weight scales in the layout `cublas_weight_scales` makes once at load. Measured on an H100 (benchmarks/RESULTS.md,
  benchmarks/fp8_gemm_gpu.py) it beats every tile of the Triton kernel below at the Qwen3-8B and -30B-A3B shapes from
  16 to 4096 rows but three, where it trails the best tile by at most 4%. Elsewhere (Ada, older CUDA builds, shapes
  not in whole 128-column blocks) `_fp8_gemm_kernel` (Triton): each program owns a BLOCK_M x BLOCK_N tile of y and
  walks K in steps of 128 (BLOCK_K is the scale block, so every step needs one activation scale per row and one
  weight scale per column): the fp8 x fp8 dot on the tensor cores into a float32 partial, times
  a_scale[m, kb] * b_scale[n, kb], summed in a float32 accumulator; bias and the cast to x's dtype at the end. Its
  tile is a pure function of (M, N, SM count) (`choose_config`): few rows (decode) BLOCK_M = 16 and the widest
  BLOCK_N that still gives every SM a program, since there the time is the weight's stream from memory; many rows
  64-128 x 128 tiles in GROUP_M-swizzled order so neighbouring programs share weight tiles in L2.

Neither autotunes nor syncs with the host, so CUDA graphs capture the pair. FP8 tensor cores need compute capability
8.9 (Ada) or newer: `block_fp8.fp8_gemm_supported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import (
    ACT_EPS,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    M_ALIGN,
    fp8_linear_ref,
    quantize_weight,
)


@triton.jit
def quantize_groups(x, eps, FP8_MAX: tl.constexpr):
    """x [G, C] float32, each row one activation group -> (q [G, C] float32 in [-448, 448], still to be cast to fp8;
    scale [G]): scale = max(amax, eps) / 448, q = x / scale, both IEEE-rounded (Triton's `/` is approximate), so
    every kernel that quantizes activations through this gives quantize_activations_ref's bits."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), FP8_MAX)
    return tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX), scale


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                      FP8_MAX: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    # one program: a row's GROUPS consecutive 128-column groups as a [GROUPS, GROUP] tile
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok & (row < M), other=0.0).to(tl.float32)  # padding rows: 0
    q, scale = quantize_groups(x, eps, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < K)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
    SCALE_ROWS: tl.constexpr,  # weight rows per scale row: 128 (block scales) or 1 (per-row scales)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the columns together: their programs read the same weight tiles from L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], K-major
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Fp8GemmConfig:
    """The Triton kernel's tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(m: int, n: int, sms: int) -> Fp8GemmConfig:
    """The Triton tile of an [m, K] x [n, K]^T product on `sms` SMs: a pure function of the shape (graph-safe)."""
    if m <= 64:
        # decode: the weight streams once; the widest column tile that still gives every SM a program
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 128
        while block_n > 32 and triton.cdiv(n, block_n) < sms:
            block_n //= 2
        return Fp8GemmConfig(block_m, block_n, num_warps=4, num_stages=4)
    if m <= 256:
        return Fp8GemmConfig(64, 128, num_warps=4, num_stages=4)
    return Fp8GemmConfig(128, 128, num_warps=8, num_stages=3)


def quantize_activations_triton(x: torch.Tensor, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K / 128)]), per row and 128 columns. `m_major`: the GEMMs'
    layout, rows padded with zeros to a multiple of 4 and the scales stored M-major (stride (1, rows))."""
    m, k = x.shape
    assert x.stride(-1) == 1
    groups = triton.cdiv(k, BLOCK)
    rows = triton.cdiv(m, M_ALIGN) * M_ALIGN if m_major else m
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    if m_major:
        scale = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and k:
        per = min(8, triton.next_power_of_2(groups))  # up to 1,024 columns a program
        _quant_act_kernel[(rows, triton.cdiv(groups, per))](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), ACT_EPS,
            FP8_MAX=FP8_MAX, GROUP=BLOCK, GROUPS=per, num_warps=4 if per >= 4 else 1)
    return q, scale


def cublas_weight_scales(scale: torch.Tensor, scale_rows: int) -> torch.Tensor:
    """A layer's weight scales ([ceil(N / scale_rows), ceil(K / 128)]) as cuBLASLt reads those of the [K, N] operand:
    128 x 128 blocks as [K blocks rounded up to 4, N / 128] with stride (1, that), per-row as [N, K / 128] N-major."""
    if scale_rows == BLOCK:
        nb, kb = scale.shape
        padded = torch.zeros((nb, triton.cdiv(kb, 4) * 4), dtype=torch.float32, device=scale.device)
        padded[:, :kb] = scale
        return padded.t()
    return scale.t().contiguous().t()


def _cublas_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale_mm: torch.Tensor,
               scale_rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    F = torch.nn.functional
    if hasattr(F, "scaled_mm"):  # the recipes named
        recipe_b = F.ScalingType.BlockWise128x128 if scale_rows == BLOCK else F.ScalingType.BlockWise1x128
        return F.scaled_mm(a, weight.t(), a_scale, F.ScalingType.BlockWise1x128, scale_mm, recipe_b,
                           output_dtype=out_dtype)
    return torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=scale_mm, out_dtype=out_dtype)  # by the shapes


def cublas_eligible(n: int, k: int, scale_rows: int) -> bool:
    """cuBLASLt's block-scaled GEMM takes whole 128-column blocks (and whole 128-row weight blocks for 128 x 128)."""
    return k % BLOCK == 0 and (scale_rows == 1 or n % BLOCK == 0)


@cache
def _cublas_works(device_index: int, dtype: torch.dtype, scale_rows: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(6, 512, device=device, generator=gen).to(dtype)
    w = torch.randn(384, 512, device=device, generator=gen) * 0.05
    wq, ws = quantize_weight(w)
    if scale_rows == 1:  # every row its own scale, so a layout that mixes rows up within a block shows
        ws = ws.repeat_interleave(BLOCK, 0) * torch.linspace(0.5, 1.5, ws.shape[0] * BLOCK, device=device)[:, None]
    try:
        a, a_s = quantize_activations_triton(x, m_major=True)
        got = _cublas_mm(a, a_s, wq, cublas_weight_scales(ws, scale_rows), scale_rows, dtype)[: x.shape[0]].float()
        want = fp8_linear_ref(x, wq, ws, None, scale_rows).float()
        torch.cuda.synchronize(device)
    except RuntimeError:  # this torch / CUDA build has no block-scaled cuBLASLt GEMM
        return False
    return bool(torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()))


def cublas_supported(device: torch.device, dtype: torch.dtype, scale_rows: int = BLOCK) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM runs, and right, on `device` with `dtype` output and weight scales
    per `scale_rows` rows: probed once per format against the torch reference, before any graph capture (at load);
    a format it gets wrong runs the Triton kernel."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cublas_works(index, dtype, scale_rows)


def fp8_linear_gpu(
    x: torch.Tensor,  # [..., K], bf16 / fp16 / fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor,  # [ceil(N / scale_rows), ceil(K / 128)] float32
    bias: Optional[torch.Tensor] = None,  # [N]
    scale_rows: int = BLOCK,
    scale_mm: Optional[torch.Tensor] = None,  # cublas_weight_scales(scale): the product runs in cuBLASLt; None: Triton
    config: Optional[Fp8GemmConfig] = None,  # the Triton tile, overriding choose_config (tests, benchmarks)
) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias) -> [..., N] in x's dtype, x quantized per token per 128 columns."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.dtype == FP8_DTYPE and weight.shape[1] == k and weight.stride(1) == 1, (weight.dtype, weight.shape)
    assert scale.dtype == torch.float32 and scale.shape == (triton.cdiv(n, scale_rows), triton.cdiv(k, BLOCK))
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    a, a_scale = quantize_activations_triton(x2, m_major=True)
    out = fp8_gemm_quantized(a, a_scale, m, weight, scale, bias, scale_rows, scale_mm, x.dtype, config)
    return out.view(*x.shape[:-1], n)


def fp8_gemm_quantized(
    a: torch.Tensor,  # [rows, K] float8_e4m3fn: activations quantized in the GEMMs' layout (rows padded to 4)
    a_scale: torch.Tensor,  # [rows, ceil(K / 128)] float32, M-major
    m: int,  # the real rows: the first m of `a`
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale_rows: int,
    scale_mm: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    config: Optional[Fp8GemmConfig] = None,
) -> torch.Tensor:
    """The product of activations already quantized (quantize_activations_triton(m_major=True), or the SiLU-and-mul
    kernel that quantizes as it writes: kernels/activation.py) and the FP8 weight -> [m, N] in out_dtype."""
    n = weight.shape[0]
    if scale_mm is not None:
        out = _cublas_mm(a, a_scale, weight, scale_mm, scale_rows, out_dtype)[:m]
        if bias is not None:
            out += bias
        return out
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    return fp8_matmul_triton(a[:m], a_scale[:m], weight, scale, out, bias, scale_rows, config)


def fp8_matmul_triton(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K / 128)] float32, any strides
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / scale_rows), ceil(K / 128)] float32
    out: torch.Tensor,  # [M, N]: receives the product (+ bias) in its dtype
    bias: Optional[torch.Tensor] = None,
    scale_rows: int = BLOCK,
    config: Optional[Fp8GemmConfig] = None,
) -> torch.Tensor:
    """The block-scaled product of quantized activations and weights into `out` (returned), by the Triton kernel."""
    m, k = a.shape
    n = weight.shape[0]
    assert a.stride(-1) == 1 and a_scale.shape == (m, triton.cdiv(k, BLOCK)) and out.shape == (m, n)
    cfg = config or choose_config(m, n, _num_sms(a.device.index or 0) if a.is_cuda else 132)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, scale, bias if bias is not None else scale, out,
        m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
