"""Mixture-of-experts experts in two grouped GEMMs (models/layers/moe.py; torch reference `fused_experts_ref`).

Each token's top-k (token, expert) pairs are rows r = token * top_k + k of a flat list. `moe_align` groups the rows
by expert: they are sorted by expert (stably, so an expert's rows keep token order) and each expert's group is
padded to a multiple of BLOCK_M with the sentinel num_rows, so every block of BLOCK_M sorted rows belongs to one
expert (`expert_ids`, one per block). The buffers have their worst-case size, num_rows + num_experts * (BLOCK_M - 1)
rounded up to whole blocks, whatever the routing, and the count of rows in use (`num_padded`) stays on the device:
no host sync and no data-dependent shape, so a decode step captures into a CUDA graph. The blocks past
`num_padded` return at once. The alignment is one kernel, `_moe_align_kernel` (one program per expert: a histogram
of all rows, then its own rows placed with a running count), in place of torch's ~25 small ops and stable sort,
which `moe_align_ref` keeps as the reference; the two agree in every entry, the tail past `num_padded` included.

Then `_gate_up_kernel`: per block, its expert's gate and up rows times the tokens' hidden states, accumulated in
float32, SiLU(gate) * up fused (rounded like the torch path: gate and up in the model dtype, SiLU's output too),
written to row r of act [num_rows, I]. `_down_kernel`: act @ W2[e].T, rounded to the model dtype, times the row's
routing weight, written to row r of out [num_rows, H]; a sum over each token's top_k rows gives the block's output.
Both read A rows through the sorted index, B from the expert's weight [E, N, K] (K contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_m_for(num_rows: int, num_experts: int, invariant: bool = False) -> int:
    """Rows per block: 16 when the (token, expert) rows are few against the experts (decode: most groups hold a
    row or two), else 64. Under --batch-invariant always 16 (a row's sums must not depend on the row count)."""
    return 16 if invariant or num_rows <= num_experts else 64


def moe_align_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert ids
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in torch ops of fixed shapes (no host sync): its reference."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [num_rows]
    num_rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # each expert's padded group is [ends - padded, ends)
    order = torch.argsort(flat, stable=True)  # rows by expert
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted rows
    rank = torch.arange(num_rows, device=device) - first[by_expert]
    num_blocks = align_num_blocks(num_rows, num_experts, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[by_expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def align_num_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """The blocks of the worst case: every expert's group one row past a multiple of block_m."""
    return triton.cdiv(num_rows + num_experts * (block_m - 1), block_m)


@triton.jit(do_not_specialize=["num_rows", "num_blocks"])
def _moe_align_kernel(
    ids_ptr,  # [num_rows] expert ids in [0, NUM_EXPERTS), any integer dtype
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32
    num_rows,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,  # a power of two > NUM_EXPERTS: bin NUM_EXPERTS counts the lanes past the last row
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # rows read at a time
):
    """Program e: every expert's row count (each program counts them all, so no program waits on another), its
    group's start (the padded counts of the experts below e), then its own rows in increasing row order at
    start + (its rows before them), its padding, its blocks' expert id, and its share of the tail past the last
    group. Every position of the outputs is written by exactly one program."""
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for r0 in range(0, num_rows, CHUNK):
        r = r0 + offs
        ids = tl.load(ids_ptr + r, mask=r < num_rows, other=NUM_EXPERTS).to(tl.int32)
        counts += tl.histogram(ids, BINS)  # every lane in [0, BINS): out-of-range values are undefined on the GPU
    bins = tl.arange(0, BINS)
    padded = tl.where(bins < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(bins < e, padded, 0))
    count = tl.sum(tl.where(bins == e, counts, 0))
    padded_e = tl.sum(tl.where(bins == e, padded, 0))
    total = tl.sum(padded)

    # own rows: each at start + (rows of e before it); stops once all `count` are placed (all rows read at worst)
    seen = count * 0
    r0 = count * 0
    while (seen < count) & (r0 < num_rows):
        r = r0 + offs
        mine = (tl.load(ids_ptr + r, mask=r < num_rows, other=NUM_EXPERTS) == e).to(tl.int32)
        tl.store(sorted_ids_ptr + start + seen + tl.cumsum(mine, 0) - 1, r, mask=mine != 0)
        seen += tl.sum(mine)
        r0 += CHUNK
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + start + count + pad, num_rows, mask=pad < padded_e - count)  # < BLOCK_M of them
    blk = tl.arange(0, CHUNK)
    for b0 in range(0, padded_e // BLOCK_M, CHUNK):
        tl.store(expert_ids_ptr + start // BLOCK_M + b0 + blk, e, mask=b0 + blk < padded_e // BLOCK_M)

    # the tail [total, num_blocks * BLOCK_M): sentinel rows in blocks of the last expert (the reference's clamp),
    # a slice of its blocks per program (at most about NUM_EXPERTS + 1 blocks in all: total >= num_rows)
    tail_first = total // BLOCK_M
    per = tl.cdiv(num_blocks - tail_first, NUM_EXPERTS)
    lo = tail_first + e * per
    hi = tl.minimum(lo + per, num_blocks)
    for b in range(lo, hi):
        tl.store(sorted_ids_ptr + b * BLOCK_M + pad, num_rows)
        tl.store(expert_ids_ptr + b, NUM_EXPERTS - 1)
    if e == 0:
        tl.store(num_padded_ptr, total)


def align_chunk(num_rows: int) -> tuple[int, int]:
    """(`_moe_align_kernel`'s rows per chunk, warps): each program reads every row twice, so a decode step's rows
    (256 tokens x 8 = 2,048) take one chunk of each pass, prefill's few wide ones."""
    return (1024, 4) if num_rows <= 1024 else (4096, 8)


def moe_align(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert ids
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * block_m] int32: rows grouped by expert in increasing expert id, an expert's rows in
    increasing row order, each group padded to block_m with num_rows, and num_rows past the last group too;
    expert_ids [num_blocks] int32: each block's expert, num_experts - 1 past the last group; num_padded [1] int32:
    rows in use, a multiple of block_m), in one launch of `_moe_align_kernel` (one program per expert): fixed
    shapes, no host sync (CUDA graphs); num_blocks is the worst case's (`align_num_blocks`). Every entry equals
    `moe_align_ref`'s."""
    flat = topk_ids.reshape(-1)
    num_rows = flat.numel()
    num_blocks = align_num_blocks(num_rows, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk, warps = align_chunk(num_rows)
    _moe_align_kernel[(num_experts,)](
        flat, sorted_ids, expert_ids, num_padded, num_rows, num_blocks, NUM_EXPERTS=num_experts,
        BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m, CHUNK=chunk, num_warps=warps)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def expert_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_rows, BLOCK_M: tl.constexpr):
    """Program pid_m's rows (its block of the expert-sorted row ids; num_rows pads), which of them are real, and
    their expert."""
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return rows, rows < num_rows, tl.load(expert_ids_ptr + pid_m).to(tl.int64)


@triton.jit
def silu_mul_rounded(acc_gate, acc_up, dtype: tl.constexpr):
    """SiLU(gate) * up in `dtype` from float32 accumulators, rounded where torch's path in the model dtype rounds
    (gate, up, F.silu's output, the product)."""
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def store_weighted_rows(acc, out_ptr, weights_ptr, rows64, row_ok, offs_n, n_ok, stride_out):
    """A down projection's tile: acc rounded to the output dtype, times each row's routing weight (in the model
    dtype), stored at the rows' own places."""
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_out + offs_n[None, :], y.to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_rows, H, N,
                    stride_x, stride_we, stride_wn, stride_act, TOP_K: tl.constexpr, DOT_PREC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pid_n = tl.program_id(1)
    rows, row_ok, expert = expert_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_rows, BLOCK_M)
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x
    w_gate = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    w_up = w_gate + N * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < H
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        wg = tl.load(w_gate + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_gate = tl.dot(a, wg, acc_gate, input_precision=DOT_PREC)
        acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PREC)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_n[None, :],
             silu_mul_rounded(acc_gate, acc_up, act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_rows,
                 K, N, stride_act, stride_we, stride_wn, stride_out, DOT_PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    w_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    store_weighted_rows(acc, out_ptr, weights_ptr, rows64, row_ok, offs_n, n_ok, stride_out)


def fused_moe_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k], x's dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    invariant: bool = False,  # one tile configuration whatever the row count (--batch-invariant)
    block_m: int | None = None,  # overrides block_m_for (tests)
) -> torch.Tensor:  # [num_tokens, hidden]
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k]: layers/moe.py's
    `fused_experts_ref` in two grouped GEMMs (module docstring)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    assert w2.shape == (num_experts, hidden, inter), (tuple(w2.shape), (num_experts, hidden, inter))
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out.sum(dim=1)
    bm = block_m or block_m_for(num_rows, num_experts, invariant)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, bm)
    weights = topk_weights.to(x.dtype).reshape(-1).contiguous()  # [num_rows]
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    num_blocks = expert_ids.shape[0]
    bn1, bk1 = min(64, max(16, triton.next_power_of_2(inter))), min(64, max(16, triton.next_power_of_2(hidden)))
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, bn1))](
        x, w13, act, sorted_ids, expert_ids, num_padded, num_rows, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), TOP_K=top_k, DOT_PREC=prec, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1,
        num_warps=4, num_stages=3)
    out_rows = out.view(num_rows, hidden)
    bn2, bk2 = min(64, max(16, triton.next_power_of_2(hidden))), min(64, max(16, triton.next_power_of_2(inter)))
    _down_kernel[(num_blocks, triton.cdiv(hidden, bn2))](
        act, w2, out_rows, weights, sorted_ids, expert_ids, num_padded, num_rows, inter, hidden, act.stride(0),
        w2.stride(0), w2.stride(1), out_rows.stride(0), DOT_PREC=prec, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2,
        num_warps=4, num_stages=3)
    return out.sum(dim=1)
