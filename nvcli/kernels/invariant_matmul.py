"""Batch-invariant GEMM in Triton: y = x @ weight.T (+ bias), each row's result independent of the row count.

cuBLAS and the skinny GEMM (skinny_gemm.py) pick their tiles, split-K and inner products by the number of rows, so
a row's sums are taken in an order that moves with its step's batch size, and in bf16 that moves its logits
(benchmarks/RESULTS.md: a seeded row's tokens differed beside 32 neighbours). Here one configuration serves every
M: fixed BLOCK_M x BLOCK_N tiles, the whole of K walked in BLOCK_K steps in the same order, fp32 accumulation, no
split-K, M never specialized. A row's output is then the same function of that row and the weight whatever shares
its tile (rows past M are masked loads, and a tensor-core MMA's per-element sum does not depend on the other rows).
`--batch-invariant` (models/llama.py) routes every projection and the LM head here.

It is slower than cuBLAS: about 1.1-1.5x at decode row counts and 1.6-3x at prompt sizes (tiles_for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """A configuration of the kernel. It may depend on the weight's shape, never on the row count."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


WIDE = Tiles(128, 64)  # projections that widen (qkv, gate_up)
NARROW = Tiles(64, 32, 128)  # projections that narrow (o_proj, down): 4x the column blocks, the SMs fuller at decode
VOCAB = Tiles(128, 128, num_warps=8)  # LM heads: the weight dwarfs the rows


def tiles_for(n: int, k: int) -> Tiles:
    """The configuration for a weight of n rows and k columns (a function of the weight only). Picked on Qwen3-0.6B's
    shapes replayed in CUDA graphs on an H100 (benchmarks/invariant_tiles_gpu.py): at 128
    decode rows a layer's four GEMMs 43 -> 29 us against 64 x 128 tiles everywhere (cuBLAS 22), an 8,192-row prompt
    step 685 -> 796 us (cuBLAS 401); the LM head at 128 rows 234 -> 132 us. Decode rows win: a batch tool generates."""
    if n >= 32768:
        return VOCAB
    return NARROW if n <= k else WIDE


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or x_ptr when HAS_BIAS is False
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            tiles: Tiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x's dtype; row results independent of the rows.
    `tiles`: the configuration (default: tiles_for the weight's shape; the benchmark tries others)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1, "the weight's rows must be contiguous"
    m, k = x2.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, the weight {weight.shape[1]}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    t = tiles or tiles_for(n, k)
    if m:
        grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
        _invariant_matmul_kernel[grid](
            x2, weight, bias if bias is not None else x2, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        )
    return y.reshape(*shape[:-1], n)
