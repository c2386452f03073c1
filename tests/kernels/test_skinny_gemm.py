"""skinny_linear_triton against F.linear (Triton interpreter on CPU, float32 inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE, on_device
from kernel_device import linear_inputs as _inputs

from nvcli.kernels import skinny_gemm
from nvcli.kernels.skinny_gemm import (
    ONE_PASS_MAX_BYTES,
    SkinnyConfig,
    block_m_for,
    choose_config,
    skinny_supported,
    use_skinny,
)

skinny_linear = on_device(skinny_gemm.skinny_linear_triton)


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_configs(m: int, use_dot: bool, split_k: int, with_bias: bool) -> None:
    """N = 40, K = 80: neither a multiple of BLOCK_N = 16 nor of BLOCK_K = 32 (masked last tile)."""
    x, w, b = _inputs(m, 40, 80, seed=m)
    bias = b if with_bias else None
    cfg = SkinnyConfig(block_n=16, block_k=32, split_k=split_k, use_dot=use_dot, num_stages=2)
    _close(skinny_linear(x, w, bias, config=cfg), F.linear(x, w, bias))


@pytest.mark.parametrize("m", [1, 2, 3, 16])
@pytest.mark.parametrize("use_dot", [False, True])
def test_even_k(m: int, use_dot: bool) -> None:
    """K a multiple of BLOCK_K * SPLIT_K: the unmasked loop."""
    x, w, b = _inputs(m, 32, 128, seed=10 + m)
    cfg = SkinnyConfig(block_n=16, block_k=32, split_k=2, use_dot=use_dot)
    _close(skinny_linear(x, w, b, config=cfg), F.linear(x, w, b))


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(12, 48), (20, 160)])
def test_auto_config(m: int, n: int, k: int) -> None:
    """The configs choose_config picks for tiny shapes (one row per program at M <= 2; split K)."""
    x, w, b = _inputs(m, n, k, seed=100 + m + n)
    _close(skinny_linear(x, w, b), F.linear(x, w, b))


def test_split_k_is_deterministic() -> None:
    x, w, b = _inputs(16, 40, 160, seed=7)
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=5, use_dot=True)
    assert torch.equal(skinny_linear(x, w, b, config=cfg), skinny_linear(x, w, b, config=cfg))


def test_leading_dims_and_strided_rows() -> None:
    x, w, b = _inputs(6, 24, 64, seed=3)
    x3 = x.view(2, 3, 64)
    y = skinny_linear(x3, w, b)
    assert y.shape == (2, 3, 24)
    _close(y, F.linear(x3, w, b))
    wide = torch.randn(4, 96)
    xs = wide[:, 16:80]  # rows 96 apart
    _close(skinny_linear(xs, w), F.linear(xs, w))


def test_float16() -> None:
    x, w, b = _inputs(3, 40, 64, seed=5, dtype=torch.float16)
    ref = (x.float() @ w.float().T + b.float()).to(torch.float16)
    for use_dot in (False, True):
        cfg = SkinnyConfig(block_n=16, block_k=32, use_dot=use_dot)
        _close(skinny_linear(x, w, b, config=cfg), ref, tol=2e-3)


def test_empty_batch() -> None:
    x, w, _ = _inputs(1, 24, 32, seed=0)
    assert skinny_linear(x[:0], w).shape == (0, 24)


def test_use_skinny_conditions() -> None:
    bf16 = torch.bfloat16
    w = torch.empty(128, 64, dtype=bf16)
    assert skinny_supported(torch.empty(1, 64, dtype=bf16), w)
    assert skinny_supported(torch.empty(16, 64, dtype=bf16), w)
    assert skinny_supported(torch.empty(2, 8, 64, dtype=bf16), w)  # 16 rows in all
    assert skinny_supported(torch.empty(4, 64, dtype=torch.float16), w.half())
    assert not skinny_supported(torch.empty(17, 64, dtype=bf16), w)  # past MAX_M rows: cuBLAS
    big = torch.empty(ONE_PASS_MAX_BYTES // (2 * 1024) + 16, 1024, dtype=bf16)  # an LM head's size: cuBLAS
    assert skinny_supported(torch.empty(1, 1024, dtype=bf16), big[:-16]) and not skinny_supported(
        torch.empty(1, 1024, dtype=bf16), big)
    assert not skinny_supported(torch.empty(0, 64, dtype=bf16), w)
    assert not skinny_supported(torch.empty(4, 64), w.float())  # fp32
    assert not skinny_supported(torch.empty(4, 64, dtype=bf16), w.half())  # dtype mismatch
    assert not skinny_supported(torch.empty(4, 72, dtype=bf16), torch.empty(128, 72, dtype=bf16))  # K % 16
    assert not skinny_supported(torch.empty(4, 64, dtype=bf16), torch.empty(64, 128, dtype=bf16).t())
    assert not skinny_supported(torch.empty(4, 64, dtype=bf16)[:, ::2], torch.empty(128, 32, dtype=bf16))
    assert not use_skinny(torch.empty(4, 64, dtype=bf16), w)  # CPU tensors: never


def test_linear_dispatch_falls_back_to_torch() -> None:
    x, w, b = _inputs(2, 24, 32, seed=9)
    assert torch.equal(skinny_gemm.linear(x, w, b), F.linear(x, w, b))  # CPU: F.linear itself


QWEN3 = [  # (N, K): 0.6B qkv, o, gate_up, down, lm_head; 8B qkv, o, gate_up, down
    (4096, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
    (151936, 1024),
    (6144, 4096),
    (4096, 4096),
    (24576, 4096),
    (4096, 12288),
]


@pytest.mark.parametrize("n,k", QWEN3)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_config_heuristic(m: int, n: int, k: int) -> None:
    sms = 132
    cfg = choose_config(m, n, k, 2, sms)
    assert cfg == choose_config(m, n, k, 2, sms)
    one_pass = cfg.block_k >= k and cfg.split_k == 1
    assert cfg.use_dot == (m > skinny_gemm.FMA_MAX_M and not one_pass)
    if cfg.use_dot:
        assert cfg.block_n >= 32 and cfg.block_k >= 16
        assert cfg.block_n * cfg.block_k * 2 <= 2 * skinny_gemm.TILE_BYTES
    else:  # the FMA accumulator: at most 64 fp32 per thread (one-pass tiles take their rows one at a time)
        rows = 1 if one_pass else block_m_for(m, False)
        assert rows * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
        assert cfg.block_n * min(cfg.block_k, k) * 2 <= 2 * skinny_gemm.TILE_BYTES
    assert cfg.block_k <= triton_next_pow2(k)
    k_iters = -(-k // cfg.block_k)
    assert 1 <= cfg.split_k <= min(16, k_iters)
    assert -(-k_iters // cfg.split_k) * (cfg.split_k - 1) < k_iters  # no empty split
    assert 1 <= cfg.num_stages <= -(-k_iters // cfg.split_k)
    assert -(-n // cfg.block_n) * cfg.split_k >= sms // 2  # at least half the SMs get work


@pytest.mark.parametrize("n,k", QWEN3)
@pytest.mark.parametrize("m", [2, 4, 16])
def test_config_k_step_divides_k(m: int, n: int, k: int) -> None:
    """Looped decode tiles take a K step that divides K (no masked tail), e.g. down_proj's K = 3072."""
    cfg = choose_config(m, n, k, 2, 132)
    if cfg.split_k > 1 or -(-k // cfg.block_k) > 1:
        assert k % cfg.block_k == 0 and cfg.block_k >= 64


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (2048, 1024), (3072, 1024)])
def test_one_row_decoder_gemm_takes_k_in_one_step(n: int, k: int) -> None:
    """One row, a decoder layer's weight (Qwen3-0.6B's, and at TP=2): every program takes whole weight rows
    in one (masked) K step, so under PDL its whole share loads before it waits on the previous kernel; and
    the column blocks still give every SM a program."""
    cfg = choose_config(1, n, k, 2, 132)
    assert cfg.split_k == 1 and cfg.block_k >= k and cfg.num_stages == 1 and not cfg.use_dot
    assert -(-n // cfg.block_n) >= 132
    assert cfg.block_n * cfg.block_k * 2 <= 2 * skinny_gemm.TILE_BYTES


def test_lm_head_keeps_looped_tiles() -> None:
    """An LM head's weight is no decoder layer's: it streams through the looped tiles."""
    cfg = choose_config(1, 151936, 1024, 2, 132)
    assert cfg.block_k < 1024


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("prologue", ["none", "silu_mul", "norm"])
def test_one_pass_config_uneven_k(m: int, prologue: str) -> None:
    """The auto config of a few rows at K = 48 (one masked 64-wide step, as down_proj's 3072 in 4096), with
    bias and each fused prologue: one row, or several taken one at a time from the weight tile in registers
    (3 rows: a masked fourth); on the GPU the masked step is the tile loaded before the PDL wait."""
    n, k = 24, 48
    cfg = choose_config(m, n, k, 4, 132)
    assert cfg.split_k == 1 and cfg.block_k == 64 and not cfg.use_dot
    gen = torch.Generator().manual_seed(7 + m)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen)
    wd, bd = w.to(DEVICE), b.to(DEVICE)
    if prologue == "silu_mul":
        gu = torch.randn(m, 2 * k, generator=gen)
        ref = F.linear(F.silu(gu[:, :k]) * gu[:, k:], w, b)
        y = skinny_gemm.skinny_linear_triton(gu.to(DEVICE)[:, :k], wd, bd, silu_mul=True).cpu()
    elif prologue == "norm":
        x, r = torch.randn(m, k, generator=gen), torch.randn(m, k, generator=gen)
        nw = torch.randn(k, generator=gen)
        h = x + r
        ref = F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw, w, b)
        new_r = torch.empty(m, k, device=DEVICE)
        y = skinny_gemm.skinny_linear_triton(x.to(DEVICE), wd, bd, norm_weight=nw.to(DEVICE), residual=r.to(DEVICE),
                                             eps=1e-6, new_residual=new_r).cpu()
        torch.testing.assert_close(new_r.cpu(), h)
    else:
        x = torch.randn(m, k, generator=gen)
        ref = F.linear(x, w, b)
        y = skinny_linear(x, w, b)
    _close(y, ref)


