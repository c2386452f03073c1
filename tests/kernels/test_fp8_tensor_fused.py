"""Per-tensor FP8 activations whose amax comes from their producer (kernels/fp8_tensor.py): the norm kernel's row
maxima and the SiLU-and-mul kernel's block maxima are exactly those of what they store, the one-kernel quantization
over them gives the two-kernel path's bits, and an FP8 layer's decode-step GPU paths (forward_norm,
forward_silu_mul) compute the reference product (Triton interpreter and torch._scaled_mm on the CPU, or the GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device

from nvcli.kernels import activation, fp8_tensor, rms_norm

rms_norm_triton = on_device(rms_norm.rms_norm_triton)
silu_and_mul_triton = on_device(activation.silu_and_mul_triton)
quantize = on_device(fp8_tensor.quantize_per_tensor_triton)


def _data(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp(2 * torch.randn(shape[0], 1, generator=gen))  # uneven rows
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_norm_kernel_writes_each_output_rows_amax(dtype: torch.dtype, with_residual: bool) -> None:
    x, w = _data((7, 96), 0, dtype), (1 + 0.1 * _data((1, 96), 1, torch.float32)[0]).to(dtype)
    res = _data((7, 96), 2, dtype) if with_residual else None
    amax = torch.full((7,), -1.0)
    out, new_res = rms_norm_triton(x, w, 1e-6, res, row_amax=amax)
    plain, plain_res = rms_norm_triton(x, w, 1e-6, res)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)  # the outputs are unchanged
    assert torch.equal(amax, out.float().abs().amax(dim=1))


@pytest.mark.parametrize("d", [96, 1024, 2500])  # one block, one whole block, three with a partial last
def test_the_silu_kernel_writes_each_blocks_amax(d: int) -> None:
    x = _data((5, 2 * d), 3, torch.bfloat16)
    blocks = activation.amax_blocks(d)
    amax = torch.full((5, blocks), -1.0)
    out = silu_and_mul_triton(x, amax=amax)
    assert torch.equal(out, silu_and_mul_triton(x))
    width = min(1024, 1 << (d - 1).bit_length())  # the kernel's column block
    want = torch.stack([out[:, i * width : (i + 1) * width].float().abs().amax(dim=1) for i in range(blocks)], 1)
    assert torch.equal(amax, want)


@pytest.mark.parametrize("m, k", [(1, 64), (3, 200), (128, 4096), (300, 512)])
def test_quantizing_over_given_maxima_gives_the_same_bits(m: int, k: int) -> None:
    x = _data((m, k), 4, torch.bfloat16)
    q, scale = quantize(x)
    ref_q, ref_scale = fp8_tensor.quantize_per_tensor_ref(x)
    rows = x.float().abs().amax(dim=1)
    blocks = torch.stack([x[:, i::4].float().abs().amax(dim=1) for i in range(4)], 1).contiguous()  # 4m > 1024 too
    for parts in (rows, blocks):
        got_q, got_scale = quantize(x, parts)
        assert torch.equal(got_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(got_scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)


def _layer(kind: str, in_features: int, out_features: int):
    from nvcli.models.layers.fp8 import Fp8Spec, finish_fp8_layers, fp8_projections
    from nvcli.models.layers.linear import ColumnParallelLinear, RowParallelLinear

    with fp8_projections(Fp8Spec(checkpoint=False)):
        layer = (ColumnParallelLinear if kind == "column" else RowParallelLinear)(in_features, out_features)
    layer.to(DEVICE)
    layer.fp8.load_dummy(torch.Generator(device=DEVICE).manual_seed(0))
    finish_fp8_layers(layer, keep=True, dtype=torch.bfloat16)
    layer.fp8.tensor_scale = layer.fp8.unify_scale()  # as where the tensor-scaled GEMM runs
    return layer


def test_a_decode_steps_norm_then_projection_is_the_reference_product() -> None:
    from nvcli.models.layers.fp8 import decode_steps

    layer = _layer("column", 256, 128)
    x, res = _data((6, 256), 5, torch.bfloat16).to(DEVICE), _data((6, 256), 6, torch.bfloat16).to(DEVICE)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    with decode_steps(True):
        y, new_res = layer.forward_norm(x, res, w, 1e-6)
    normed, want_res = rms_norm.rms_norm_triton(x, w, 1e-6, res)
    want = fp8_tensor.fp8_tensor_linear_ref(normed, layer.weight, layer.fp8.tensor_scale)
    assert torch.equal(new_res, want_res)
    assert torch.allclose(y.float(), want.float(), rtol=2e-2, atol=1e-2 * want.float().abs().max().item())


def test_a_decode_steps_silu_then_down_projection_is_the_reference_product() -> None:
    from nvcli.models.layers.fp8 import decode_steps

    layer = _layer("row", 1280, 128)
    gate_up = _data((6, 2 * 1280), 7, torch.bfloat16).to(DEVICE)
    with decode_steps(True):
        y = layer.forward_silu_mul(gate_up)
    act = activation.silu_and_mul_triton(gate_up)
    want = fp8_tensor.fp8_tensor_linear_ref(act, layer.weight, layer.fp8.tensor_scale)
    assert torch.allclose(y.float(), want.float(), rtol=2e-2, atol=1e-2 * want.float().abs().max().item())
