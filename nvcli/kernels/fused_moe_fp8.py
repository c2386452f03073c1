"""Mixture-of-experts experts with block-wise FP8 weights in two grouped GEMMs (W8A8; torch reference
models/layers/moe_fp8.fused_experts_fp8_ref).

The weights are float8_e4m3fn with one float32 scale per 128 x 128 block of each expert's tensor
(kernels/block_fp8.py): w13 [E, 2 * I, H] (gate rows, then up rows) with scales [E, 2 * ceil(I / 128),
ceil(H / 128)] (the gate's block rows, then the up's: each half keeps its own checkpoint tensor's blocks, whatever I),
w2 [E, H, I] with scales [E, ceil(H / 128), ceil(I / 128)]. The rows are grouped by expert exactly as in
kernels/fused_moe.py (`moe_align`: worst-case-size buffers, the rows in use counted on the device), so the three
launches capture into a CUDA graph: no host sync, no data-dependent shape.

1. The tokens' hidden states are quantized per token per 128 columns (kernels/fp8_gemm.quantize_activations_triton):
   every one of a token's top_k rows reads the same fp8 row and scales.
2. `_fp8_gate_up_kernel`: per block of BLOCK_M rows of one expert and 128 columns of I, K walked in steps of 128 (the
   scale block): fp8 x fp8 dots into a float32 partial times a_scale[token, kb] * b_scale[block, kb], for the gate and
   the up half; SiLU(gate) * up rounded as the torch path rounds in the model dtype; then that 128-column group is
   quantized in place (scale = max(amax, 1e-10) / 448, the IEEE-rounded divisions of `_quant_act_kernel`) and
   written as fp8 act [num_rows, I] with scales [num_rows, ceil(I / 128)]: the model-dtype activation never reaches
   memory.
3. `_fp8_down_kernel`: act @ W2[e].T the same way, rounded to the model dtype, times the row's routing weight, into
   row r of out [num_rows, H]; a sum over each token's top_k rows gives the block's output.

Every 128 x 128 weight block has one scale, so a program's column tile (BLOCK_N dividing 128, starting on a multiple
of it) reads one scalar weight scale per K step.

The activation's fp8 values are rounded to e4m3's precision in float32 arithmetic before the cast (`_round_e4m3`),
so the cast is exact: the same bits compiled as interpreted (Triton 3.6's interpreter rounds a cast to fp8 wrongly
where the rounding carries into the exponent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.block_fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX
from nvcli.kernels.fp8_gemm import quantize_activations_triton, quantize_groups
from nvcli.kernels.fused_moe import (
    block_m_for,
    expert_block,
    moe_align,
    silu_mul_rounded,
    store_weighted_rows,
)


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest even at e4m3's precision: 3 mantissa bits above 2^-6, steps of 2^-9
    below (its subnormals). Adding 1.5 * 2^(e + 20) makes the float32 sum's last place e4m3's step at exponent e."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a) for a normal float32; -127 for 0
    e = tl.maximum(e, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^(e + 20)
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_gate_up_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, act_s_ptr, sorted_ids_ptr, expert_ids_ptr,
                        num_padded_ptr, num_rows, H, N, N_SCALE_BLOCKS, stride_xq, stride_xs, stride_we, stride_wn,
                        stride_wse, stride_wsn, stride_act, stride_act_s, eps, FP8_MAX: tl.constexpr,
                        OUT_DTYPE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pid_n = tl.program_id(1)  # one 128-column group of act: one weight scale row of each half, one act scale
    rows, row_ok, expert = expert_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_rows, BLOCK_M)
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = xq_ptr + tokens[:, None] * stride_xq
    a_scales = xs_ptr + tokens * stride_xs
    w_gate = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    w_up = w_gate + N * stride_wn
    s_gate = ws_ptr + expert * stride_wse + pid_n * stride_wsn
    s_up = s_gate + N_SCALE_BLOCKS * stride_wsn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < H
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a_s = tl.load(a_scales + kb, mask=row_ok, other=0.0)  # [BLOCK_M]
        wg = tl.load(w_gate + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_gate += tl.dot(a, wg) * a_s[:, None] * tl.load(s_gate + kb)
        acc_up += tl.dot(a, wu) * a_s[:, None] * tl.load(s_up + kb)
    h = silu_mul_rounded(acc_gate, acc_up, OUT_DTYPE).to(tl.float32)  # [BLOCK_M, BLOCK_N]; masked ones are 0
    q, scale = quantize_groups(h, eps, FP8_MAX)  # scale [BLOCK_M]
    q = _round_e4m3(q)
    rows64 = rows.to(tl.int64)
    tl.store(act_ptr + rows64[:, None] * stride_act + offs_n[None, :], q.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])
    tl.store(act_s_ptr + rows64 * stride_act_s + pid_n, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_down_kernel(act_ptr, act_s_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                     num_padded_ptr, num_rows, K, N, stride_act, stride_act_s, stride_we, stride_wn, stride_wse,
                     stride_wsn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pid_n = tl.program_id(1)
    rows, row_ok, expert = expert_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_rows, BLOCK_M)
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + rows64[:, None] * stride_act
    a_scales = act_s_ptr + rows64 * stride_act_s
    w_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    w_scales = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn  # the tile's block row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a_s = tl.load(a_scales + kb, mask=row_ok, other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w) * a_s[:, None] * tl.load(w_scales + kb)
    store_weighted_rows(acc, out_ptr, weights_ptr, rows64, row_ok, offs_n, n_ok, stride_out)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fused_moe_fp8_triton(
    x: torch.Tensor,  # [num_tokens, hidden], bf16 / fp16 / fp32
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] float8_e4m3fn: gate rows, then up rows
    w13_scale: torch.Tensor,  # [num_experts, 2 * ceil(inter / 128), ceil(hidden / 128)] float32
    w2: torch.Tensor,  # [num_experts, hidden, inter] float8_e4m3fn
    w2_scale: torch.Tensor,  # [num_experts, ceil(hidden / 128), ceil(inter / 128)] float32
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    block_m: int | None = None,  # overrides block_m_for (tests)
    num_warps: int | None = None,  # overrides the gate/up kernel's (benchmarks)
) -> torch.Tensor:  # [num_tokens, hidden] in x's dtype
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k], with FP8 weights and
    activations quantized per token per 128 columns (module docstring)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    nb_i, nb_h = triton.cdiv(inter, BLOCK), triton.cdiv(hidden, BLOCK)
    assert w13.dtype == FP8_DTYPE and w2.dtype == FP8_DTYPE, (w13.dtype, w2.dtype)
    assert w2.shape == (num_experts, hidden, inter), (tuple(w2.shape), (num_experts, hidden, inter))
    assert w13_scale.shape == (num_experts, 2 * nb_i, nb_h) and w2_scale.shape == (num_experts, nb_h, nb_i)
    assert w13_scale.stride(-1) == 1 and w2_scale.stride(-1) == 1
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out.sum(dim=1)
    x = x if x.stride(-1) == 1 else x.contiguous()
    bm = block_m or block_m_for(num_rows, num_experts)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, bm)
    weights = topk_weights.to(x.dtype).reshape(-1).contiguous()  # [num_rows]
    xq, xs = quantize_activations_triton(x)  # [num_tokens, hidden] fp8, [num_tokens, nb_h]
    act = torch.empty((num_rows, inter), dtype=FP8_DTYPE, device=x.device)
    act_s = torch.empty((num_rows, nb_i), dtype=torch.float32, device=x.device)
    num_blocks = expert_ids.shape[0]
    # 64-row blocks hold two 64 x 128 float32 accumulators: 8 warps (on an H200 at Qwen3-30B-A3B's shape, 8,192
    # tokens: 1.65 ms against 1.94 with 4; 16-row blocks the same with either)
    _fp8_gate_up_kernel[(num_blocks, nb_i)](
        xq, xs, w13, w13_scale, act, act_s, sorted_ids, expert_ids, num_padded, num_rows, hidden, inter, nb_i,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        act.stride(0), act_s.stride(0), ACT_EPS, FP8_MAX=FP8_MAX, OUT_DTYPE=_TL_DTYPES[x.dtype], TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=num_warps or (4 if bm <= 16 else 8), num_stages=3)
    out_rows = out.view(num_rows, hidden)
    bn = 64 if hidden <= 64 else BLOCK  # divides 128: every column tile sits inside one weight block row
    _fp8_down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        act, act_s, w2, w2_scale, out_rows, weights, sorted_ids, expert_ids, num_padded, num_rows, inter, hidden,
        act.stride(0), act_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out_rows.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, num_warps=4, num_stages=3)
    return out.sum(dim=1)
