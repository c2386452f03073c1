"""Varlen causal prefill attention over the paged KV cache in Triton (flash-attention style).

Packed queries `[num_tokens, num_heads, head_dim]`: sequence s owns rows
query_start_loc[s]:query_start_loc[s+1] and its KV length (this step's K/V already stored)
is seq_lens[s], so query row j sits at position seq_lens[s] - q_len + j. This covers plain
prefill, prefix-cache hits, chunked prefill and mixed batches with q_len-1 (decode) rows.

Grid `(num_kv_heads, num_tokens // BLOCK_Q + num_seqs)`: the query blocks of all sequences,
flattened (a program finds its sequence by binary search over query_start_loc). A program
owns BLOCK_Q query tokens times every query head of one KV-head group, packed into the
BLOCK_M = BLOCK_Q * GROUP_PAD rows of the tile (so K/V tiles are shared by the group), and
walks KV tiles of BLOCK_N tokens whose physical slots are gathered through the block table. KV tiles entirely
visible to every row run without masks; the diagonal tiles are masked; tiles past the
causal limit are never visited. fp8 caches are dequantised in the kernel (k_scale folded
into the softmax scale, v_scale into the output). A dims-major V cache (`kv_layout.py`) is read
per run of a page's tokens as V transposed, except each sequence's open page (token-major rows).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.kv_store import load_scales, scale_args

LOG2E = 1.4426950408889634
# --batch-invariant over an fp8 cache: the query-tile height, a setting of the cache's dtype (never of the rows). On
# an H100 (batch_invariance_gpu.py --kv-cache-dtype fp8) 16 against 64 rows: 128 requests at
# once 16,403 against 13,260 output tok/s, streamed 7,810 against 6,837, 1,000-token prompts 202k against 242k
# prompt tok/s. Generation wins; a bf16 cache keeps 64 (16 there: one-token rows 128 against 146 us, prompt
# chunks 424 against 172).
INVARIANT_FP8_BLOCK_M = 16


@triton.jit
def _prefill_tile(
    acc,
    m_i,
    l_i,
    q,
    blk,  # [BLOCK_N] int64 physical block of every token of this tile (fetched one tile ahead)
    run_blk,  # V_T: [BLOCK_N // SUB] int64 physical block of each run of the tile (fetched one tile ahead)
    bt_row,
    k_head,
    v_head,
    tile,
    q_pos,
    kv_limit,
    open_start,  # V_T: first position of the sequence's open page, whose V rows are token-major (kv_layout.py)
    score_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    offs_n,
    offs_d,
    offs_r,  # [BLOCK_N // SUB]
    vt_in_run,  # V_T: [HEAD_DIM, 1, SUB] element offsets inside a run
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SUB: tl.constexpr,  # tokens of a tile that share a page: min(PAGE, BLOCK_N)
    MASKED: tl.constexpr,  # the tile may reach past the limit, the open page or a row's causal edge
    MASK_SCORES: tl.constexpr,  # scores through the causal select even when MASKED is False (--batch-invariant)
    DOT_PREC: tl.constexpr,
    V_T: tl.constexpr,  # V pages stored dims-major (kv_layout.py): read as V transposed, per run
):
    pos = tile + offs_n  # [BLOCK_N]
    # next tile's block ids, loaded now so the next K/V addresses do not wait on this load
    pos_next = pos + BLOCK_N
    blk_next = tl.load(bt_row + pos_next // PAGE, mask=pos_next < kv_limit, other=0).to(tl.int64)
    in_page = (pos % PAGE).to(tl.int64)
    k_off = blk * stride_kb + in_page * stride_kt  # [BLOCK_N]
    if MASKED:
        n_mask = pos < kv_limit
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0)
    else:
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None])  # [HEAD_DIM, BLOCK_N]
    if V_T:
        run_start = tile + offs_r * SUB  # [RUNS]
        run_next = run_start + BLOCK_N
        run_blk_next = tl.load(bt_row + run_next // PAGE, mask=run_next < kv_limit, other=0).to(tl.int64)
        vt_ptrs = v_head + (run_blk * stride_vb + run_start % PAGE)[None, :, None] + vt_in_run  # [HEAD_DIM, RUNS, SUB]
        if MASKED:  # whole runs (see decode_attention.py); the slots past the limit are finite and get p = 0
            sealed = (run_start < kv_limit) & (run_start < open_start)
            vt = tl.load(vt_ptrs, mask=sealed[None, :, None], other=0.0)
            v = tl.trans(tl.reshape(vt, [HEAD_DIM, BLOCK_N]))  # [BLOCK_N, HEAD_DIM]
            # the open page's runs, token-major; only masked tiles reach it (BLOCK_N is a multiple of PAGE)
            is_open = (run_start < kv_limit) & (run_start >= open_start)
            vo_ptrs = (v_head + (run_blk * stride_vb + run_start % PAGE * HEAD_DIM)[:, None, None]
                       + (tl.arange(0, SUB) * HEAD_DIM)[None, :, None] + offs_d[None, None, :])  # [RUNS, SUB, HEAD_DIM]
            vo = tl.reshape(tl.load(vo_ptrs, mask=is_open[:, None, None], other=0.0), [BLOCK_N, HEAD_DIM])
            v = tl.where((pos >= open_start)[:, None], vo, v)
        else:
            v = tl.trans(tl.reshape(tl.load(vt_ptrs), [HEAD_DIM, BLOCK_N]))  # [BLOCK_N, HEAD_DIM]
    else:
        run_blk_next = run_blk
        v_off = blk * stride_vb + in_page * stride_vt  # [BLOCK_N]
        if MASKED:
            v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_head + v_off[:, None] + offs_d[None, :])  # [BLOCK_N, HEAD_DIM]
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC) * score_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    elif MASK_SCORES:  # every position visible here; the select only keeps the arithmetic of the masked form
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # finite: every row sees KV position 0 in the first tile visited, so m_i is finite after it
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return acc, m_new, l_i, blk_next, run_blk_next


# Batch shape changes every step: one compile. The metadata pointers are not specialized on 16-byte alignment: a
# step with one-token rows passes them offset by that row count (DecodeSplit), which otherwise compiled a variant
# mid-run whenever the count's alignment changed (scalar loads: alignment buys nothing there).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    k_scale_ptr,
    v_scale_ptr,
    k_scale_val,
    v_scale_val,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    num_seqs,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr,
    SUB: tl.constexpr,  # min(PAGE, BLOCK_N)
    V_T: tl.constexpr,  # V pages stored dims-major (kv_layout.py): [head, dim, token] per page
    INVARIANT: tl.constexpr,  # --batch-invariant: every tile through the masked form (see below)
):
    kvh = tl.program_id(0)
    # Flattened (sequence, query block) index: sequence s owns the ids starting at
    # query_start_loc[s] // BLOCK_Q + s, which leaves room for its cdiv(q_len, BLOCK_Q)
    # blocks; the grid is num_tokens // BLOCK_Q + num_seqs, at most num_seqs ids are idle.
    # Reversed so the last query blocks (most causal work) start first.
    block_id = tl.num_programs(1) - 1 - tl.program_id(1)
    lo = 0
    hi = num_seqs
    while lo < hi:  # largest s with query_start_loc[s] // BLOCK_Q + s <= block_id
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= block_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    if seq < 0:
        return  # ids below the first sequence's: its rows start after a step's one-token rows (DecodeSplit)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # KV positions before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query index inside the sequence
    g = offs_m % GROUP_PAD
    heads = kvh * GROUP + g
    row_mask = (tok < q_len) & (g < GROUP)
    q_pos = ctx_len + tok  # [BLOCK_M]

    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    if F16_DOT:
        q = q.to(tl.float16)  # fp8 tiles then convert straight to fp16 (one cvt per pair) for the dots

    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR)
    score_scale = qk_scale * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    first_pos = ctx_len + q_block * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    # KV tiles below full_end are visible to every row, past no limit and below the open page: plain loads. Which
    # tiles those are depends on the query block's first position, so on how a prompt was chunked, and the compiler
    # contracts an unmasked tile's scale and subtraction into one FMA, which the masked form's select keeps apart
    # (H100, float32). So under INVARIANT (--batch-invariant) every tile's scores go through the select: a row's
    # bits whatever its chunking. A dims-major V cache keeps the plain loads there (the masked form's open-page
    # merge took 342 against 158 us for 128 one-token rows); a token-major one runs every tile masked (plain loads
    # measured 2-3% slower there; invariant_tiles_gpu.py).
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    if INVARIANT and not V_T:
        full_end = 0
    kv_end = last_pos + 1
    open_start = seq_len // PAGE * PAGE
    pos0 = offs_n
    blk = tl.load(bt_row + pos0 // PAGE, mask=pos0 < kv_end, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_N // SUB)
    vt_in_run = (offs_d * PAGE)[:, None, None] + tl.arange(0, SUB)[None, None, :]  # [HEAD_DIM, 1, SUB]
    if V_T:
        run_blk = tl.load(bt_row + offs_r * SUB // PAGE, mask=offs_r * SUB < kv_end, other=0).to(tl.int64)
    else:
        run_blk = blk  # unused
    for tile in range(0, full_end, BLOCK_N):
        acc, m_i, l_i, blk, run_blk = _prefill_tile(
            acc, m_i, l_i, q, blk, run_blk, bt_row, k_head, v_head, tile, q_pos, kv_end, open_start, score_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_r, vt_in_run,
            PAGE, BLOCK_N, HEAD_DIM, SUB, False, INVARIANT, DOT_PREC, V_T,
        )  # fmt: skip
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i, blk, run_blk = _prefill_tile(
            acc, m_i, l_i, q, blk, run_blk, bt_row, k_head, v_head, tile, q_pos, kv_end, open_start, score_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_r, vt_in_run,
            PAGE, BLOCK_N, HEAD_DIM, SUB, True, True, DOT_PREC, V_T,
        )  # fmt: skip

    o = acc * (v_scale / l_i)[:, None]
    tl.store(
        out_ptr + row_t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,  # V token- or dims-major
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal varlen attention of packed queries over the paged cache -> like q.

    `invariant` (--batch-invariant): the query tile keeps its full height whatever the step's longest query, so one
    compiled kernel (one tile shape, one MMA shape) serves every step, and a row's result is the same function of its
    own query and KV whether it is a one-token decode row or part of any chunk of its prompt: the KV tiles start at
    position 0 in BLOCK_N steps for every row, and the tiles a row does not see add exactly nothing.

    query_start_loc holds absolute rows of q: with query_start_loc[0] > 0 the rows before it are not this kernel's
    (a step's one-token rows, which the decode kernel takes: DecodeSplit) and are left as they are in `out`
    (written in place when given, else a new tensor).

    max_query_len (>= every q_len) picks the query tile height. max_seq_len is accepted for
    API symmetry (the kernel reads each sequence's length on the device). kv's scales
    (None, float or 1-element tensor) dequantise an fp8 cache and are ignored otherwise.
    """
    del max_seq_len
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = kv.block_size, kv.num_kv_heads
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert kv.head_dim == head_dim
    assert q.stride(-1) == 1
    v_t = kv.v_dims_major
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    fp8 = kv.fp8
    # scales only apply to an fp8 cache
    k_ptr, v_ptr, k_val, v_val, scale_is_ptr = scale_args(kv.k_scale if fp8 else None, kv.v_scale if fp8 else None,
                                                          seq_lens)

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if block_m is None:
        # invariant: its one tile height serves one-token rows too, where 64 rows against 128 took 146 against 199 us
        # for 128 decode rows and 172 against 151 us for a 8k-token prompt step (invariant_tiles_gpu.py)
        block_m = (INVARIANT_FP8_BLOCK_M if fp8 else 64) if invariant else 128 if head_dim <= 128 else 64
    if block_n is None:
        block_n = 64
    # the open page (kv_layout.py) must fall in the masked tiles, which it does when tiles hold whole pages
    assert not v_t or block_n % page == 0, "a dims-major V cache needs block_n to be a multiple of the page size"
    if num_warps is None:
        # fp8 at 128-row tiles: 4 warps, 254 against 286 us with 8 at a 16k-token prompt step on the H100; bf16
        # keeps 8 (238 against 657 us)
        num_warps = 8 if block_m >= 128 and not fp8 else 4
    if num_stages is None:
        num_stages = 3 if head_dim <= 128 else 2
    # rows per program: BLOCK_Q tokens x GROUP_PAD heads, BLOCK_Q no larger than needed
    block_q = max(1, block_m // group_pad)
    if not invariant:
        block_q = min(block_q, max(16 // group_pad, triton.next_power_of_2(max_query_len)))
    block_m_eff = max(16, block_q * group_pad)
    block_q = block_m_eff // group_pad

    grid = (num_kv_heads, num_tokens // block_q + num_seqs)
    _prefill_kernel[grid](
        q,
        kv.k,
        kv.v,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        k_ptr,
        v_ptr,
        k_val,
        v_val,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *kv.strides[:6],  # not V's dim stride: V_T tells the kernel
        block_tables.stride(0),
        num_seqs,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m_eff,
        BLOCK_N=block_n,
        SCALE_IS_PTR=scale_is_ptr,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOT=fp8 and q.dtype != torch.float32,
        SUB=min(page, block_n),
        V_T=v_t,
        INVARIANT=invariant,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
