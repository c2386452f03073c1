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


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_with_cache_store_matches_rope_then_store(group: int, fp8: bool) -> None:
    """The fused path (norm + rotary + KV-cache store in one kernel) writes the cache exactly as the
    separate rotary and store would, skips slot -1, and leaves q as the unfused kernel does."""
    from nvcli.kernels.kv_layout import PagedKV
    from nvcli.kernels.kv_store import store_kvcache_triton
    from nvcli.kernels.rotary import rope_qk_norm_triton

    torch.manual_seed(1)
    T, KH, D, page, nb = 6, 2, 32, 4, 5
    H = KH * group
    qkv = torch.randn(T, (H + 2 * KH) * D)
    q, k, v = qkv.split([H * D, KH * D, KH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KH, D), v.view(T, KH, D)
    positions = torch.tensor([0, 1, 5, 9, 33, 200])
    slots = torch.tensor([3, -1, 0, 17, 8, 19])
    rope = RotaryEmbedding(D, 256, 10000.0, None)
    qw, kw = 1 + 0.1 * torch.randn(D), 1 + 0.1 * torch.randn(D)
    # reference: the kernel without a cache rotates q and k in place, then the separate store
    ref_q = torch.empty_like(q)
    ref_k = torch.empty_like(k)
    qd, kd = q.clone().to(DEVICE), k.clone().to(DEVICE)
    rope_qk_norm_triton(qd, kd, positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE), qw.to(DEVICE), kw.to(DEVICE),
                        1e-6)
    ref_q.copy_(qd.cpu())
    ref_k.copy_(kd.cpu())
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    scale = torch.tensor([0.05]) if fp8 else None
    kc_ref = torch.zeros(nb, page, KH, D, dtype=cache_dtype, device=DEVICE)
    vc_ref = torch.zeros_like(kc_ref)
    # the separate store kernel (the interpreter's fp8 cast truncates, so compare kernel with kernel)
    store_kvcache_triton(ref_k.to(DEVICE), v.to(DEVICE),
                         PagedKV(kc_ref, vc_ref, None if scale is None else scale.to(DEVICE),
                                 None if scale is None else scale.to(DEVICE)), slots.to(DEVICE))
    kc_ref, vc_ref = kc_ref.cpu(), vc_ref.cpu()

    qkv_d = qkv.clone().to(DEVICE)
    q2, k2, v2 = qkv_d.split([H * D, KH * D, KH * D], dim=-1)
    q2, k2, v2 = q2.view(T, H, D), k2.view(T, KH, D), v2.view(T, KH, D)
    kc = torch.zeros(nb, page, KH, D, dtype=cache_dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    sc = None if scale is None else scale.to(DEVICE)
    rope_qk_norm_triton(q2, k2, positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE), qw.to(DEVICE), kw.to(DEVICE),
                        1e-6, v=v2, kv=PagedKV(kc, vc, sc, sc), slot_mapping=slots.to(DEVICE))
    torch.testing.assert_close(q2.cpu(), ref_q, atol=0, rtol=0)
    assert torch.equal(kc.cpu().view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), vc_ref.view(torch.uint8))
    # padding slot (-1) wrote nothing: exactly the 5 real slots are non-zero
    written = (kc.cpu().float().abs().sum(dim=(2, 3)) > 0).sum()
    assert int(written) == 5


def test_silu_and_mul_matches_torch() -> None:
    from nvcli.kernels.activation import silu_and_mul_triton

    torch.manual_seed(0)
    x = torch.randn(3, 2 * 96)
    ref = torch.nn.functional.silu(x[:, :96]) * x[:, 96:]
    out = silu_and_mul_triton(x.to(DEVICE)).cpu()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _row_scale_input(rows: torch.Tensor, form: str, eps: float) -> torch.Tensor:
    """The deferred norm's row scale as the kernels take it: the rows themselves, or their 1 / RMS precomputed by
    the Triton kernel (prompt steps)."""
    from nvcli.kernels.rms_norm import row_rstd_triton

    return rows.to(DEVICE) if form == "rows" else row_rstd_triton(rows.to(DEVICE), eps)


