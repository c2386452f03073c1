"""Decode attention for steps whose sequences all begin with the same cached pages (one long instruction in front
of every line of a job, computed once by prefix caching).

The engine's decode kernel (decode_attention.py) takes one (sequence, KV head) per program, its query rows padded
to tl.dot's 16, so a page that 256 sequences share is read 256 times per layer; L2 absorbs about half of that
(benchmarks/shared_prefix_gpu.py: 0.49x the time of unshared pages). Here a group of SEQS = 16 // GROUP
sequences shares one KV head's 16 query rows (their GROUP query heads each stacked into the rows that the other
kernel pads), and the group's work is split between programs:
1. SHARED_SPLITS programs each read a share of the shared pages once for the whole group: every row attends to them
   (more shares where there are few groups, so the shared pages alone about fill the GPU twice over);
2. SEQS programs each read one sequence's own pages, its rows alone unmasked (the others' scores -inf), in parallel
   as the engine kernel reads every sequence's pages (a program that walked the group's own pages one sequence after
   another was 1.2-2.2x slower than the engine kernel at 64-128 rows over fp8 pages).
Each writes its rows' normalized partial output and log-sum-exp; the group's last program to arrive (an acq_rel
counter, kernels/arrival_counters.py) merges them. The shared length is a device scalar, so a CUDA graph replays
with whatever prefix the step has.

fp8 caches: tiles are converted to fp16 for the dots (as decode_attention.py's F16_DOT) and the per-tensor scales
applied to the scores and the output. With 32-token pages V is dims-major (kv_layout.py): tiles of two whole pages
read V transposed, one address per page, and a sequence's open page is a tile of its own, token-major rows, taken
first, as the engine kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.arrival_counters import arrival_counters
from nvcli.kernels.decode_attention import sm_count
from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.kv_store import load_scales, scale_args

MAX_SHARED_SPLITS = 8


@triton.jit
def _softmax_tile(q, k_tile, v_tile, mask, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr):
    """Online-softmax step over one KV tile (q and the tiles in the dots' dtype); rows whose scores are all masked
    keep their state (no NaN)."""
    if DOT_F32:  # float32 models: full-precision products (tl.dot would take TF32 on the GPU)
        s = tl.dot(q, tl.trans(k_tile), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k_tile))
    s = tl.where(mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = tl.dot(p, v_tile, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _kv_tile(k_head, v_head, bt_row, t, end, offs_n, offs_d, stride_kb, stride_kt, stride_vb, stride_vt,
             PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """K and V [BLOCK_N, HEAD_DIM] of one KV head at positions t + offs_n (those below `end`) of a sequence, through
    its block table (token-major pages), in the dots' dtype; and which positions are in range."""
    pos = t + offs_n
    in_range = pos < end
    blk = tl.load(bt_row + pos // PAGE, mask=in_range, other=0).to(tl.int64)
    k = tl.load(k_head + (blk * stride_kb + (pos % PAGE) * stride_kt)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    v = tl.load(v_head + (blk * stride_vb + (pos % PAGE) * stride_vt)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    return k.to(DOT_DTYPE), v.to(DOT_DTYPE), in_range


@triton.jit
def _dims_major_tile(k_head, v_head, bt_row, t, end, offs_d, stride_kb, stride_kt, stride_vb,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, RUNS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """K and V [RUNS * PAGE, HEAD_DIM] of the whole pages at positions [t, t + RUNS * PAGE) below `end` (a page
    boundary), V dims-major (kv_layout.py) read transposed: one address per page, like decode_attention.py's
    RUN_ADDR; and which positions are in range."""
    offs_r = tl.arange(0, RUNS)
    offs_s = tl.arange(0, PAGE)
    run_start = t + offs_r * PAGE  # [RUNS]
    run_ok = run_start < end
    blk = tl.load(bt_row + run_start // PAGE, mask=run_ok, other=0).to(tl.int64)
    k = tl.load(k_head + (blk * stride_kb)[:, None, None] + (offs_s * stride_kt)[None, :, None] + offs_d[None, None, :],
                mask=run_ok[:, None, None], other=0.0)  # [RUNS, PAGE, HEAD_DIM]
    vt = tl.load(v_head + (blk * stride_vb)[None, :, None] + (offs_d * PAGE)[:, None, None] + offs_s[None, None, :],
                 mask=run_ok[None, :, None], other=0.0)  # [HEAD_DIM, RUNS, PAGE]
    k = tl.reshape(k, [RUNS * PAGE, HEAD_DIM])
    v = tl.trans(tl.reshape(vt, [HEAD_DIM, RUNS * PAGE]))
    return k.to(DOT_DTYPE), v.to(DOT_DTYPE), t + tl.arange(0, RUNS * PAGE) < end


@triton.jit
def _open_page_tile(k_head, v_head, bt_row, t, end, offs_d, stride_kb, stride_kt, stride_vb,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """K and V [PAGE, HEAD_DIM] of a sequence's open page (positions [t, end), t a page boundary) in a cache whose
    full V pages are dims-major: its V still token-major rows in the same bytes (kv_layout.py)."""
    offs_p = tl.arange(0, PAGE)
    in_range = t + offs_p < end
    blk = tl.load(bt_row + t // PAGE).to(tl.int64)
    k = tl.load(k_head + blk * stride_kb + offs_p[:, None] * stride_kt + offs_d[None, :], mask=in_range[:, None],
                other=0.0)
    v = tl.load(v_head + blk * stride_vb + offs_p[:, None] * HEAD_DIM + offs_d[None, :], mask=in_range[:, None],
                other=0.0)
    return k.to(DOT_DTYPE), v.to(DOT_DTYPE), in_range


@triton.jit
def _shared_prefix_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, shared_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    num_seqs, qk_scale, k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_os,
    stride_oh,
    GROUP: tl.constexpr, SEQS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, DOT_DTYPE: tl.constexpr, SCALE_IS_PTR: tl.constexpr,
    V_T: tl.constexpr, SHARED_SPLITS: tl.constexpr, PER_GROUP: tl.constexpr,
):
    g = tl.program_id(0)  # SEQS consecutive entries of `order`
    kvh = tl.program_id(1)
    part = tl.program_id(2)  # [0, SHARED_SPLITS): a share of the shared pages; then one sequence's own pages each
    num_kv_heads = tl.num_programs(1)
    rows = tl.arange(0, ROWS)
    slot = rows // GROUP  # which of the group's sequences a row belongs to
    idx = g * SEQS + slot
    row_exists = (slot < SEQS) & (idx < num_seqs)
    seq = tl.load(order_ptr + idx, mask=row_exists, other=0)
    n = tl.load(lens_ptr + seq, mask=row_exists, other=0)
    valid = row_exists & (n > 0)  # a CUDA graph's padding rows have length 0
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR)
    # tokens, whole pages, that the group's sequences share, below each one's length (the caller's contract)
    shared = tl.load(shared_ptr + g) if PER_GROUP else tl.load(shared_ptr)
    if part < SHARED_SPLITS:  # every row of the group attends to its share of the shared pages
        mine = valid
        share = tl.cdiv(tl.cdiv(shared, SHARED_SPLITS), BLOCK_N) * BLOCK_N
        lo = part * share
        hi = tl.minimum(lo + share, shared)
        full_hi = hi  # whole pages
        # the shared pages from the group's first sequence's table (every sequence of the group has the same ones)
        bt_row = bt_ptr + tl.load(order_ptr + g * SEQS).to(tl.int64) * stride_bt
    else:  # one sequence's own pages, its rows alone
        i = part - SHARED_SPLITS
        mine = valid & (slot == i)
        i_idx = g * SEQS + i
        s_i = tl.load(order_ptr + i_idx, mask=i_idx < num_seqs, other=0)
        n_i = tl.load(lens_ptr + s_i, mask=i_idx < num_seqs, other=0)
        lo = shared
        hi = tl.maximum(n_i, shared)  # a padding row (length 0): no tiles
        full_hi = tl.maximum(n_i // PAGE * PAGE, shared)  # then the open page, if any
        bt_row = bt_ptr + s_i.to(tl.int64) * stride_bt
    q = tl.load(q_ptr + seq.to(tl.int64)[:, None] * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mine[:, None], other=0.0).to(DOT_DTYPE)  # [ROWS, HEAD_DIM]
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    score_scale = qk_scale * k_scale
    if V_T:
        if full_hi < hi:  # the open page first, before the loop's state is live (as decode_attention.py does)
            k, v, in_range = _open_page_tile(k_head, v_head, bt_row, full_hi, hi, offs_d, stride_kb, stride_kt,
                                             stride_vb, HEAD_DIM, PAGE, DOT_DTYPE)
            m_i, l_i, acc = _softmax_tile(q, k, v, mine[:, None] & in_range[None, :], m_i, l_i, acc, score_scale,
                                          DOT_F32)
        for t in range(lo, full_hi, BLOCK_N):
            k, v, in_range = _dims_major_tile(k_head, v_head, bt_row, t, full_hi, offs_d, stride_kb, stride_kt,
                                              stride_vb, HEAD_DIM, PAGE, BLOCK_N // PAGE, DOT_DTYPE)
            m_i, l_i, acc = _softmax_tile(q, k, v, mine[:, None] & in_range[None, :], m_i, l_i, acc, score_scale,
                                          DOT_F32)
    else:
        for t in range(lo, hi, BLOCK_N):
            k, v, in_range = _kv_tile(k_head, v_head, bt_row, t, hi, offs_n, offs_d, stride_kb, stride_kt, stride_vb,
                                      stride_vt, PAGE, DOT_DTYPE)
            m_i, l_i, acc = _softmax_tile(q, k, v, mine[:, None] & in_range[None, :], m_i, l_i, acc, score_scale,
                                          DOT_F32)
    # this part's (normalized output, log2-sum-exp) of its rows; parts [group, KV head, SHARED_SPLITS + 1, ROWS]:
    # the shared shares, then the rows' own part (each own program writes its sequence's rows)
    empty = l_i == 0.0
    base = ((g * num_kv_heads + kvh) * (SHARED_SPLITS + 1) + tl.minimum(part, SHARED_SPLITS)) * ROWS + rows
    tl.store(mid_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=mine[:, None])
    tl.store(mid_lse_ptr + base, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=mine)
    # acq_rel: the parts above are visible before the count moves, and the last part to arrive sees all of them; it
    # merges the group's rows and resets the counter for the next call (a CUDA graph replays the same counters)
    cnt = counter_ptr + g * num_kv_heads + kvh
    if tl.atomic_add(cnt, 1, sem="acq_rel") == SHARED_SPLITS + SEQS - 1:
        tl.atomic_xchg(cnt, 0)
        first = (g * num_kv_heads + kvh) * (SHARED_SPLITS + 1) * ROWS + rows
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        for p in range(SHARED_SPLITS + 1):
            m = tl.maximum(m, tl.load(mid_lse_ptr + first + p * ROWS, mask=valid, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([ROWS], dtype=tl.float32)
        out = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for p in range(SHARED_SPLITS + 1):
            w = tl.exp2(tl.load(mid_lse_ptr + first + p * ROWS, mask=valid, other=float("-inf")) - m)
            o = tl.load(mid_o_ptr + (first + p * ROWS)[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None],
                        other=0.0)
            total += w
            out += w[:, None] * o
        out = tl.where(valid[:, None], out * v_scale / tl.where(total > 0, total, 1.0)[:, None], 0.0)  # empty: 0
        tl.store(out_ptr + seq.to(tl.int64)[:, None] * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_exists[:, None])


def supports_shared_prefix(kv: PagedKV) -> bool:
    """Caches this kernel reads: token-major K pages, and V token-major or dims-major (kv_layout.py)."""
    return kv.k.stride(-1) == 1 and (kv.v.stride(-1) == 1 or kv.v_dims_major)


def seqs_per_group(num_heads: int, num_kv_heads: int) -> int:
    """Sequences whose query heads of one KV head fill a group's 16 query rows (Qwen3's 2 heads per KV head: 8)."""
    return max(1, 16 // (num_heads // num_kv_heads))


def shared_prefix_decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,  # supports_shared_prefix
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a graph's padding row)
    shared_len: torch.Tensor,  # int32, [1] or one per group (seqs_per_group consecutive rows of `order`): the first
    # shared_len tokens (whole pages) are the same pages in every table of the step (of the group), and every row
    # with a length is longer than that
    scale: float,
    order: torch.Tensor | None = None,  # [num_seqs] int32 permutation: the rows grouped into programs in this order
    out: torch.Tensor | None = None,  # like q: written in place (a mixed step's leading rows of its output)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.block_size, kv.num_kv_heads
    assert supports_shared_prefix(kv) and num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    seqs = seqs_per_group(num_heads, num_kv_heads)
    rows = max(16, triton.next_power_of_2(seqs * group))
    if out is None:
        out = torch.empty_like(q)
    if order is None:
        order = torch.arange(num_seqs, dtype=torch.int32, device=q.device)
    if num_seqs == 0:
        return out
    dot_f32 = q.dtype == torch.float32
    fp8 = kv.fp8
    # fp8 tiles are converted for the dots: to fp16, whose mantissa holds every e4m3 value (bf16's does not)
    dot_dtype = tl.float32 if dot_f32 else tl.float16 if fp8 or q.dtype == torch.float16 else tl.bfloat16
    v_t = kv.v_dims_major
    # dims-major V: two pages per tile (fp8's 32-token pages), as the engine kernel's 64-token tiles
    block_n = 2 * block_size if v_t else 32 if dot_f32 else 64
    # scales only apply to an fp8 cache (an fp8 cache's are floats or [1] float32 tensors)
    k_ptr, v_ptr, k_val, v_val, scale_is_ptr = scale_args(kv.k_scale if fp8 else None, kv.v_scale if fp8 else None,
                                                          seq_lens)
    groups = triton.cdiv(num_seqs, seqs)
    per_group = shared_len.numel() > 1
    assert not per_group or shared_len.numel() >= groups
    # the shared pages split so that their programs alone about fill the GPU twice over (the own pages add
    # seqs programs per group beside them)
    shared_splits = max(1, min(MAX_SHARED_SPLITS, 2 * sm_count(q.device) // (groups * num_kv_heads)))
    mid_o = torch.empty(groups * num_kv_heads * (shared_splits + 1) * rows, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty(groups * num_kv_heads * (shared_splits + 1) * rows, dtype=torch.float32, device=q.device)
    counters = arrival_counters(q.device, groups * num_kv_heads)
    grid = (groups, num_kv_heads, shared_splits + seqs)
    _shared_prefix_decode_kernel[grid](
        q, kv.k, kv.v, block_tables, seq_lens, order, shared_len, out, mid_o, mid_lse, counters, num_seqs,
        scale * 1.4426950408889634, k_ptr, v_ptr, k_val, v_val,
        q.stride(0), q.stride(1), *kv.strides[:6], block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, SEQS=seqs, ROWS=rows, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_N=block_n, DOT_F32=dot_f32,
        DOT_DTYPE=dot_dtype, SCALE_IS_PTR=scale_is_ptr, V_T=v_t, SHARED_SPLITS=shared_splits, PER_GROUP=per_group, num_warps=4,
        num_stages=3,  # Triton's default on Hopper, which the bf16 measurements used; the engine's fp8 kernel too
    )
    return out

