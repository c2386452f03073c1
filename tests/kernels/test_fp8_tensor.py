"""Per-tensor FP8 (kernels/fp8_tensor.py): the torch references, and the Triton quantization against them bit for bit,
on the GPU (compute capability >= 8.9) or under the Triton interpreter on the CPU. The kernel rounds to e4m3 itself
before its cast, so unlike kernels/fp8_gemm.py's tests these take random inputs on the CPU too."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, linear_inputs, on_device

from nvcli.kernels.block_fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX
from nvcli.kernels.fp8_tensor import (
    MAX_PARTIALS,
    _plan,
    fp8_tensor_linear_ref,
    quantize_per_tensor_ref,
    quantize_per_tensor_triton,
    quantize_weight_per_tensor,
    tensor_gemm_supported,
)

needs_fp8_gpu = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 conversions need compute capability 8.9 or newer",
)
EPS_SCALE = torch.tensor([ACT_EPS], dtype=torch.float32) / torch.tensor([FP8_MAX], dtype=torch.float32)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32)), (s, s_ref)
    diff = (_bits(q) != _bits(q_ref)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


def _wide_range(m: int, k: int, seed: int) -> torch.Tensor:
    """Normal values times powers of two from 2^-12 to 2^3: many land in e4m3's subnormals once scaled."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 4, (m, k), generator=gen).float())


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 128, 200, 4096])
@pytest.mark.parametrize("m", [1, 3, 16, 100, 300])
def test_triton_quantization_gives_the_reference_bits(m: int, k: int, dtype: torch.dtype) -> None:
    x = _wide_range(m, k, seed=m * 10_000 + k).to(dtype)
    _assert_same_bits(on_device(quantize_per_tensor_triton)(x), quantize_per_tensor_ref(x))


@needs_fp8_gpu
def test_rows_with_a_stride_wider_than_k() -> None:
    x = _wide_range(37, 384, seed=5)[:, 50:250]  # stride(0) 384, K 200
    _assert_same_bits(on_device(quantize_per_tensor_triton)(x), quantize_per_tensor_ref(x))


@needs_fp8_gpu
def test_ties_round_to_even_and_carry_into_the_exponent() -> None:
    # amax 448 -> scale exactly 1, so each value below is the quotient itself
    values = [448.0, 17.0, 19.0, 31.0, 432.0, -17.0, -31.0, 2.0**-10, 3 * 2.0**-10, 1e-30, -1e-30, -0.0, 0.3]
    want = [448.0, 16.0, 20.0, 32.0, 448.0, -16.0, -32.0, 0.0, 2.0**-8, 0.0, -0.0, -0.0, 0.3125]
    x = torch.tensor([values])
    q, s = on_device(quantize_per_tensor_triton)(x)
    assert s.item() == 1.0
    assert q.float().tolist() == [want]
    assert torch.equal(torch.signbit(q.float()), torch.signbit(torch.tensor([want])))  # -0 stays -0
    _assert_same_bits((q, s), quantize_per_tensor_ref(x))


@needs_fp8_gpu
@pytest.mark.parametrize("m, k", [(1, 64), (50, 200)])
def test_an_all_zero_input_gives_zeros_and_the_eps_scale(m: int, k: int) -> None:
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    q, s = on_device(quantize_per_tensor_triton)(x)
    assert torch.equal(_bits(q), torch.zeros(m, k, dtype=torch.uint8))
    assert torch.equal(s, EPS_SCALE)
    _assert_same_bits((q, s), quantize_per_tensor_ref(x))


def test_an_empty_input_launches_nothing_and_has_the_eps_scale() -> None:
    x = torch.empty(0, 128)
    q, s = quantize_per_tensor_triton(x)  # no kernel runs: CPU tensors work without the interpreter too
    assert q.shape == (0, 128) and q.dtype == FP8_DTYPE
    assert torch.equal(s, EPS_SCALE)
    _assert_same_bits((q, s), quantize_per_tensor_ref(x))


@needs_fp8_gpu
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_huge_outlier_maps_to_448_and_sets_the_scale(sign: float) -> None:
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(1)) * 0.01
    x[17, 123] = sign * 1e4
    q, s = on_device(quantize_per_tensor_triton)(x)
    assert q[17, 123].float().item() == sign * FP8_MAX
    assert torch.equal(s, torch.tensor([1e4]) / torch.tensor([FP8_MAX]))
    rest = q.float().abs()
    rest[17, 123] = 0
    assert rest.max() < 1.0  # everything else is tiny next to the outlier
    _assert_same_bits((q, s), quantize_per_tensor_ref(x))


