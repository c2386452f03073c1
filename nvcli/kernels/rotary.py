"""Fused per-head RMSNorm (Qwen3's q/k norm, optional) + rotary embedding + KV-cache store.

One program per (token, KV head): it loads that KV head's query heads (GQA group), its key
head and (when storing) its value head once, normalizes q and k per head in fp32, rotates them
(neox layout: first half / second half), writes q back in place and writes k and v straight
into the paged cache slot (quantized for an fp8 cache, as `kv_store` does; V token-major through
its open-page view, see kv_layout.py). On the decode path
this replaces the torch norm/rotary ops and the separate KV-store kernel with one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.kv_store import (
    FP8_E4M3_MAX,
    load_scales,
    scale_args,
    seal_page,
    store_to_cache,
)
from nvcli.kernels.pdl import launch_kwargs, pdl_start, use_pdl
from nvcli.kernels.rms_norm import load_row_rstd, row_scale_args


@triton.jit
def rope_qk_norm_store(
    t,  # token (int64)
    kvh,  # KV head
    store_kv,  # runtime flag: write k and v to the cache (STORE) or k back in place (not STORE)
    q_ptr, q_out_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale, eps,
    rs_ptr, stride_rs, rs_n, rs_eps,  # ROW_SCALE: the token's hidden row [rs_n] (the layer's input, before its norm),
    # or its 1 / RMS precomputed (rms_norm.load_row_rstd)
    ratio_ptr,  # [3] float32 (RATIOS): q's, k's and v's factors beside the row scale
    stride_qt, stride_qh, stride_qot, stride_qoh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr,
    STORE: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, SEAL: tl.constexpr = False,
    ROW_SCALE: tl.constexpr = False, RS_BLOCK: tl.constexpr = 16, RATIOS: tl.constexpr = False,
):
    """Token t, KV head kvh: norm + rotate its query heads into q_out (may be q itself), and its key (and
    value) into the cache slot or back in place. Shared by the rotary kernel and the decode-attention kernel (which
    runs it first thing, so a decode step needs no separate rotary launch). The V strides are the open page's
    (token-major, kv_layout.py). SEAL (decode attention over a dims-major V cache: the token is the only one of
    its page written in this launch): a token that fills its page seals it. ROW_SCALE (deferred RMSNorm,
    models/llama.py): q, k and v are projections of the un-normalized row, so each is first multiplied by the
    row's 1 / RMS, computed here from the row itself or read precomputed (the norm's weight is folded into the
    projection). RATIOS (with ROW_SCALE; a row-scaled FP8 qkv projection whose q, k and v weights kept a scale each,
    kernels/fp8_rows.py): q, k and v each take their own factor times the row's."""
    offs = tl.arange(0, HALF)  # [HALF]
    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
    g_mask = (offs_g < GROUP)[:, None]

    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs)  # [HALF] fp32
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs)
    if STORE:  # every load first, so their latencies overlap (decode attention waits for this step)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        v_base = v_ptr + t * stride_vt + kvh * stride_vh + offs
        v1 = tl.load(v_base)
        v2 = tl.load(v_base + HALF)

    # queries of this KV head's group: [GROUP_PAD, HALF] halves
    q_base = q_ptr + t * stride_qt + (kvh * GROUP + offs_g)[:, None] * stride_qh + offs[None, :]
    q1 = tl.load(q_base, mask=g_mask, other=0.0)
    q2 = tl.load(q_base + HALF, mask=g_mask, other=0.0)
    dtype = q1.dtype
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)
    k_base = k_ptr + t * stride_kt + kvh * stride_kh + offs
    k1 = tl.load(k_base).to(tl.float32)  # [HALF]
    k2 = tl.load(k_base + HALF).to(tl.float32)
    if ROW_SCALE:  # rounded like the torch path: the scaled projection in the model dtype
        r_q = load_row_rstd(rs_ptr + t * stride_rs, rs_n, rs_eps, RS_BLOCK)
        r_k = r_q
        r_v = r_q
        if RATIOS:  # the factors first, in float32, as fp8_rows.apply_row_scale multiplies
            r_k = r_q * tl.load(ratio_ptr + 1)
            r_v = r_q * tl.load(ratio_ptr + 2)
            r_q = r_q * tl.load(ratio_ptr)
        q1 = (q1 * r_q).to(dtype).to(tl.float32)
        q2 = (q2 * r_q).to(dtype).to(tl.float32)
        k1 = (k1 * r_k).to(dtype).to(tl.float32)
        k2 = (k2 * r_k).to(dtype).to(tl.float32)
        if STORE:
            v1 = (v1.to(tl.float32) * r_v).to(v1.dtype)
            v2 = (v2.to(tl.float32) * r_v).to(v2.dtype)
    if NORM:
        # Round like the torch path: normalized value in the model dtype, then times the weight.
        q_rstd = tl.rsqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / (2 * HALF) + eps)[:, None]
        qw1 = tl.load(qw_ptr + offs).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + HALF + offs).to(tl.float32)[None, :]
        q1 = ((q1 * q_rstd).to(dtype).to(tl.float32) * qw1).to(dtype).to(tl.float32)
        q2 = ((q2 * q_rstd).to(dtype).to(tl.float32) * qw2).to(dtype).to(tl.float32)
        k_rstd = tl.rsqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / (2 * HALF) + eps)
        kw1 = tl.load(kw_ptr + offs).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + offs).to(tl.float32)
        k1 = ((k1 * k_rstd).to(dtype).to(tl.float32) * kw1).to(dtype).to(tl.float32)
        k2 = ((k2 * k_rstd).to(dtype).to(tl.float32) * kw2).to(dtype).to(tl.float32)
    qo_base = q_out_ptr + t * stride_qot + (kvh * GROUP + offs_g)[:, None] * stride_qoh + offs[None, :]
    tl.store(qo_base, (q1 * cos[None, :] - q2 * sin[None, :]).to(dtype), mask=g_mask)
    tl.store(qo_base + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(dtype), mask=g_mask)
    # the rotated key, rounded to the model dtype (what a separate store would read back)
    kr1 = (k1 * cos - k2 * sin).to(dtype)
    kr2 = (k2 * cos + k1 * sin).to(dtype)
    if not STORE:
        if store_kv:
            tl.store(k_base, kr1)
            tl.store(k_base + HALF, kr2)
    else:
        if store_kv & (slot >= 0):
            blk = slot // PAGE
            off = slot % PAGE
            kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + kvh * stride_kch + offs
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + kvh * stride_vch + offs * stride_vcd
            store_to_cache(kc, kr1, k_scale, None, QUANT, FP8_MAX)
            store_to_cache(kc + HALF, kr2, k_scale, None, QUANT, FP8_MAX)
            store_to_cache(vc, v1, v_scale, None, QUANT, FP8_MAX)
            store_to_cache(vc + HALF * stride_vcd, v2, v_scale, None, QUANT, FP8_MAX)
            if SEAL:
                if off == PAGE - 1:
                    tl.debug_barrier()  # every thread's part of the new token's row is stored
                    seal_page(v_cache_ptr + blk * stride_vcb + kvh * stride_vch, PAGE, 2 * HALF)


