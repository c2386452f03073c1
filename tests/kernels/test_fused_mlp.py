"""fused_mlp_triton (one launch for a token's MLP) against the norm layer, F.linear and SiLU in torch.

On the CPU the Triton interpreter runs the programs one after another, so a grid barrier with more
than one program would never open there: those tests use one program (both phases, the barrier
passes at once). On a GPU the grid is also run at its default (one program per SM) and with a few
programs that each take several blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE, on_device

from nvcli.kernels import fused_mlp
from nvcli.models.layers.norm import RMSNorm

fused = on_device(fused_mlp.fused_mlp_triton)
GRIDS = [1] if DEVICE.type == "cpu" else [1, 3, None]


def _reference(x, r, norm, w_gu, w_down):
    normed, new_r = norm(x, r) if r is not None else (norm(x), x)
    gate, up = F.linear(normed, w_gu).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down), new_r


@pytest.mark.parametrize("h,inter", [(64, 96), (80, 200), (256, 1024)])  # even and masked K steps
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_fused_mlp_matches_unfused(h: int, inter: int, with_residual: bool, grid: int | None) -> None:
    gen = torch.Generator().manual_seed(h + inter)
    x = torch.randn(1, h, generator=gen)
    r = torch.randn(1, h, generator=gen) if with_residual else None
    norm = RMSNorm(h, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(h, generator=gen)
    w_gu = torch.randn(2 * inter, h, generator=gen) * h**-0.5
    w_down = torch.randn(h, inter, generator=gen) * inter**-0.5
    ref, ref_r = _reference(x, r, norm, w_gu, w_down)
    out, new_r = fused(x, r, norm.weight, 1e-6, w_gu, w_down, num_programs=grid)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_r, ref_r, atol=0, rtol=0)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="bf16 rounding chain and repeated launches: GPU")
def test_fused_mlp_bf16_matches_unfused_kernels_and_relaunches() -> None:
    """Against the unfused Triton kernels in bf16 (same roundings; only the order of the fp32 sums
    differs), and the barrier's counters are reusable: many launches in a row all open it."""
    from nvcli.kernels.skinny_gemm import norm_linear, silu_mul_linear

    gen = torch.Generator().manual_seed(0)
    h, inter = 1024, 3072
    x = torch.randn(1, h, generator=gen).to(DEVICE, torch.bfloat16)
    r = torch.randn(1, h, generator=gen).to(DEVICE, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(h, generator=gen)).to(DEVICE, torch.bfloat16)
    w_gu = (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(DEVICE, torch.bfloat16)
    w_down = (torch.randn(h, inter, generator=gen) * inter**-0.5).to(DEVICE, torch.bfloat16)
    gate_up, ref_r = norm_linear(x, r, nw, 1e-6, w_gu)
    ref = silu_mul_linear(gate_up, w_down)
    for _ in range(50):
        out, new_r = fused_mlp.fused_mlp_triton(x, r, nw, 1e-6, w_gu, w_down)
    torch.cuda.synchronize()
    assert torch.equal(new_r, ref_r)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
