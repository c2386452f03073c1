"""kernels/fused_moe_fp8.py: the FP8 grouped GEMMs (W8A8, block-scaled weights) against layers/moe_fp8.py's torch
reference, on the GPU (compute capability >= 8.9) or under the Triton interpreter on the CPU.

Under the interpreter the tokens' hidden states are exact in fp8 per 128-column group (test_fp8_gemm's
`_representable`: the activation quantization kernel of fp8_gemm.py is only exact there), while the activation
between the GEMMs is quantized inside the gate/up kernel on any values; the products of fp8 values are exact in
float32, so the kernel and the reference differ only in summation order. On the GPU, FP8 tensor cores accumulate a
K block's products with fewer bits than float32, which moves some activations across an fp8 rounding boundary: a
looser tolerance there."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_device import DEVICE, on_device
from test_fp8_gemm import INTERPRETED, _representable, needs_fp8_gpu
from test_fused_moe import routing

from nvcli.kernels.block_fp8 import FP8_DTYPE, FP8_MAX, quantize_weight
from nvcli.kernels.fused_moe_fp8 import _round_e4m3, fused_moe_fp8_triton
from nvcli.models.layers.moe_fp8 import fused_experts_fp8_ref


def _quantize_experts(w: torch.Tensor, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, halves * R, C] float -> (fp8, scales [E, halves * ceil(R / 128), ceil(C / 128)]), each half of each
    expert quantized as its own checkpoint tensor."""
    qs, ss = [], []
    for e in range(w.shape[0]):
        parts = [quantize_weight(p) for p in w[e].chunk(halves)]
        qs.append(torch.cat([q for q, _ in parts]))
        ss.append(torch.cat([s for _, s in parts]))
    return torch.stack(qs), torch.stack(ss)


def _inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int, dtype: torch.dtype,
            skew: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # exact in fp8 per group under the interpreter (scaled by a power of two: still exact), up to 28 in magnitude
    x = _representable(tokens, hidden, seed) * 2.0**-7 if INTERPRETED else torch.randn(tokens, hidden, generator=gen)
    w13, s13 = _quantize_experts(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5, 2)
    w2, s2 = _quantize_experts(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5, 1)
    weights, ids = routing(tokens, experts, top_k, dtype, skew, gen)
    return x.to(dtype), w13, s13, w2, s2, weights, ids


def _check(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs()
    assert err.max().item() <= tol * scale, (err.max().item(), scale)


@triton.jit
def _cast_kernel(v_ptr, q_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(q_ptr + offs, _round_e4m3(tl.load(v_ptr + offs)).to(q_ptr.dtype.element_ty))


@needs_fp8_gpu
def test_activations_round_to_e4m3_as_torch_casts() -> None:
    """_round_e4m3 then the cast gives torch's round-to-nearest-even float32 -> e4m3 bits: normal values (ties and
    carries into the exponent among them), subnormals, zero and the saturated ends."""
    gen = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(4096).uniform_(-12, 8.8, generator=gen)).clamp(max=FP8_MAX)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = codes[codes.isfinite()]
    ties = (codes[:-1] + codes[1:]) / 2  # halfway between neighbours (31.5 -> 32: a carry into the exponent)
    v = torch.cat([mags, -mags, codes, ties[ties.abs() < FP8_MAX], torch.tensor([0.0, FP8_MAX, -FP8_MAX, 31.7])])
    v = torch.cat([v, torch.zeros(-len(v) % 1024)])
    q = torch.empty(len(v), dtype=FP8_DTYPE)
    on_device(lambda a, b: _cast_kernel[(len(a) // 1024,)](a, b, BLOCK=1024))(v, q)
    want = v.to(FP8_DTYPE)
    assert torch.equal(q.float(), want.float()), (v[q.float() != want.float()][:8], q.float()[q.float() != want.float()][:8])


@needs_fp8_gpu
@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k, block_m, skew", [
    (1, 64, 32, 4, 2, None, False),  # one decode row; one partial block each way, 64-wide down tiles
    (7, 192, 160, 4, 2, 16, True),  # two K blocks (the second partial), two activation groups, two down tiles
    (13, 128, 256, 8, 2, None, False),  # whole blocks
    (5, 64, 256, 4, 2, None, True),  # two activation groups into a 64-wide down tile (test_fp8_moe's aligned shape)
    (40, 96, 48, 8, 2, 64, True),  # groups larger than one block of some experts, smaller of others
])
def test_fused_moe_fp8_matches_the_reference(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                                             block_m: int | None, skew: bool) -> None:
    x, w13, s13, w2, s2, weights, ids = _inputs(tokens, hidden, inter, experts, top_k, seed=tokens + hidden,
                                                dtype=torch.float32, skew=skew)
    if skew:
        assert not (ids == experts - 1).any()  # an expert with zero tokens
    want = fused_experts_fp8_ref(x, w13, s13, w2, s2, weights, ids)
    got = on_device(fused_moe_fp8_triton)(x, w13, s13, w2, s2, weights, ids, block_m=block_m)
    _check(got, want, 1e-5 if INTERPRETED else 2e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 FP8 tensor cores: on the GPU")
@needs_fp8_gpu
def test_fused_moe_fp8_bfloat16_on_the_gpu() -> None:
    x, w13, s13, w2, s2, weights, ids = _inputs(300, 512, 384, 16, 4, seed=5, dtype=torch.bfloat16, skew=True)
    # the reference rounds where the kernel does (gate, up, SiLU * up to bf16 before the activation is quantized):
    # against a float32 reference each bf16 rounding moves some activations across an fp8 step (1/16 relative),
    # which an H200 measured as a 1.6% mean difference
    want = fused_experts_fp8_ref(x, w13, s13, w2, s2, weights, ids).float()
    got = on_device(fused_moe_fp8_triton)(x, w13, s13, w2, s2, weights, ids)
    _check(got, want, 3e-2)
    assert (got.float() - want).abs().mean() < 1e-2 * want.abs().mean()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: on the GPU")
@needs_fp8_gpu
def test_fused_moe_fp8_captures_into_a_cuda_graph() -> None:
    """No host sync and no data-dependent shape: a graph captured with one routing replays another correctly."""
    x, w13, s13, w2, s2, weights, ids = (t.to(DEVICE) for t in _inputs(8, 256, 128, 8, 2, seed=1,
                                                                         dtype=torch.bfloat16))
    fused_moe_fp8_triton(x, w13, s13, w2, s2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_fp8_triton(x, w13, s13, w2, s2, weights, ids)
    *_, weights2, ids2 = _inputs(8, 256, 128, 8, 2, seed=2, dtype=torch.bfloat16, skew=True)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    want = fused_moe_fp8_triton(x, w13, s13, w2, s2, weights, ids)
    assert torch.equal(out, want)
    assert w13.dtype == FP8_DTYPE
