"""Row-scaled FP8 projections (kernels/fp8_rows.py): every kernel that quantizes rows (the per-row kernel, the
add+RMSNorm kernel, SiLU-and-mul) gives quantize_rows_ref's bits, the norm applies a pending row scale as the torch
reference does, and a per-tensor FP8 layer's paths (forward_norm, forward_partial, forward_silu_mul) leave the
reference product's rows with their scales pending (Triton interpreter and torch._scaled_mm on the CPU, or the
GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, linear_inputs, on_device

from nvcli.kernels import activation, fp8_rows, rms_norm
from nvcli.kernels.block_fp8 import FP8_DTYPE, FP8_MAX, quantize_weight_per_tensor

rms_norm_triton = on_device(rms_norm.rms_norm_triton)
silu_and_mul_triton = on_device(activation.silu_and_mul_triton)
silu_quant_rows = on_device(activation.silu_and_mul_quant_rows_triton)
quantize_rows = on_device(fp8_rows.quantize_rows_triton)


def _data(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp(2 * torch.randn(shape[0], 1, generator=gen))  # uneven rows
    return x.to(dtype)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k", [(1, 64), (3, 200), (5, 2048), (4, 5000)])  # 5000: three passes of 2,048
def test_the_row_kernel_gives_the_references_bits(dtype: torch.dtype, m: int, k: int) -> None:
    x = _data((m, k), 1, dtype)
    x[0, : k // 2] = 0.0  # ties to even and zeros
    assert _same(quantize_rows(x), fp8_rows.quantize_rows_ref(x))
    zero = torch.zeros(2, k, dtype=dtype)
    q, s = quantize_rows(zero)
    assert torch.all(q.float() == 0) and torch.equal(s, fp8_rows.quantize_rows_ref(zero)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
def test_the_norm_kernel_quantizes_its_rows_and_applies_a_pending_scale(dtype: torch.dtype, with_residual: bool,
                                                                         with_scale: bool) -> None:
    x, w = _data((7, 96), 0, dtype), (1 + 0.1 * _data((1, 96), 1, torch.float32)[0]).to(dtype)
    res = _data((7, 96), 2, dtype) if with_residual else None
    x_scale = torch.rand(7) * 3 + 0.01 if with_scale else None
    q, s, new_res = rms_norm_triton(x, w, 1e-6, res, x_scale, quantize=True)
    scaled = fp8_rows.apply_row_scale(x, x_scale)  # the reference: the GEMM's output scaled in the model dtype
    want_res = scaled if res is None else (scaled.float() + res.float()).to(dtype)
    _near(new_res, want_res)
    normed, _ = rms_norm_triton(new_res, w, 1e-6)  # the norm of the kernel's own sum, quantized: the same bits
    assert _same((q, s), fp8_rows.quantize_rows_ref(normed))
    if with_scale:  # unquantized with a pending scale
        out, out_res = rms_norm_triton(x, w, 1e-6, res, x_scale)
        assert torch.equal(out_res, new_res) and torch.equal(out, normed)


def _near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the roundings the reference makes apart: float32 one (the GPU contracts x * s + r into one FMA), bf16
    two (the scale's, the add's: Triton's interpreter casts to bf16 by truncation, the GPU to nearest); against the
    largest value where the add cancels."""
    ulp = 2**-23 if got.dtype == torch.float32 else 2**-7
    assert torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=ulp * want.float().abs().max().item())