@pytest.mark.parametrize("m, k", [(1, 64), (1, 100_000), (300, 4096), (5_000, 7), (10**6, 4096), (1025, 8192)])
def test_the_launch_plan_covers_every_row_with_at_most_1024_programs(m: int, k: int) -> None:
    rows, programs, block_m, block_k = _plan(m, k)
    assert 1 <= programs <= MAX_PARTIALS
    assert (programs - 1) * rows < m <= programs * rows  # every row in one program, no program empty
    assert block_m & (block_m - 1) == 0 and block_k & (block_k - 1) == 0 and block_m * block_k <= 4096
    assert _plan(m, k) == (rows, programs, block_m, block_k)


@pytest.mark.parametrize("n, k", [(64, 128), (200, 320)])
def test_weight_round_trip_is_within_half_an_fp8_step(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    w[3, 5] = 2.0  # the amax
    q, scale = quantize_weight_per_tensor(w)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == pytest.approx(2.0 / FP8_MAX, rel=1e-7)
    assert q[3, 5].float().item() == FP8_MAX
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: within 1/16 of each entry, plus half the subnormal step 2^-9 * scale
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2**-10).all()
    assert (back - w).norm() / w.norm() < 0.04


def test_an_all_zero_weight_stores_zeros() -> None:
    q, scale = quantize_weight_per_tensor(torch.zeros(32, 16))
    assert torch.equal(q.float(), torch.zeros(32, 16)) and scale.item() > 0


@pytest.mark.parametrize("m", [1, 7, 64])
def test_the_reference_linear_is_near_the_full_precision_product(m: int) -> None:
    n, k = 96, 512
    x, w, b = linear_inputs(m, n, k, seed=m)
    wq, w_s = quantize_weight_per_tensor(w)
    want = x @ w.T + b
    got = fp8_tensor_linear_ref(x, wq, w_s, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 0.08
    # and it is exactly the dequantized product of what the two quantizers produced
    q, s = quantize_per_tensor_ref(x)
    assert torch.allclose(got, (q.float() * s) @ (wq.float() * w_s).T + b, rtol=1e-5, atol=1e-5)


def test_the_reference_linear_keeps_leading_dims_and_dtype() -> None:
    x, w, b = linear_inputs(6, 48, 64, seed=3)
    wq, w_s = quantize_weight_per_tensor(w)
    x3 = x.view(2, 3, 64).to(torch.bfloat16)
    got = fp8_tensor_linear_ref(x3, wq, w_s, b.to(torch.bfloat16))
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    flat = fp8_tensor_linear_ref(x3.reshape(6, 64), wq, w_s, b.to(torch.bfloat16))
    assert torch.equal(got.reshape(6, 48), flat)
    want = x3.float().reshape(6, 64) @ w.T + b
    assert (got.float().reshape(6, 48) - want).norm() / want.norm() < 0.08


def test_tensor_gemm_is_not_supported_off_cuda() -> None:
    assert tensor_gemm_supported(torch.device("cpu"), torch.bfloat16) is False
    assert tensor_gemm_supported(torch.device("cpu"), torch.float32) is False


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch._scaled_mm runs on a GPU")
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gpu_linear_matches_the_reference(m: int, dtype: torch.dtype) -> None:
    from nvcli.kernels.fp8_tensor import fp8_tensor_linear_gpu

    if not tensor_gemm_supported(torch.device("cuda"), dtype):
        pytest.skip("no working torch._scaled_mm FP8 GEMM here")
    n, k = 256, 384
    x, w, b = linear_inputs(m, n, k, seed=m)
    wq, w_s = (t.cuda() for t in quantize_weight_per_tensor(w))
    x, b = x.cuda().to(dtype), b.cuda().to(dtype)
    for bias in (None, b):
        got = fp8_tensor_linear_gpu(x, wq, w_s, bias).float()
        want = fp8_tensor_linear_ref(x, wq, w_s, bias).float()
        assert got.shape == (m, n)
        tol = 1e-2 * want.abs().max().item()
        assert torch.allclose(got, want, rtol=2e-2, atol=tol), (got - want).abs().max()
