"""Temperature sampling over the vocabulary by inverse CDF: one read of the logits, two uniforms per row.

P(token i) = exp2(y_i - M) / W with y = logits * log2(e) / T, M = max y and W = sum exp2(y - M):
the softmax of logits / T, in base 2. Two kernels:

1. `_sample_chunk_sums_kernel`, one program per (row, chunk of CHUNK columns): the chunk's max
   m_c and s_c = sum exp2(y - m_c). Per column that is one exp2 and a few adds, so the pass is
   bound by the read of the logits, not by arithmetic.
2. `_sample_pick_kernel`, one program per row: chunk weights w_c = s_c * exp2(m_c - M) sum to W;
   a Philox uniform u1 picks chunk j with probability w_j / W (the first chunk whose cumulative
   weight exceeds u1 * W); j is re-read, and a second uniform u2 picks its column with probability
   exp2(y_i - m_j) / (the chunk's sum) the same way. Two levels, so a column's probability is
   resolved in its own chunk's scale, not to float32 steps of the whole row's mass. Both uniforms
   are keyed by the row's seed alone: a seeded row draws the same token wherever it sits in the
   batch.

T = 0 is plain argmax: kernel 1 keeps each chunk's max and its first column, kernel 2 the
first chunk holding the row's max (first index wins ties, like torch.argmax). Rounding never
picks a token of zero probability (a -inf logit, a column past the vocabulary): the picks
require nonzero weight and fall back to the last nonzero chunk or column. A row with no finite
logit gets column 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_CHUNKS = 1024  # kernel 2 holds a row's chunk list in one tile


@triton.jit
def _tempered_log2(x, temp):
    """y = x * log2(e) / T: softmax(x / T) in base 2. Both kernels compute it here, so the max kernel 1 stores
    for a chunk is the max kernel 2 sees when it re-reads it."""
    return x * (1.4426950408889634 / temp)


@triton.jit
def _sample_chunk_sums_kernel(
    logits_ptr,  # [num_rows, vocab]
    temps_ptr,  # [num_rows] fp32
    max_ptr,  # [num_rows, num_chunks] fp32: max of y (sampled rows) or of the logits (greedy rows)
    sum_ptr,  # [num_rows, num_chunks] fp32: sum exp2(y - max); written for sampled rows only
    idx_ptr,  # [num_rows, num_chunks] int32: first column holding the max; greedy rows only
    floor_ptr,  # [num_rows] fp32 (HAS_FLOOR): a sampled row's columns below its floor weigh 0 (sampling_filters.py)
    stride_row,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)  # [CHUNK]
    out = row * num_chunks + chunk
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        if HAS_FLOOR:
            x = tl.where(x >= tl.load(floor_ptr + row), x, float("-inf"))
        y = _tempered_log2(x, temp)
        m = tl.max(y, axis=0)
        # -inf columns (masked ones too) weigh exp2(-inf) = 0; an all -inf chunk subtracts 0, not -inf (NaN)
        p = tl.exp2(y - tl.where(m == float("-inf"), 0.0, m))
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(p, axis=0))
    else:
        m = tl.max(x, axis=0)
        tl.store(max_ptr + out, m)
        tl.store(idx_ptr + out, tl.min(tl.where(x == m, cols, 2147483647), axis=0))  # argmax tie rule


@triton.jit
def _sample_pick_kernel(
    logits_ptr,  # [num_rows, vocab]
    temps_ptr,  # [num_rows] fp32
    seeds_ptr,  # [num_rows] int64
    max_ptr,  # [num_rows, num_chunks] fp32
    sum_ptr,  # [num_rows, num_chunks] fp32
    idx_ptr,  # [num_rows, num_chunks] int32
    out_ptr,  # [num_rows] int64
    floor_ptr,  # [num_rows] fp32 (HAS_FLOOR)
    stride_row,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,  # num_chunks padded to a power of two
    HAS_FLOOR: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P2)
    valid = c < num_chunks
    base = row * num_chunks
    m = tl.load(max_ptr + base + c, mask=valid, other=float("-inf"))  # [CHUNKS_P2]
    big = 2147483647
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        s = tl.load(sum_ptr + base + c, mask=valid, other=0.0)  # [CHUNKS_P2]
        top = tl.max(m, axis=0)
        w = s * tl.exp2(m - top)  # [CHUNKS_P2] chunk weights: 0 where no logit is finite (s = 0) and in the padding
        cum = tl.cumsum(w, axis=0)  # [CHUNKS_P2] inclusive
        seed = tl.load(seeds_ptr + row)
        u1, u2, _, _ = tl.rand4x(seed, tl.full((), 0, tl.int32))  # functions of the seed only
        target = u1 * tl.sum(w, axis=0)
        # w > 0 as well: a parallel scan need not keep cum flat across a zero weight
        j = tl.min(tl.where((cum > target) & (w > 0), c, big), axis=0)
        if j == big:  # u1 * W rounded up to the total: the last chunk with weight (0 in an all -inf row)
            j = tl.maximum(tl.max(tl.where(w > 0, c, -1), axis=0), 0)
        m_j = tl.load(max_ptr + base + j)
        cols = j * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)  # [CHUNK]
        if HAS_FLOOR:
            x = tl.where(x >= tl.load(floor_ptr + row), x, float("-inf"))
        y = _tempered_log2(x, temp)  # as kernel 1 computed it, so m_j is this chunk's max
        p = tl.exp2(y - m_j)  # [CHUNK]; m_j is finite, as chunk j has weight
        cum_p = tl.cumsum(p, axis=0)  # [CHUNK] inclusive
        col = tl.min(tl.where((cum_p > u2 * tl.max(cum_p, axis=0)) & (p > 0), cols, big), axis=0)
        if col == big:  # rounding again: the chunk's last column with weight
            col = tl.maximum(tl.max(tl.where(p > 0, cols, -1), axis=0), j * CHUNK)
        tl.store(out_ptr + row, col.to(tl.int64))
    else:
        j = tl.min(tl.where(valid & (m == tl.max(m, axis=0)), c, big), axis=0)  # first chunk with the max
        tl.store(out_ptr + row, tl.load(idx_ptr + base + j).to(tl.int64))


def sample_triton(
    logits: torch.Tensor,  # [num_rows, vocab], any float dtype, last dim contiguous
    temperatures: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    seeds: torch.Tensor,  # [num_rows] int64, used where temperature > 0
    floors: torch.Tensor | None = None,  # [num_rows] fp32: draw only from the columns at or above (sampled rows)
    chunk: int = 4096,
) -> torch.Tensor:  # [num_rows] int64
    """One token per row from softmax(logits / T), or argmax where T = 0; with `floors` (top-k / top-p / min-p,
    sampling_filters.py) from the columns x >= floor only, renormalized."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)  # [num_rows]
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, chunk)
    assert chunk & (chunk - 1) == 0 and num_chunks <= _MAX_CHUNKS, (
        f"chunk must be a power of two with vocab / chunk <= {_MAX_CHUNKS}: got chunk {chunk}, vocab {vocab}"
    )
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)  # [num_rows, num_chunks]
    sums = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)  # [num_rows, num_chunks]
    idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)  # [num_rows, num_chunks]
    _sample_chunk_sums_kernel[(rows, num_chunks)](
        logits, temperatures, best, sums, idx, temperatures if floors is None else floors, logits.stride(0), vocab,
        num_chunks, CHUNK=chunk, HAS_FLOOR=floors is not None, num_warps=8
    )
    _sample_pick_kernel[(rows,)](
        logits, temperatures, seeds, best, sums, idx, out, temperatures if floors is None else floors,
        logits.stride(0), vocab, num_chunks, CHUNK=chunk, CHUNKS_P2=triton.next_power_of_2(num_chunks),
        HAS_FLOOR=floors is not None, num_warps=8,
    )
    return out