@triton.jit
def _rope_store_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim] (row stride may be the fused qkv width)
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim] (read when STORE)
    pos_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, head_dim]: cos in the first half, sin in the second (fp32)
    qw_ptr,  # [head_dim] q norm weight
    kw_ptr,  # [head_dim] k norm weight
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (written when STORE)
    v_cache_ptr,
    slot_ptr,  # [num_tokens], -1 = padding (not stored)
    k_scale_ptr,
    v_scale_ptr,
    k_scale_val,
    v_scale_val,
    eps,
    rs_ptr,  # [num_tokens, rs_n] or [num_tokens] precomputed (ROW_SCALE)
    stride_rs,
    rs_n,
    rs_eps,
    ratio_ptr,  # [3] float32 (RATIOS)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see pdl.py)
    ROW_SCALE: tl.constexpr,
    RS_BLOCK: tl.constexpr,
    RATIOS: tl.constexpr,
):
    pdl_start(PDL)
    ks, vs = load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR)
    rope_qk_norm_store(
        tl.program_id(0).to(tl.int64), tl.program_id(1), True,
        q_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks, vs,
        eps, rs_ptr, stride_rs, rs_n, rs_eps, ratio_ptr,
        stride_qt, stride_qh, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        GROUP, GROUP_PAD, HALF, PAGE, NORM, STORE, QUANT, FP8_MAX, False, ROW_SCALE, RS_BLOCK, RATIOS,
    )


