"""A mixture-of-experts router's top-k in one kernel: softmax in float32, the top k, renormalization, the cast.

`route_triton` computes what models/layers/moe_routing.py's torch reference computes on the GPU,
    probs = torch.softmax(logits, -1, dtype=float32); w, ids = torch.topk(probs, k); w / w.sum(-1); w.to(dtype),
in the same float32 operations in the same order (aiming at torch's bits on CUDA; on an H100 the weights still
differed in their last bits, the ids did not: tests/kernels/test_moe_route.py bounds them to a few ulps):
- softmax as PyTorch's warp softmax (PersistentSoftmax.cuh, rows of up to 1024) does it: lane l of a LANES-wide warp
  (LANES = min(32, next power of two of E)) sums exp(x - max) over its columns l, l + LANES, ... in that order, the
  lanes' sums then meet in an xor butterfly (lanes l and l + LANES / 2 first); each probability is exp(x - max) / sum.
  exp is libdevice's expf (tl.exp would be ex2.approx), the divisions round to nearest (tl.div_rn; `/` on float32
  is approximate).
- the renormalizing sum as torch's reduction kernel adds a short contiguous row: W = the largest power of two
  <= k lanes, lane l's values l, l + W, ... in order, then lanes in adjacent pairs (shfl_down by 1, 2, 4, ...).
- top-k by repeated argmax over the row's probabilities: the largest first, and among equal probabilities the lowest
  expert id first. torch.topk leaves the order of equal values unspecified, so the kernel equals it only where no
  two of a row's top k + 1 probabilities are exactly equal.
Libdevice with Triton's flush-to-zero may give 0 where torch gives a subnormal probability (below 1.2e-38): no effect
on the sums (each holds the max's exp(0) = 1), and only a top-k weight below 1e-38 could differ.

The interpreter has no libdevice, so interpreted runs use tl.exp (numpy's exp): equal to the torch reference on CPU
tensors to a few ulps, not bit for bit (torch's CPU exp is another implementation, and its sums go in other orders).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction


@triton.jit
def _round_to_bf16(v):
    """v (float32) rounded to nearest even at bfloat16's precision, so that the cast after it is exact: the same bits
    interpreted as compiled (Triton 3.6's interpreter truncates a float32 -> bfloat16 cast). Infinities stay."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_route_kernel(
    logits_ptr,  # [num_tokens, E], float32 / bfloat16 / float16
    weights_ptr,  # [num_tokens, TOP_K], logits' dtype
    ids_ptr,  # [num_tokens, TOP_K] int64
    num_tokens,
    stride_logits,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    K_LANES: tl.constexpr,  # largest power of two <= TOP_K
    LOG2_K_LANES: tl.constexpr,
    LANES: tl.constexpr,  # min(32, next power of two >= E)
    ITERS: tl.constexpr,  # that power of two // LANES
    LOG2_LANES: tl.constexpr,
    ROWS: tl.constexpr,  # tokens per program, each computed on its own
    RENORMALIZE: tl.constexpr,
    EXACT_EXP: tl.constexpr,  # libdevice's expf (compiled); tl.exp in the interpreter, which has no libdevice
):
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    token_ok = tokens < num_tokens
    # rows past the last token read the last one (finite values, no NaN) and store nothing
    src = logits_ptr + tl.minimum(tokens, num_tokens - 1).to(tl.int64)[:, None] * stride_logits  # [ROWS, 1]
    E_PAD: tl.constexpr = LANES * ITERS
    cols = tl.arange(0, E_PAD)[None, :]
    x = tl.load(src + cols, mask=cols < E, other=float("-inf")).to(tl.float32)  # [ROWS, E_PAD]
    m = tl.max(x, 1)[:, None]  # exact in any order

    # the softmax denominator in the warp softmax's order (module docstring)
    lanes = tl.arange(0, LANES)[None, :]
    s = tl.zeros([ROWS, LANES], dtype=tl.float32)
    for it in tl.static_range(ITERS):
        c = it * LANES + lanes
        xi = tl.load(src + c, mask=c < E, other=float("-inf")).to(tl.float32)
        if EXACT_EXP:
            s += libdevice.exp(xi - m)
        else:
            s += tl.exp(xi - m)
    for step in tl.static_range(LOG2_LANES):  # xor butterfly: afterwards every lane holds the row's sum
        s = s + tl.gather(s, (lanes ^ (LANES >> (step + 1))).broadcast_to(ROWS, LANES), 1)
    total = tl.max(s, 1)[:, None]  # the lanes' equal sums

    if EXACT_EXP:
        p = tl.div_rn(libdevice.exp(x - m), total)
    else:
        p = tl.div_rn(tl.exp(x - m), total)
    p = tl.where(cols < E, p, -1.0)  # below every probability: padding is never picked

    kcols = tl.arange(0, K_PAD)[None, :]
    top_w = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    top_i = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 1, tie_break_left=True)[:, None]  # the lowest id among equal maxima
        top_w = tl.where(kcols == j, tl.max(p, 1)[:, None], top_w)
        top_i = tl.where(kcols == j, best, top_i)
        p = tl.where(cols == best, -1.0, p)

    if RENORMALIZE:
        # torch's sum over the k values (module docstring): fold lanes l and l + K_LANES, then adjacent pairs
        # (lanes past K_LANES, and those a step reads past its tree, hold values lane 0's sum never reads)
        r = top_w
        if K_PAD != K_LANES:  # lane l + value l + K_LANES: 0.0 past TOP_K, an exact addition
            r = r + tl.gather(r, ((kcols + K_LANES) % K_PAD).broadcast_to(ROWS, K_PAD), 1)
        for step in tl.static_range(LOG2_K_LANES):  # shfl_down by 1, 2, 4, ...
            r = r + tl.gather(r, ((kcols + (1 << step)) % K_PAD).broadcast_to(ROWS, K_PAD), 1)
        top_w = tl.div_rn(top_w, tl.sum(tl.where(kcols == 0, r, 0.0), 1)[:, None])  # lane 0's sum

    if weights_ptr.dtype.element_ty == tl.bfloat16:
        top_w = _round_to_bf16(top_w)
    ok = token_ok[:, None] & (kcols < TOP_K)
    out = tokens.to(tl.int64)[:, None] * TOP_K + kcols
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=ok)


