"""Paged decode attention (one query token per sequence) in Triton, flash-decoding style.

One kernel (`_decode_split_kernel`), grid `(num_kv_heads, num_seqs, num_splits)`: KV heads first, so a
sequence's KV heads run side by side (2-5% faster than sequences first from batch 64 up on the H100). Each
program takes every query head of one KV-head group (so each K/V row is read once per group), walks its share
of the sequence's KV positions in tiles of BLOCK_N tokens (the physical slot of every token is gathered through
the block table, so a tile spans several pages) and keeps an online softmax. With one split it writes the
final output; otherwise it writes a normalised partial output and its log-sum-exp (base 2), and the last split
of each (sequence, KV head) to finish merges them: it counts arrivals on an int32 counter with an acq_rel
atomic and resets it, so there is no second launch (with a separate reduce kernel, 32 sequences of 1,500 tokens
took 105 instead of 88 us). It merges in split order, so the output does not depend on which program finishes
last.

CUDA-graph safety: the grid and the split count depend only on tensor shapes (num_seqs,
num_kv_heads, block_tables.shape[1]) and the device's SM count; each program derives its
token range from seq_lens on the device. A split that starts past the sequence end writes
lse = -inf and a zero partial, which the reduce ignores; seq_len 0 gives a zero output.

With `rope` (every decode step on the GPU, see models/llama.py) the kernel also does the rotary step that
otherwise precedes it: every program norms and rotates its query heads from the raw projections,
and the program whose split holds the new position also rotates the new key and writes it and the
value to the cache before its tile loop reads them. Launched with PDL (see pdl.py), a program
prefetches its K/V lines into L2 before `griddepcontrol.wait`.

fp8 caches (`torch.float8_e4m3fn`) are dequantised in the kernel: the fp8 tile is converted
up, k_scale is folded into the softmax scale and v_scale into the output (both are
per-tensor, so this equals multiplying every loaded element by its scale).

A dims-major V cache (fp8 with 32-token pages, `kv_layout.py`) is read per run of a page's tokens
as V transposed, `[head_dim, tokens]`, the way K is read, so the PV product's operand needs no
transpose through shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nvcli.kernels.arrival_counters import arrival_counters
from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.kv_store import FP8_E4M3_MAX, load_scales, scale_args
from nvcli.kernels.pdl import L2_PREFETCH_MAX_SEQS, launch_kwargs, prefetch_l2, use_pdl
from nvcli.kernels.rms_norm import row_scale_args
from nvcli.kernels.rotary import rope_qk_norm_store

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # choose_num_splits' bound on KV splits per sequence
MERGE_WIDTH = 32  # splits the in-kernel merge loads at once (at least; see the launch)


@dataclass
class DecodeRope:
    """The rotary step folded into decode attention: q passed to the kernel holds the raw query
    projections (normed and rotated in place), `k` / `v` the new token's raw key and value, written to
    the cache at `slot_mapping` (what `rope_qk_norm_triton` with a cache does as a separate launch)."""

    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor
    positions: torch.Tensor  # [num_seqs] int64
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32
    slot_mapping: torch.Tensor  # [num_seqs], -1 = padding
    q_weight: Optional[torch.Tensor] = None  # [head_dim]: per-head RMSNorm weights (Qwen3)
    k_weight: Optional[torch.Tensor] = None
    eps: float = 1e-6
    # [num_seqs, hidden]: deferred RMSNorm (models/llama.py): q, k and v are projections of these rows before
    # their norm, so the rotary step first multiplies them by each row's 1 / RMS (rope_qk_norm_store's ROW_SCALE)
    scale_rows: Optional[torch.Tensor] = None
    scale_eps: float = 1e-6
    # [3] float32 with scale_rows: q's, k's and v's own factors beside it (a row-scaled FP8 qkv projection whose q, k
    # and v weights kept a scale each, kernels/fp8_rows.py)
    qkv_ratios: Optional[torch.Tensor] = None


@triton.jit
def _prefetch_kv_l2(bt_row, k_head, v_head, start, end, stride_kb, stride_kt, stride_vb, stride_vt,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                    KV_LINES: tl.constexpr, V_T: tl.constexpr, V_LINES: tl.constexpr):
    """`prefetch_l2` of the K/V lines of the tokens from `start` up to `end`, a tile at a time."""
    offs_n = tl.arange(0, BLOCK_N)
    lines = tl.arange(0, KV_LINES) * (HEAD_DIM // KV_LINES)  # first element of each 128-byte line
    for tile in range(start, end, BLOCK_N):
        pos = tl.minimum(tile + offs_n, end - 1)
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
        in_page = (pos % PAGE).to(tl.int64)
        prefetch_l2(k_head + (blk * stride_kb + in_page * stride_kt)[:, None] + lines[None, :])
        if V_T:  # a head's page is one contiguous [HEAD_DIM, PAGE] block: every line of each run's page
            run_pos = tl.minimum(tile + tl.arange(0, BLOCK_N // SUB) * SUB, end - 1)
            run_blk = tl.load(bt_row + run_pos // PAGE).to(tl.int64)
            page_lines = tl.arange(0, V_LINES) * (HEAD_DIM * PAGE // V_LINES)
            prefetch_l2(v_head + (run_blk * stride_vb)[:, None] + page_lines[None, :])
        else:
            prefetch_l2(v_head + (blk * stride_vb + in_page * stride_vt)[:, None] + lines[None, :])


@triton.jit
def _online_softmax_tile(q, k, v, n_mask, m_i, l_i, acc, score_scale, DOT_PREC: tl.constexpr):
    """One KV tile of the online softmax: k, v [tokens, HEAD_DIM] in q's dtype, n_mask [tokens] (at least one
    valid token, so the running max stays finite); returns the new (m_i, l_i, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * score_scale  # [GROUP_PAD, tokens]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # block-table width changes every eager step
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 (written unless DIRECT)
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (written unless DIRECT)
    counter_ptr,  # [num_seqs * num_kv_heads] int32, all zero between calls (unless DIRECT)
    k_scale_ptr,
    v_scale_ptr,
    k_scale_val,
    v_scale_val,
    qk_scale,  # softmax scale * log2(e)
    # ROPE: q holds the raw projections, rotated into q_rot; k_new / v_new the new token's raw key and value
    q_rot_ptr,  # [num_seqs, num_heads, head_dim] contiguous
    k_new_ptr,  # [num_seqs, num_kv_heads, head_dim]
    v_new_ptr,
    pos_ptr,  # [num_seqs] int64
    cos_sin_ptr,  # [max_position, head_dim] fp32
    qw_ptr,  # [head_dim] q / k norm weights (ROPE_NORM)
    kw_ptr,
    slot_ptr,  # [num_seqs] cache slot of the new token, -1 = padding
    order_ptr,  # [num_seqs] int32 (ORDERED): the sequence each program row takes
    eps,
    rs_ptr,  # [num_seqs, rs_n] (ROPE_ROW_SCALE)
    stride_rs,
    rs_n,
    rs_eps,
    ratio_ptr,  # [3] float32 (ROPE_RATIOS)
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,  # 1, or PAGE for a dims-major V cache (V_T)
    stride_bt,
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 (tl.dot needs M >= 16)
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # cache block_size
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output, no partials (else the last split merges them)
    SCALE_IS_PTR: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr,  # fp8 cache: convert tiles to fp16 (one cvt per pair) and run the dots in fp16
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see pdl.py)
    SPLITS_PAD: tl.constexpr,  # a power of two >= num_splits (the merge's width)
    ROPE: tl.constexpr,  # first norm + rotate q (in place) and the new k, and store the new k and v
    ROPE_NORM: tl.constexpr,  # with ROPE: Qwen3's per-head q/k RMSNorm before the rotation
    ROPE_GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    ROPE_ROW_SCALE: tl.constexpr,  # with ROPE: q, k, v are projections of un-normalized rows (DecodeRope.scale_rows)
    RS_BLOCK: tl.constexpr,  # rs_n rounded up to a power of two
    ROPE_RATIOS: tl.constexpr,  # with ROPE_ROW_SCALE: q, k and v's own factors (DecodeRope.qkv_ratios)
    ROPE_QUANT: tl.constexpr,  # fp8 cache: the store quantizes
    FP8_MAX: tl.constexpr,
    L2_PREFETCH: tl.constexpr,  # PDL: prefetch the program's K/V lines into L2 before waiting
    KV_LINES: tl.constexpr,  # 128-byte lines per cached head row (head_dim * element size / 128)
    V_CONVERT_AT_LOAD: tl.constexpr,  # fp8: V converted to fp16 where it is loaded (v_dequant_in_tile)
    SUB: tl.constexpr,  # tokens of a tile that share a page: min(PAGE, BLOCK_N) (pages are powers of two)
    RUN_ADDR: tl.constexpr,  # K/V addresses per run of SUB tokens in a page (else per token)
    V_T: tl.constexpr,  # V pages stored dims-major (kv_layout.py), read as V transposed; needs RUN_ADDR
    V_LINES: tl.constexpr,  # V_T: 128-byte lines of one head's page (HEAD_DIM * PAGE * element size / 128)
    ORDERED: tl.constexpr,  # program row i takes sequence order[i] (longest first: no long program starts last)
):
    if PDL:
        gdc_launch_dependents()
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # tokens per split: a multiple of BLOCK_N so only a sequence's last tile is partial
    # V_T: the tile loop reads the full (dims-major) pages; the open page, token-major, is a tile of its own in the
    # last split (loop_end < end only there, since an empty split's start is past its end). The splits share the
    # work with the open page weighed as a whole tile, so the last one does not take an extra tile beyond the others.
    full_len = seq_len // PAGE * PAGE
    work = full_len + BLOCK_N if V_T and full_len < seq_len else seq_len
    split_len = tl.cdiv(tl.cdiv(work, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    loop_end = tl.maximum(start, tl.minimum(end, full_len)) if V_T else end
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    if PDL:
        if L2_PREFETCH:
            # Block tables, lengths and the cached K/V of earlier steps do not depend on the previous
            # kernel: stream this program's KV lines into L2 while it finishes.
            _prefetch_kv_l2(bt_row, k_head, v_head, start, end, stride_kb, stride_kt, stride_vb, stride_vt,
                            HEAD_DIM, PAGE, BLOCK_N, SUB, KV_LINES, V_T, V_LINES)
        gdc_wait()
    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR)
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]

    # RUN_ADDR: a tile is RUNS runs of SUB tokens that share a page. Offsets inside a run do not change from tile
    # to tile, so each tile computes RUNS page addresses instead of BLOCK_N row addresses and gathers RUNS block
    # ids instead of BLOCK_N (fp8, in SASS: 504 instructions per warp and tile instead of 823).
    # Either way the ids are fetched one iteration ahead, so the K/V addresses never wait on a load issued in the
    # same iteration. The first ones are issued before the rotary step, which needs none of them (no measurable
    # effect on the H100, benchmarks/RESULTS.md, and no cost).
    if RUN_ADDR:
        RUNS: tl.constexpr = BLOCK_N // SUB
        offs_r = tl.arange(0, RUNS)  # [RUNS]
        offs_s = tl.arange(0, SUB)  # [SUB]
        k_in_run = (offs_s * stride_kt)[None, :, None] + offs_d[None, None, :]  # [1, SUB, HEAD_DIM]
        v_in_run = (offs_s * stride_vt)[None, :, None] + offs_d[None, None, :]
        # V_T: [HEAD_DIM, 1, SUB], each (dim, run) row SUB contiguous tokens of one page
        vt_in_run = (offs_d * PAGE)[:, None, None] + offs_s[None, None, :]
        id_pos = start + offs_r * SUB  # [RUNS]: first token of each run
    else:
        id_pos = start + offs_n  # [BLOCK_N]
    ids_next = tl.load(bt_row + id_pos // PAGE, mask=id_pos < loop_end, other=0)

    if ROPE:
        # Every split rotates the group's raw queries into q_rot (the splits write identical values; the raw
        # q is never overwritten, so no split can read a rotated one) and reads them back below; the split
        # holding the new token's position also writes its key and value to the cache, where its own tile
        # loop reads them back after the barrier.
        owner = (start < end) & (end == seq_len)
        rope_qk_norm_store(
            seq.to(tl.int64), kvh, owner,
            q_ptr, q_rot_ptr, k_new_ptr, v_new_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr,
            slot_ptr, k_scale, v_scale, eps, rs_ptr, stride_rs, rs_n, rs_eps, ratio_ptr,
            stride_qs, stride_qh, HEAD_DIM * GROUP * num_kv_heads, HEAD_DIM, stride_knt, stride_knh, stride_vnt,
            stride_vnh,
            # V_T: the new token's V goes into its open page token-major (kv_layout.py), sealed once full
            stride_kb, stride_kt, stride_kh, stride_vb, HEAD_DIM if V_T else stride_vt, stride_vh,
            1 if V_T else stride_vd,
            GROUP, ROPE_GROUP_PAD, HEAD_DIM // 2, PAGE, ROPE_NORM, True, ROPE_QUANT, FP8_MAX, V_T, ROPE_ROW_SCALE,
            RS_BLOCK, ROPE_RATIOS,
        )
        tl.debug_barrier()
        q_ptr = q_rot_ptr
        stride_qs = HEAD_DIM * GROUP * num_kv_heads
        stride_qh = HEAD_DIM

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [GROUP_PAD]

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    if F16_DOT:
        q = q.to(tl.float16)

    score_scale = qk_scale * k_scale

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    if V_T:
        if loop_end < end:  # this split holds the sequence's open page (token-major V rows, kv_layout.py): first,
            # where the loop's state is not live yet (after the loop, even with its loads issued before the loop, it
            # took 166 registers, or spills at 128, and was 3% slower)
            offs_p = tl.arange(0, PAGE)  # [PAGE]
            p_mask = loop_end + offs_p < end
            blk = tl.load(bt_row + loop_end // PAGE).to(tl.int64)
            k = tl.load(k_head + blk * stride_kb + offs_p[:, None] * stride_kt + offs_d[None, :], mask=p_mask[:, None],
                        other=0.0)  # [PAGE, HEAD_DIM]
            v = tl.load(v_head + blk * stride_vb + offs_p[:, None] * HEAD_DIM + offs_d[None, :], mask=p_mask[:, None],
                        other=0.0)
            # converted where loaded (the opaque multiply by 1 of V_CONVERT_AT_LOAD): no byte-wise shared-memory reads
            v = v.to(q.dtype) * (v_scale / v_scale).to(q.dtype)
            m_i, l_i, acc = _online_softmax_tile(q, k.to(q.dtype), v, p_mask, m_i, l_i, acc, score_scale, DOT_PREC)

    for tile in range(start, loop_end, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N]
        n_mask = pos < loop_end
        ids = ids_next.to(tl.int64)
        id_pos += BLOCK_N
        ids_next = tl.load(bt_row + id_pos // PAGE, mask=id_pos < loop_end, other=0)
        if RUN_ADDR:
            run_start = tile + offs_r * SUB  # [RUNS]
            in_page = run_start % PAGE  # 0 unless a page holds several tiles
            k_run = (ids * stride_kb + in_page * stride_kt)[:, None, None]  # [RUNS, 1, 1]
            v_run = (ids * stride_vb + in_page * stride_vt)[:, None, None]
            run_mask = ((run_start[:, None] + offs_s[None, :]) < loop_end)[:, :, None]  # [RUNS, SUB, 1]
            k = tl.reshape(tl.load(k_head + k_run + k_in_run, mask=run_mask, other=0.0), [BLOCK_N, HEAD_DIM])
            if V_T:
                # whole runs: a per-token mask along the contiguous axis makes Triton load byte by byte; the
                # slots past the end hold finite values (kv_layout.py) and get p = 0
                vt_run = (ids * stride_vb + in_page)[None, :, None]  # [1, RUNS, 1]
                vt = tl.load(v_head + vt_run + vt_in_run, mask=(run_start < loop_end)[None, :, None], other=0.0)
                v = tl.trans(tl.reshape(vt, [HEAD_DIM, BLOCK_N]))  # [BLOCK_N, HEAD_DIM]
            else:
                v = tl.reshape(tl.load(v_head + v_run + v_in_run, mask=run_mask, other=0.0), [BLOCK_N, HEAD_DIM])
        else:
            in_page = (pos % PAGE).to(tl.int64)
            k_off = ids * stride_kb + in_page * stride_kt  # [BLOCK_N]
            v_off = ids * stride_vb + in_page * stride_vt
            k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        k = k.to(q.dtype)  # [BLOCK_N, HEAD_DIM]
        if V_CONVERT_AT_LOAD:  # see paged_decode_attention_triton's v_dequant_in_tile
            v = v.to(q.dtype) * (v_scale / v_scale).to(q.dtype)  # times 1, which the compiler cannot fold
        else:
            v = v.to(q.dtype)

        m_i, l_i, acc = _online_softmax_tile(q, k, v, n_mask, m_i, l_i, acc, score_scale, DOT_PREC)

    acc = acc * v_scale
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [GROUP_PAD, HEAD_DIM]
    if DIRECT:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        base = (seq.to(tl.int64) * (GROUP * num_kv_heads) + heads) * num_splits  # [GROUP_PAD]
        row = base + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)
        # acq_rel: this split's partials are visible before the count moves, and the last split
        # sees everyone's. The last one resets the counter, so it is zero again for the next call
        # (a CUDA graph replays the kernel with the same counters).
        cnt = counter_ptr + seq * num_kv_heads + kvh
        if tl.atomic_add(cnt, 1, sem="acq_rel") == num_splits - 1:
            tl.atomic_xchg(cnt, 0)
            _merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, seq, kvh, num_kv_heads, num_splits, stride_os,
                          stride_oh, GROUP, SPLITS_PAD, HEAD_DIM)


@triton.jit
def _merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, seq, kvh, num_kv_heads, num_splits, stride_os, stride_oh,
                  GROUP: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Output of KV head `kvh`'s query heads from their num_splits partials."""
    for g in tl.static_range(GROUP):
        _merge_head(mid_o_ptr, mid_lse_ptr, out_ptr, seq, kvh * GROUP + g, GROUP * num_kv_heads, num_splits,
                    stride_os, stride_oh, SPLITS_PAD, HEAD_DIM)


@triton.jit
def _merge_head(mid_o_ptr, mid_lse_ptr, out_ptr, seq, head, num_heads, num_splits, stride_os, stride_oh,
                SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One query head's output from its num_splits normalised partials and their log-sum-exps, all
    splits in one load (no chain of dependent loads). `.cg`: the partials come from other programs,
    so never from this SM's L1."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    row = seq.to(tl.int64) * num_heads + head
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights all 0
    w = tl.exp2(lse - m)  # [SPLITS_PAD]
    denom = tl.sum(w, axis=0)
    o = tl.load(mid_o_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None], other=0.0, cache_modifier=".cg")  # [SPLITS_PAD, HEAD_DIM]
    o = tl.sum(o * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # CPU / interpreter: pretend H100 so tests exercise the same split logic


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int, num_sms: int) -> int:
    """Split count from shapes only (CUDA-graph safe): aim for ~4 programs per SM.

    Past a quarter of a wave of programs (17-65 sequences with 8 KV heads on 132 SMs) the splits stop within one
    wave (the largest power of two that fits): rounding up instead made a second, partial wave of half-length
    programs, e.g. 2 splits at 64 sequences, and measured slower on the H100 (fp8 end to end +2% over three rounds
    in turn, benchmarks/RESULTS.md; kernel 83 against 91 us at 64 x 1400). Smaller batches round up: at
    16 sequences 8 splits beat 4."""
    programs = max(1, num_seqs * num_kv_heads)
    target = 4 * num_sms
    if programs >= target:
        return 1
    if 4 * programs > target:
        splits = 1 << int(math.log2(target / programs))
    else:
        splits = triton.next_power_of_2(math.ceil(target / programs))
    max_tiles = max(1, math.ceil(max_kv_len / block_n))
    # at least ~2 tiles per split, and at most MAX_SPLITS
    return max(1, min(splits, triton.next_power_of_2(max(1, max_tiles // 2)), MAX_SPLITS))


def paged_decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,  # V token- or dims-major
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    f16_dot: Optional[bool] = None,
    rope: Optional[DecodeRope] = None,
    v_dequant_in_tile: Optional[bool] = None,
    run_addressing: Optional[bool] = None,
    order: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged KV cache -> [num_seqs, num_heads, head_dim] (`out`, a
    contiguous [num_seqs, num_heads, head_dim] tensor, when given).

    kv's scales (None, float or 1-element tensor) dequantise an fp8 cache (the new token's
    store quantizes with them when `rope` is given) and are ignored otherwise. With `rope` the kernel
    first norms and rotates q in place and the new key, and stores the new key and value in the cache.
    The other keyword-only knobs override the tuned defaults (tests, benchmarks). `v_dequant_in_tile` (fp8,
    fp16 dots): convert each V tile to fp16 where it is loaded (an opaque multiply by 1 keeps Triton from moving
    the conversion after the transpose into the PV dot's layout, where it reads the fp8 tile from shared memory
    one byte per instruction: there is no 8-bit ldmatrix.trans). `run_addressing`: K/V addresses per run of
    tokens that share a page instead of per token. Left None, both follow the launch's shapes (below).
    `order` ([num_seqs] int32, a permutation; used without splits): program row i takes sequence order[i], the
    output stays in sequence order. Longest first keeps a long sequence from starting in the kernel's last wave
    (256 sequences of the workload: 1-4% faster).
    """
    num_seqs, num_heads, head_dim = q.shape
    page, num_kv_heads = kv.block_size, kv.num_kv_heads
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert kv.head_dim == head_dim
    assert q.stride(-1) == 1
    v_t = kv.v_dims_major
    assert block_tables.shape[0] == num_seqs and seq_lens.shape[0] == num_seqs
    assert block_tables.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == (num_seqs, num_heads, head_dim) and out.is_contiguous()
    if num_seqs == 0:
        return out

    fp8 = kv.fp8
    # scales only apply to an fp8 cache
    k_ptr, v_ptr, k_val, v_val, scale_is_ptr = scale_args(kv.k_scale if fp8 else None, kv.v_scale if fp8 else None,
                                                          seq_lens)

    # Defaults from a sweep on an H100 (2026-11-22, at the
    # workload's shapes from 256 x 800 to 8 x 1600 tokens): 64-token tiles and 4 warps for bf16 and fp8 (the
    # 128-token / 8-warp fp8 tiles lost at every shape), 2 stages for bf16 and 3 for
    # fp8, fp16 dots for an fp8 cache.
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * page
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_kv_len, block_n, sm_count(q.device))
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 3 if fp8 else 2
    if f16_dot is None:
        f16_dot = fp8 and q.dtype != torch.float32
    # fp8 without splits (the workload's big batches, >= 4 programs per SM): addresses per run of a page's tokens
    # and V converted where it is loaded. The tile loop then issues 504 instead of 823 instructions per warp and
    # tile, and the kernel, bound by instruction issue before, runs 4-5% faster at 128-256 sequences
    # (benchmarks/RESULTS.md). With splits (<= 64 sequences) it lost (B=64: 125 vs 95 us),
    # and bf16, bound by bandwidth, lost 3-6% everywhere, so both keep the per-token loop.
    fp8_big_batch = fp8 and f16_dot and num_splits == 1
    if v_dequant_in_tile is None:
        v_dequant_in_tile = fp8_big_batch
    v_convert_at_load = bool(v_dequant_in_tile and fp8 and f16_dot and not v_t)  # V_T: no transpose to work around
    if run_addressing is None:
        run_addressing = fp8_big_batch
    run_addressing = run_addressing or v_t  # dims-major V is read per run

    pdl = use_pdl(q, num_seqs)
    if num_splits > 1:
        mid_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    counters = arrival_counters(q.device, num_seqs * num_kv_heads) if num_splits > 1 else seq_lens
    if rope is not None:
        assert rope.k.shape == (num_seqs, num_kv_heads, head_dim) and rope.v.shape == rope.k.shape
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1 and rope.slot_mapping.shape[0] == num_seqs
        assert (rope.q_weight is None) == (rope.k_weight is None)
        r = rope
        norm = r.q_weight is not None
        q_rot = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
        row_scale = r.scale_rows is not None
        rs_ptr, rs_stride, rs_n, rs_block = row_scale_args(r.scale_rows, num_seqs, q)
        ratios = r.qkv_ratios is not None
        assert not ratios or (row_scale and r.qkv_ratios.shape == (3,) and r.qkv_ratios.dtype == torch.float32)
        rope_args = (q_rot, r.k, r.v, r.positions, r.cos_sin_cache, r.q_weight if norm else r.cos_sin_cache,
                     r.k_weight if norm else r.cos_sin_cache, r.slot_mapping, r.eps, rs_ptr, rs_stride, rs_n,
                     r.scale_eps, r.qkv_ratios if ratios else r.cos_sin_cache, r.k.stride(0), r.k.stride(1),
                     r.v.stride(0), r.v.stride(1))
    else:
        norm = row_scale = ratios = False
        rs_block = 16
        rope_args = (q, q, q, seq_lens, seq_lens, q, q, seq_lens, 0.0, q, 0, 1, 0.0, q, 0, 0, 0, 0)  # unused
    if order is not None:
        assert order.shape == (num_seqs,) and order.dtype == torch.int32
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q,
        kv.k,
        kv.v,
        block_tables,
        seq_lens,
        out,
        mid_o,
        mid_lse,
        counters,
        k_ptr,
        v_ptr,
        k_val,
        v_val,
        scale * LOG2E,
        *rope_args[:8],
        order if order is not None else seq_lens,
        *rope_args[8:],
        q.stride(0),
        q.stride(1),
        *kv.strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_N=block_n,
        DIRECT=num_splits == 1,
        SCALE_IS_PTR=scale_is_ptr,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOT=f16_dot,
        PDL=pdl,
        # One merge width for every split count up to 32 (all a 4096-token table gets): otherwise each batch
        # size's split count compiles its own kernel variant at start-up, for a merge that runs once per
        # (sequence, KV head). Compiled for sm_90a width 32 costs no registers in the
        # plain or the rotary+PDL variant (126-128 bf16, 128 fp8); width 64 would (146 / 168 with rotary).
        SPLITS_PAD=max(MERGE_WIDTH, triton.next_power_of_2(num_splits)) if num_splits > 1 else 1,
        ROPE=rope is not None,
        ROPE_NORM=norm,
        ROPE_GROUP_PAD=triton.next_power_of_2(group),
        ROPE_ROW_SCALE=row_scale,
        RS_BLOCK=rs_block,
        ROPE_RATIOS=ratios,
        ROPE_QUANT=fp8,
        FP8_MAX=FP8_E4M3_MAX if kv.dtype == torch.float8_e4m3fn else 57344.0,
        L2_PREFETCH=pdl and num_seqs <= L2_PREFETCH_MAX_SEQS and head_dim * kv.k.element_size() % 128 == 0,
        KV_LINES=max(1, head_dim * kv.k.element_size() // 128),
        V_CONVERT_AT_LOAD=v_convert_at_load,
        SUB=min(page, block_n),
        RUN_ADDR=run_addressing,
        V_T=v_t,
        V_LINES=max(1, head_dim * page * kv.v.element_size() // 128),
        # with splits the programs fit in about one wave (choose_num_splits): nothing starts last, batch order
        ORDERED=order is not None and num_splits == 1,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_kwargs(pdl),
    )
    return out