def rope_qk_norm_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous; modified in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; rotated in place unless stored
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32
    q_weight: torch.Tensor | None = None,  # [head_dim]; with k_weight: apply the per-head RMSNorm first
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    v: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: with kv, store k and v
    kv: PagedKV | None = None,  # the layer's cache (V written through its open-page view, kv_layout.py)
    slot_mapping: torch.Tensor | None = None,  # [num_tokens], -1 = skip
    scale_rows: torch.Tensor | None = None,  # [num_tokens, hidden] or [num_tokens] precomputed: see the docstring
    scale_eps: float = 1e-6,
    qkv_ratios: torch.Tensor | None = None,  # [3] float32 with scale_rows: q's, k's and v's factors beside it
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm + rotary on q and k; with `kv` the rotated k and v go to the cache instead of back into k.
    `scale_rows` (deferred RMSNorm, models/llama.py; needs the cache store, which is where v is scaled): q, k and
    v are first multiplied by rsqrt(mean(row ** 2) + scale_eps) of their token's row, or by the token's entry of a
    [num_tokens] float32 of those values precomputed (layers.norm.row_rstd_vector)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim/2 must be a power of two"
    if num_tokens == 0:
        return q, k
    norm = q_weight is not None
    store = kv is not None
    if store:
        assert v is not None and slot_mapping is not None
        assert v.shape == k.shape and v.stride(-1) == 1 and slot_mapping.shape[0] == num_tokens
        assert (kv.num_kv_heads, kv.head_dim) == (num_kv_heads, head_dim)
        k_cache, v_cache, cache_strides, page, cache_dtype = kv.k, kv.v_open, kv.store_strides, kv.block_size, kv.dtype
        quant = kv.fp8
        k_scale, v_scale = (kv.k_scale, kv.v_scale) if quant else (None, None)  # scales only apply to fp8
    else:
        # no cache: the kernel writes k back in place, the cache arguments are stand-ins it does not read
        v, k_cache, v_cache, slot_mapping, page, cache_dtype = k, k, k, positions, 1, k.dtype
        cache_strides = (k.stride(0), k.stride(1), k.stride(2), k.stride(0), k.stride(1), k.stride(2), 1)
        quant, k_scale, v_scale = False, None, None
    assert scale_rows is None or store, "scale_rows scales v on its way to the cache: pass kv"
    assert qkv_ratios is None or (scale_rows is not None and qkv_ratios.shape == (3,)
                                  and qkv_ratios.dtype == torch.float32), "qkv_ratios: [3] float32 with scale_rows"
    rs_ptr, rs_stride, rs_n, rs_block = row_scale_args(scale_rows, num_tokens, q)
    ks_ptr, vs_ptr, ks_val, vs_val, scale_is_ptr = scale_args(k_scale, v_scale, positions)
    group = num_heads // num_kv_heads
    pdl = use_pdl(q, num_tokens)
    _rope_store_kernel[(num_tokens, num_kv_heads)](
        q, k, v, positions, cos_sin_cache,
        q_weight if norm else cos_sin_cache, k_weight if norm else cos_sin_cache,
        k_cache, v_cache, slot_mapping, ks_ptr, vs_ptr, ks_val, vs_val,
        eps,
        rs_ptr, rs_stride, rs_n, scale_eps, qkv_ratios if qkv_ratios is not None else cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HALF=head_dim // 2,
        PAGE=page, NORM=norm, STORE=store, QUANT=quant, SCALE_IS_PTR=scale_is_ptr,
        FP8_MAX=FP8_E4M3_MAX if cache_dtype == torch.float8_e4m3fn else 57344.0,
        PDL=pdl,
        ROW_SCALE=scale_rows is not None,
        RS_BLOCK=rs_block,
        RATIOS=qkv_ratios is not None,
        num_warps=1 if group * head_dim <= 512 else 2,
        **launch_kwargs(pdl),
    )
    return q, k
