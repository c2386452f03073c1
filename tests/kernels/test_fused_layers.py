"""Fused rotary(+q/k norm) and SiLU-and-mul kernels against the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from nvcli.models.layers.norm import RMSNorm
from nvcli.models.layers.rotary import RotaryEmbedding


def _run(fn, *tensors):
    moved = [t.to(DEVICE) for t in tensors]
    out = fn(*moved)
    return moved, out


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rope_qk_norm_matches_torch(norm: bool, head_dim: int) -> None:
    from nvcli.kernels.rotary import rope_qk_norm_triton

    torch.manual_seed(0)
    T, H, KH = 5, 4, 2
    width = (H + 2 * KH) * head_dim
    qkv = torch.randn(T, width)
    q = qkv[:, : H * head_dim].view(T, H, head_dim)
    k = qkv[:, H * head_dim : (H + KH) * head_dim].view(T, KH, head_dim)
    positions = torch.tensor([0, 3, 17, 100, 511])
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    qn, kn = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    qn.weight.data = 1 + 0.1 * torch.randn(head_dim)
    kn.weight.data = 1 + 0.1 * torch.randn(head_dim)
    rq, rk = (qn(q), kn(k)) if norm else (q, k)
    rq, rk = rope(positions, rq, rk)

    qkv_d = qkv.clone().to(DEVICE)
    qd = qkv_d[:, : H * head_dim].view(T, H, head_dim)
    kd = qkv_d[:, H * head_dim : (H + KH) * head_dim].view(T, KH, head_dim)
    rope_qk_norm_triton(qd, kd, positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE),
                        qn.weight.to(DEVICE) if norm else None, kn.weight.to(DEVICE) if norm else None, 1e-6)
    torch.testing.assert_close(qd.cpu(), rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kd.cpu(), rk, atol=1e-5, rtol=1e-5)
    # v untouched
    torch.testing.assert_close(qkv_d[:, (H + KH) * head_dim :].cpu(), qkv[:, (H + KH) * head_dim :])


def test_silu_and_mul_matches_torch() -> None:
    from nvcli.kernels.activation import silu_and_mul_triton

    torch.manual_seed(0)
    x = torch.randn(3, 2 * 96)
    ref = torch.nn.functional.silu(x[:, :96]) * x[:, 96:]
    out = silu_and_mul_triton(x.to(DEVICE)).cpu()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