@pytest.mark.parametrize("form", ["rows", "precomputed"])
def test_silu_and_mul_scales_unnormalized_rows(form: str) -> None:
    """Deferred RMSNorm: with `scale_rows` gate and up are first multiplied by each row's 1 / RMS (the rows' RMS
    differ by 16x, so a wrong row or a missing scale shows), given the rows or their precomputed 1 / RMS; the
    torch layer does the same."""
    from nvcli.kernels.activation import silu_and_mul_triton
    from nvcli.models.layers.activation import SiluAndMul
    from nvcli.models.layers.norm import row_rstd

    torch.manual_seed(0)
    x = torch.randn(3, 2 * 1280)  # two column blocks per row: each program reads the row scale
    rows = torch.randn(3, 40) * torch.tensor([[0.5], [2.0], [8.0]])  # hidden 40: masked row loads
    scaled = x * row_rstd(rows, 1e-5)
    ref = torch.nn.functional.silu(scaled[:, :1280]) * scaled[:, 1280:]
    scale = _row_scale_input(rows, form, 1e-5)
    out = silu_and_mul_triton(x.to(DEVICE), scale, 1e-5).cpu()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(SiluAndMul()(x, scale.cpu(), 1e-5), ref, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out, torch.nn.functional.silu(x[:, :1280]) * x[:, 1280:], atol=1e-3)


@pytest.mark.parametrize("form", ["rows", "precomputed"])
def test_rope_store_scales_unnormalized_rows(form: str) -> None:
    """The prompt-step rotary kernel with `scale_rows` (the rows, or their 1 / RMS precomputed): q (in place), and
    the k and v it stores, are those of the rows' projections after RMSNorm; it refuses to scale without the cache
    store, where v is scaled."""
    from nvcli.kernels.kv_layout import PagedKV
    from nvcli.kernels.rotary import rope_qk_norm_triton
    from nvcli.models.layers.norm import row_rstd

    torch.manual_seed(2)
    T, KH, D, page, nb, hidden = 5, 2, 32, 4, 4, 24
    H = 2 * KH
    qkv = torch.randn(T, (H + 2 * KH) * D)
    rows = torch.randn(T, hidden) * torch.linspace(0.25, 4.0, T)[:, None]
    positions = torch.tensor([0, 1, 5, 9, 13])
    slots = torch.tensor([3, -1, 0, 9, 14])
    rope = RotaryEmbedding(D, 64, 10000.0, None)
    qw, kw = 1 + 0.1 * torch.randn(D), 1 + 0.1 * torch.randn(D)

    def run(t: torch.Tensor, scale_rows: torch.Tensor | None):
        t = t.clone().to(DEVICE)
        q, k, v = t.split([H * D, KH * D, KH * D], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, KH, D), v.view(T, KH, D)
        kc = torch.zeros(nb, page, KH, D, device=DEVICE)
        vc = torch.zeros_like(kc)
        rope_qk_norm_triton(q, k, positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE), qw.to(DEVICE), kw.to(DEVICE),
                            1e-6, v=v, kv=PagedKV(kc, vc), slot_mapping=slots.to(DEVICE),
                            scale_rows=None if scale_rows is None else scale_rows.to(DEVICE), scale_eps=1e-6)
        return q.cpu(), kc.cpu(), vc.cpu()

    want = run(qkv * row_rstd(rows, 1e-6), None)
    got = run(qkv, _row_scale_input(rows, form, 1e-6).cpu())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    q = qkv[:, : H * D].view(T, H, D).clone().to(DEVICE)
    with pytest.raises(AssertionError, match="pass kv"):
        rope_qk_norm_triton(q, q[:, :KH], positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE),
                            scale_rows=rows.to(DEVICE))
