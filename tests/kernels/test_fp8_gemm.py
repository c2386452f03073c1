"""Block-wise FP8: the torch format helpers (kernels/block_fp8.py) and the Triton GEMM (kernels/fp8_gemm.py) against
them, on the GPU (compute capability >= 8.9) or under the Triton interpreter on the CPU.

Triton 3.6's interpreter multiplies fp8 tiles exactly, but its float32 -> fp8 cast rounds wrongly where rounding
carries into the exponent (31.7 -> 16, not 32), so on the CPU the activation quantization kernel is checked on inputs
that need no rounding (every group's amax 448 * 2^e, every value an fp8 value times 2^e); the GPU checks it on random
inputs, bit for bit."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, linear_inputs, on_device

from nvcli.kernels.block_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    block_fp8_matmul_ref,
    dequantize_weight,
    expand_scale,
    fp8_linear_ref,
    quantize_activations_ref,
    quantize_weight,
)

needs_fp8_gpu = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 tensor cores need compute capability 8.9 or newer",
)
INTERPRETED = DEVICE.type == "cpu"


@pytest.mark.parametrize("n, k", [(128, 128), (200, 320), (64, 96), (300, 130)])
def test_weight_round_trip_keeps_each_block_within_half_an_fp8_step(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    w[:, :7] *= 30  # an outlier column: only its own blocks get a coarser scale
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k)
    assert scale.shape == (-(-n // 128), -(-k // 128)) and scale.dtype == torch.float32
    # every block's largest entry maps to +-448
    per_entry = expand_scale(scale, n, k)
    assert torch.allclose((w / per_entry).abs().amax(), torch.tensor(FP8_MAX))
    back = dequantize_weight(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: within 1/16 relative of each entry, plus the block's subnormal step
    assert ((back - w).abs() <= w.abs() / 16 + per_entry * 2**-9).all()
    # per-row scales are the block scales repeated
    rows = scale.repeat_interleave(128, 0)[:n]
    assert torch.equal(dequantize_weight(q, rows, torch.float32, scale_rows=1), back)


def test_a_zero_block_stores_zeros() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, scale = quantize_weight(w)
    assert torch.equal(q[:, :128].float(), torch.zeros(128, 128)) and scale[0, 0] > 0
    assert torch.equal(dequantize_weight(q, scale, torch.float32), w)


def test_block_fp8_matmul_ref_is_the_product_of_the_dequantized_operands() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 200, generator=gen), torch.randn(70, 200, generator=gen) * 0.1
    a, a_s = quantize_activations_ref(x)
    b, b_s = quantize_weight(w)
    want = (a.double() * expand_scale(a_s, 9, 200, scale_rows=1).double()) @ dequantize_weight(b, b_s, torch.float64).T
    got = block_fp8_matmul_ref(a, a_s, b, b_s)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # and both sit near the float32 product (the quantization error of e4m3)
    assert (got - x @ w.T).abs().max() < 0.05 * (x @ w.T).abs().max()


def _representable(m: int, k: int, seed: int) -> torch.Tensor:
    """x [m, k] whose quantization needs no rounding: per 128-column group, fp8 values times 2^e with amax 448 * 2^e."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes[:, ::128] = FP8_MAX  # each group's first column holds its amax
    exps = torch.randint(-8, 4, (m, -(-k // 128)), generator=gen).float()
    return codes * torch.exp2(exps).repeat_interleave(128, 1)[:, :k]


@needs_fp8_gpu
@pytest.mark.parametrize("m, k", [(1, 128), (5, 200), (33, 576), (3, 1300)])
def test_activation_quantization_matches_the_reference(m: int, k: int) -> None:
    from nvcli.kernels.fp8_gemm import quantize_activations_triton

    x = _representable(m, k, seed=m) if INTERPRETED else torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    q, s = on_device(quantize_activations_triton)(x)
    q_ref, s_ref = quantize_activations_ref(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_fp8_gpu
def test_the_gemm_layout_pads_rows_to_4_and_stores_scales_m_major() -> None:
    from nvcli.kernels.fp8_gemm import quantize_activations_triton

    x = _representable(5, 200, seed=3) if INTERPRETED else torch.randn(5, 200, generator=torch.Generator().manual_seed(3))
    q, s = on_device(quantize_activations_triton)(x, m_major=True)
    q_ref, s_ref = quantize_activations_ref(x)
    assert q.shape == (8, 200) and s.shape == (8, 2) and s.stride() == (1, 8)
    assert torch.equal(s[:5], s_ref) and torch.equal(q[:5].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(q[5:].float(), torch.zeros(3, 200))  # padding rows quantize zeros


@needs_fp8_gpu
@pytest.mark.parametrize("m, n, k", [(1, 96, 128), (3, 200, 320), (17, 64, 130), (70, 256, 256)])
@pytest.mark.parametrize("scale_rows", [128, 1])
def test_fp8_matmul_matches_the_reference(m: int, n: int, k: int, scale_rows: int) -> None:
    from nvcli.kernels.fp8_gemm import fp8_matmul_triton

    x, w, b = linear_inputs(m, n, k, seed=m + n + k)
    a, a_s = quantize_activations_ref(x)
    wq, w_s = quantize_weight(w)
    if scale_rows == 1:  # per-row scales, each row its own (as a fused layer with unaligned shards holds them)
        w_s = w_s.repeat_interleave(128, 0)[:n] * torch.linspace(0.5, 1.5, n)[:, None]
    a_s = a_s.t().contiguous().t() if m % 2 else a_s  # both scale layouts: row-major and M-major
    for bias in (None, b):
        out = torch.empty(m, n)
        got = on_device(fp8_matmul_triton)(a, a_s, wq, w_s, out, bias, scale_rows)
        want = block_fp8_matmul_ref(a, a_s, wq, w_s, scale_rows) + (0 if bias is None else bias)
        # Hopper's FP8 tensor cores add a K block's products with fewer mantissa bits than float32 (DeepSeek-V3's
        # report: ~14), so each 128-wide block's partial carries a relative error near 1e-4 there; the interpreter
        # computes in float32
        tol = 1e-5 if INTERPRETED else 1e-3
        assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()), (got - want).abs().max()


@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 12, 40, 300])
def test_fp8_linear_matches_the_reference(m: int) -> None:
    from nvcli.kernels.fp8_gemm import fp8_linear_gpu

    n, k = 192, 384
    x, w, b = linear_inputs(m, n, k, seed=m)
    if INTERPRETED:
        x = _representable(m, k, seed=m)
    wq, w_s = quantize_weight(w)
    dtype = torch.float32 if INTERPRETED else torch.bfloat16
    got = on_device(fp8_linear_gpu)(x.to(dtype), wq, w_s, b.to(dtype))
    want = fp8_linear_ref(x.to(dtype), wq, w_s, b.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (got.float() - want.float()).abs().max()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@needs_fp8_gpu
def test_fp8_linear_is_captured_by_a_cuda_graph() -> None:
    from nvcli.kernels.fp8_gemm import fp8_linear_gpu

    x, w, _ = linear_inputs(8, 512, 1024, seed=1, dtype=torch.bfloat16)
    wq, w_s = (t.cuda() for t in quantize_weight(w.float()))
    x = x.cuda()
    fp8_linear_gpu(x, wq, w_s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear_gpu(x, wq, w_s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.allclose(y.float(), fp8_linear_gpu(x, wq, w_s).float())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="cuBLASLt runs on a GPU")
@needs_fp8_gpu
@pytest.mark.parametrize("m, scale_rows", [(1, 128), (37, 128), (300, 1)])
def test_cublas_block_scaled_gemm_matches_the_reference(m: int, scale_rows: int) -> None:
    from nvcli.kernels.fp8_gemm import cublas_supported, cublas_weight_scales, fp8_linear_gpu

    if not cublas_supported(torch.device("cuda"), torch.bfloat16, scale_rows):
        pytest.skip("cuBLASLt's block-scaled GEMM is missing here, or got this scale format wrong at its probe")
    n, k = 384, 512
    x, w, b = linear_inputs(m, n, k, seed=m)
    wq, w_s = quantize_weight(w)
    if scale_rows == 1:
        w_s = w_s.repeat_interleave(128, 0)[:n] * torch.linspace(0.5, 1.5, n)[:, None]
    x, wq, w_s, b = x.cuda().bfloat16(), wq.cuda(), w_s.cuda(), b.cuda().bfloat16()
    got = fp8_linear_gpu(x, wq, w_s, b, scale_rows, cublas_weight_scales(w_s, scale_rows))
    want = fp8_linear_ref(x, wq, w_s, b, scale_rows)
    assert got.shape == (m, n)
    # the probe's bound: bf16 outputs of FP8 products, summed in another order
    tol = 1e-2 * want.float().abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=tol), (got.float() - want.float()).abs().max()


def _silu_then_quantize(x):
    from nvcli.kernels.activation import silu_and_mul_quant_triton, silu_and_mul_triton
    from nvcli.kernels.fp8_gemm import quantize_activations_triton

    return silu_and_mul_quant_triton(x), quantize_activations_triton(silu_and_mul_triton(x), m_major=True)


@needs_fp8_gpu
@pytest.mark.parametrize("rows, d", [(1, 64), (3, 300), (9, 1280)])
def test_silu_and_mul_writes_the_fp8_gemm_input_as_quantizing_its_output_would(rows: int, d: int) -> None:
    gen = torch.Generator().manual_seed(rows + d)
    dtype = torch.float32 if INTERPRETED else torch.bfloat16
    x = (torch.randn(rows, 2 * d, generator=gen) * 3).to(dtype)
    (q, s), (q_ref, s_ref) = on_device(_silu_then_quantize)(x)
    assert q.shape == q_ref.shape and s.stride() == s_ref.stride()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