def route_constexprs(num_experts: int, top_k: int) -> dict[str, int]:
    """`_moe_route_kernel`'s shape parameters for rows of num_experts logits and top_k picks."""
    e_pad = triton.next_power_of_2(num_experts)
    lanes = min(32, e_pad)
    k_pad = triton.next_power_of_2(top_k)
    k_lanes = k_pad if k_pad == top_k else k_pad // 2
    return dict(E=num_experts, TOP_K=top_k, K_PAD=k_pad, K_LANES=k_lanes, LOG2_K_LANES=k_lanes.bit_length() - 1,
                LANES=lanes, ITERS=e_pad // lanes, LOG2_LANES=lanes.bit_length() - 1)


def route_triton(
    logits: torch.Tensor,  # [num_tokens, num_experts] router logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] in logits' dtype, expert ids int64)
    """The top-k experts of each token and their routing weights (softmax in float32, renormalized if asked, cast to
    logits' dtype): 8 tokens per program (module docstring: torch's arithmetic, ties to the lowest expert id)."""
    num_tokens, num_experts = logits.shape
    assert 1 <= top_k <= num_experts <= 1024, (top_k, num_experts)  # the warp softmax's rows (module docstring)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    rows = 8  # on 2 warps Triton lays [8, 128] out 4 rows per warp, a row over 8 lanes: its reductions stay in-warp
    _moe_route_kernel[(triton.cdiv(num_tokens, rows),)](
        logits, weights, ids, num_tokens, logits.stride(0), **route_constexprs(num_experts, top_k), ROWS=rows,
        RENORMALIZE=renormalize, EXACT_EXP=isinstance(_moe_route_kernel, JITFunction),  # False: interpreted
        num_warps=2)
    return weights, ids