def triton_next_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [64, 80])
@pytest.mark.parametrize("split_k", [1, 2])
def test_fused_silu_mul_prologue(m: int, k: int, split_k: int) -> None:
    """down_proj(SiLU(gate) * up) straight from the gate_up rows equals the activation then the GEMM,
    across the FMA (M <= 2) and tensor-core paths, masked and even K, split K."""
    gen = torch.Generator().manual_seed(m + k)
    gate_up = torch.randn(m, 2 * k, generator=gen)
    w = torch.randn(24, k, generator=gen) * k**-0.5
    b = torch.randn(24, generator=gen)
    ref = F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], w, b)
    for use_dot in (False, True):
        cfg = SkinnyConfig(block_n=16, block_k=32, split_k=split_k, use_dot=use_dot, num_stages=2)
        gu = gate_up.to(DEVICE)
        y = skinny_gemm.skinny_linear_triton(gu[:, :k], w.to(DEVICE), b.to(DEVICE), config=cfg, silu_mul=True)
        _close(y.cpu(), ref)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [64, 80, 608])  # 608 at 16 rows: the row pass loads 256 columns at a time
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm_prologue(m: int, k: int, split_k: int, with_residual: bool) -> None:
    """qkv_proj(RMSNorm(x + residual)) in one kernel equals the norm layer then the GEMM, and the
    new residual (x + residual) comes back exactly, for every path and split."""
    from nvcli.models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(7 * m + k)
    x = torch.randn(m, k, generator=gen)
    r = torch.randn(m, k, generator=gen) if with_residual else None
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(k, generator=gen)
    w = torch.randn(24, k, generator=gen) * k**-0.5
    b = torch.randn(24, generator=gen)
    normed, ref_res = norm(x, r) if with_residual else (norm(x), x)
    ref = F.linear(normed, w, b)
    for use_dot in (False, True):
        cfg = SkinnyConfig(block_n=16, block_k=32, split_k=split_k, use_dot=use_dot, num_stages=2)
        new_res = torch.full((m, k), float("nan"), device=DEVICE)
        y = skinny_gemm.skinny_linear_triton(
            x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), config=cfg, norm_weight=norm.weight.to(DEVICE),
            residual=None if r is None else r.to(DEVICE), eps=1e-6, new_residual=new_res)
        _close(y.cpu(), ref)
        if with_residual:
            torch.testing.assert_close(new_res.cpu(), ref_res, atol=0, rtol=0)


@pytest.mark.parametrize("m,use_dot", [(1, False), (5, True), (16, True)])
def test_split_k_summed_by_the_last_split(m: int, use_dot: bool) -> None:
    """Split K: the last split of each output tile sums the partials in split order, so the result is
    the same on every call, and the arrival counters are back at zero."""
    from nvcli.kernels import arrival_counters

    x, w, b = _inputs(m, 40, 96, seed=40 + m)
    cfg = SkinnyConfig(block_n=16, block_k=32, split_k=3, use_dot=use_dot, num_stages=2)
    fused = skinny_linear(x, w, b, config=cfg)
    _close(fused, F.linear(x, w, b))
    assert torch.equal(fused, skinny_linear(x, w, b, config=cfg))
    assert arrival_counters.all_zero()