@pytest.mark.parametrize("d, held", [(96, 16384), (2500, 16384), (2500, 1024), (4100, 1024)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_silu_quantized_per_row_is_the_reference_of_the_plain_kernel(d: int, held: int, with_scale: bool,
                                                                      monkeypatch) -> None:
    """A row held whole (one pass) or in blocks of `held` columns (the amax pass, then the quantizing one)."""
    monkeypatch.setattr(activation, "QUANT_ROW_BLOCK", held)
    x = _data((5, 2 * d), 3, torch.bfloat16)
    scale = torch.rand(5) * 2 + 0.05 if with_scale else None
    got = silu_quant_rows(x, scale)
    assert _same(got, fp8_rows.quantize_rows_ref(silu_and_mul_triton(x, scale)))


def test_ties_round_to_even_and_carry_into_the_exponent() -> None:
    # amax 448 -> scale exactly 1, so each value below is the quotient itself
    values = [448.0, 17.0, 19.0, 31.0, 432.0, -17.0, -31.0, 2.0**-10, 3 * 2.0**-10, 1e-30, -1e-30, -0.0, 0.3]
    want = [448.0, 16.0, 20.0, 32.0, 448.0, -16.0, -32.0, 0.0, 2.0**-8, 0.0, -0.0, -0.0, 0.3125]
    x = torch.tensor([values])
    q, s = quantize_rows(x)
    assert s.tolist() == [1.0] and q.float().tolist() == [want]
    assert torch.equal(torch.signbit(q.float()), torch.signbit(torch.tensor([want])))  # -0 stays -0
    assert _same((q, s), fp8_rows.quantize_rows_ref(x))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_an_outlier_sets_its_own_rows_scale_only(sign: float) -> None:
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 0.01
    x[4, 123] = sign * 1e4
    q, s = quantize_rows(x)
    assert q[4, 123].float().item() == sign * FP8_MAX and s[4].item() == pytest.approx(1e4 / FP8_MAX)
    others = torch.cat([q[:4], q[5:]]).float().abs().amax(dim=1)
    assert torch.all(others == FP8_MAX)  # every other row still spans e4m3's whole range
    assert _same((q, s), fp8_rows.quantize_rows_ref(x))


@pytest.mark.parametrize("n, k", [(64, 128), (200, 320)])
def test_weight_round_trip_is_within_half_an_fp8_step(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    w[3, 5] = 2.0  # the amax
    q, scale = quantize_weight_per_tensor(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (1,) and q[3, 5].float().item() == FP8_MAX
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: within 1/16 of each entry, plus half the subnormal step 2^-9 * scale
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2**-10).all()


@pytest.mark.parametrize("m", [1, 7, 64])
def test_the_row_scaled_product_is_near_the_full_precision_one(m: int) -> None:
    x, w, _ = linear_inputs(m, 96, 512, seed=m)
    x = x * torch.exp(2 * torch.randn(m, 1, generator=torch.Generator().manual_seed(m)))  # rows of other sizes
    wq, w_s = quantize_weight_per_tensor(w)
    y, scale = fp8_rows.rows_product(x, wq, w_s)
    got = fp8_rows.apply_row_scale(y, scale)
    want = x @ w.T
    assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < 0.08  # every row, whatever its size


def test_tensor_gemm_is_not_supported_off_cuda() -> None:
    assert fp8_rows.tensor_gemm_supported(torch.device("cpu"), torch.bfloat16) is False


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch._scaled_mm runs on a GPU")
@pytest.mark.parametrize("m", [1, 5, 33, 256])
def test_the_gpu_product_matches_the_reference(m: int) -> None:
    if not fp8_rows.tensor_gemm_supported(torch.device("cuda"), torch.bfloat16):
        pytest.skip("no working torch._scaled_mm FP8 GEMM here")
    x, w, _ = linear_inputs(m, 256, 384, seed=m)
    q, _ = fp8_rows.quantize_rows_ref(x)
    wq, w_s = quantize_weight_per_tensor(w)
    got = fp8_rows.rows_linear_gpu(q.cuda(), wq.cuda(), w_s.cuda(), torch.bfloat16).float().cpu()
    want = fp8_rows.rows_linear_ref(q, wq, w_s, torch.float32)
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


def test_silu_quantized_per_row_takes_gate_and_up_factors() -> None:
    """A gate_up weight whose gate and up kept a scale each: SiLU-and-mul scales gate by the row's scale times
    gate's factor and up by up's (float32: one rounding each, as scaling the projection first)."""
    d = 300
    x = _data((5, 2 * d), 4, torch.float32)
    scale = torch.rand(5) * 2 + 0.05
    ratios = torch.tensor([1.0, 0.4375])
    cols = ratios.repeat_interleave(torch.tensor([d, d]))
    got = silu_quant_rows(x, scale, ratios=ratios)
    assert _same(got, fp8_rows.quantize_rows_ref(silu_and_mul_triton(fp8_rows.apply_row_scale(x, scale, cols))))
    assert not _same(got, silu_quant_rows(x, scale))  # up's factor did count


def _layer(kind: str, in_features: int, out_features: int):
    """A --quantization fp8 layer as where the row path runs: "column", "row", or "merged" (gate_up of two
    out_features parts loaded one by one, the second 8x the first's magnitude: each keeps its own scale)."""
    from nvcli.models.layers.fp8 import Fp8Spec, finish_fp8_layers, fp8_projections
    from nvcli.models.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

    with fp8_projections(Fp8Spec(checkpoint=False, per_tensor=True)):
        if kind == "merged":
            layer = MergedColumnParallelLinear(in_features, [out_features, out_features])
        else:
            layer = (ColumnParallelLinear if kind == "column" else RowParallelLinear)(in_features, out_features)
    layer.to(DEVICE)
    if kind == "merged":
        gen = torch.Generator().manual_seed(0)
        for part, size in ((0, 0.02), (1, 0.16)):
            layer.weight_loader(layer.weight, torch.randn(out_features, in_features, generator=gen) * size, part)
    else:
        layer.fp8.load_dummy(torch.Generator(device=DEVICE).manual_seed(0))
    finish_fp8_layers(layer, keep=True, dtype=torch.bfloat16)
    # as where the tensor-scaled GEMM runs
    layer.fp8.tensor_scale, layer.fp8.shard_ratios, layer.fp8.col_ratios = layer.fp8.shard_scales()
    return layer


def _close(got, want: torch.Tensor) -> None:
    from nvcli.models.layers.fp8 import RowScaled

    assert isinstance(got, RowScaled)
    y = got.materialize().float()
    assert torch.allclose(y, want.float(), rtol=2e-2, atol=1e-2 * want.float().abs().max().item())


def _reference(rows: torch.Tensor, layer) -> torch.Tensor:
    """The row-scaled product in float32: rows quantized per row, times the weight as its parts' scales dequantize
    it (kernels/block_fp8.py: the block scales hold each part's)."""
    from nvcli.kernels.block_fp8 import dequantize_weight

    q, s = fp8_rows.quantize_rows_ref(rows)
    w = dequantize_weight(layer.weight, layer.weight_scale, torch.float32, layer.fp8.scale_rows)
    return (q.float() @ w.T) * s[:, None]


def test_a_fused_layers_parts_keep_their_own_scales_and_the_output_carries_their_ratios() -> None:
    layer = _layer("merged", 256, 128)
    ratios = layer.fp8.shard_ratios
    assert ratios is not None and ratios.tolist()[1] == 1.0 and 0.05 < ratios.tolist()[0] < 0.25  # gate's is smaller
    x = _data((6, 256), 8, torch.bfloat16).to(DEVICE)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    y, new_res = layer.forward_norm(x, None, w, 1e-6)
    assert torch.equal(y.ratios, ratios) and y.col_scale.shape == (256,)
    _close(y, _reference(rms_norm.rms_norm_triton(x, w, 1e-6)[0], layer))


def test_a_norm_then_projection_leaves_the_row_scales_pending() -> None:
    from nvcli.models.layers.fp8 import RowScaled

    layer = _layer("column", 256, 128)
    x, res = _data((6, 256), 5, torch.bfloat16).to(DEVICE), _data((6, 256), 6, torch.bfloat16).to(DEVICE)
    x_scale = (torch.rand(6) + 0.5).to(DEVICE)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    y, new_res = layer.forward_norm(RowScaled(x, x_scale), res, w, 1e-6)
    _, want_res = rms_norm.rms_norm_triton(fp8_rows.apply_row_scale(x, x_scale), w, 1e-6, res)
    _near(new_res, want_res)
    _close(y, _reference(rms_norm.rms_norm_triton(new_res, w, 1e-6)[0], layer))  # the norm of its own sum


def test_a_silu_then_down_projection_leaves_the_row_scales_pending() -> None:
    from nvcli.models.layers.fp8 import RowScaled

    layer = _layer("row", 1280, 128)
    gate_up = _data((6, 2 * 1280), 7, torch.bfloat16).to(DEVICE)
    scale = (torch.rand(6) + 0.5).to(DEVICE)
    y = layer.forward_silu_mul(RowScaled(gate_up, scale))
    o = layer.forward_partial(gate_up[:, :1280].contiguous())
    _close(y, _reference(activation.silu_and_mul_triton(gate_up, scale), layer))
    _close(o, _reference(gate_up[:, :1280], layer))
