"""Fused per-head RMSNorm (Qwen3's q/k norm, optional) + rotary embedding, in place on q and k.

One program per (token, head) over q's heads then k's heads: load the head vector once, normalize
it in fp32, rotate it (neox layout: first half / second half), store it back. On the decode path
this replaces about a dozen small torch kernels per layer with one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim] (row stride may be the fused qkv width)
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    pos_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, head_dim]: cos in the first half, sin in the second (fp32)
    qw_ptr,  # [head_dim] q norm weight
    kw_ptr,  # [head_dim] k norm weight
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    is_q = h < NUM_HEADS
    offs = tl.arange(0, HALF)
    if is_q:
        base = q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        base = k_ptr + t.to(tl.int64) * stride_kt + (h - NUM_HEADS) * stride_kh
        w_ptr = kw_ptr
    x1 = tl.load(base + offs)
    x2 = tl.load(base + HALF + offs)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
        # Round like the torch path: normalized value in the model dtype, then times the weight.
        x1 = (x1 * rstd).to(dtype).to(tl.float32) * w1
        x2 = (x2 * rstd).to(dtype).to(tl.float32) * w2
        x1 = x1.to(dtype).to(tl.float32)
        x2 = x2.to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(dtype))
    tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(dtype))


def rope_qk_norm_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous; modified in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; modified in place
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32
    q_weight: torch.Tensor | None = None,  # [head_dim]; with k_weight: apply the per-head RMSNorm first
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim/2 must be a power of two"
    if num_tokens == 0:
        return q, k
    norm = q_weight is not None
    _rope_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, k, positions, cos_sin_cache,
        q_weight if norm else cos_sin_cache, k_weight if norm else cos_sin_cache,
        eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_HEADS=num_heads, HALF=head_dim // 2, NORM=norm, num_warps=1,
    )
    return q, k
