"""Fused temperature + Gumbel-max sampling over the vocabulary, one read of the logits.

token = argmax(logits / T + Gumbel noise) samples from softmax(logits / T); T = 0 is plain
argmax. The kernel works in base 2 (same argmax, cheaper logs). The noise comes from Philox keyed by a per-row seed, so a request with a seed draws
the same noise whatever else shares the batch. Each program reduces one chunk of one row to
its (max, argmax); a tiny torch reduction picks the winning chunk (first index wins ties, like
torch.argmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_chunk_kernel(
    logits_ptr,  # [num_rows, vocab]
    temps_ptr,  # [num_rows] fp32
    seeds_ptr,  # [num_rows] int64
    max_ptr,  # [num_rows, num_chunks] fp32
    idx_ptr,  # [num_rows, num_chunks] int32
    stride_row,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
):
    # The chunk is four slabs of CHUNK // 4 columns: one Philox call (tl.rand4x) yields the
    # noise of the same position in all four, a quarter of the RNG work of one call per column.
    QUARTER: tl.constexpr = CHUNK // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, QUARTER)
    cols0 = chunk * CHUNK + offs
    cols1 = cols0 + QUARTER
    cols2 = cols1 + QUARTER
    cols3 = cols2 + QUARTER
    base = logits_ptr + row.to(tl.int64) * stride_row
    x0 = tl.load(base + cols0, mask=cols0 < vocab, other=float("-inf")).to(tl.float32)
    x1 = tl.load(base + cols1, mask=cols1 < vocab, other=float("-inf")).to(tl.float32)
    x2 = tl.load(base + cols2, mask=cols2 < vocab, other=float("-inf")).to(tl.float32)
    x3 = tl.load(base + cols3, mask=cols3 < vocab, other=float("-inf")).to(tl.float32)
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        seed = tl.load(seeds_ptr + row)
        # uniform [0, 1) noise, a function of (seed, column) only
        u0, u1, u2, u3 = tl.rand4x(seed, chunk * QUARTER + offs)
        # argmax(x / T - ln(-ln u)) in base 2: scaling by log2(e) and dropping the constant
        # log2(ln 2) keep the argmax, and leave one multiply and two base-2 logs per column
        c = 1.4426950408889634 / temp
        x0 = x0 * c - tl.log2(-tl.log2(u0))
        x1 = x1 * c - tl.log2(-tl.log2(u1))
        x2 = x2 * c - tl.log2(-tl.log2(u2))
        x3 = x3 * c - tl.log2(-tl.log2(u3))
    x0 = tl.where(cols0 < vocab, x0, float("-inf"))
    x1 = tl.where(cols1 < vocab, x1, float("-inf"))
    x2 = tl.where(cols2 < vocab, x2, float("-inf"))
    x3 = tl.where(cols3 < vocab, x3, float("-inf"))
    best = tl.maximum(tl.maximum(tl.max(x0, axis=0), tl.max(x1, axis=0)),
                      tl.maximum(tl.max(x2, axis=0), tl.max(x3, axis=0)))
    # first column holding the max (argmax tie rule)
    none = 2147483647
    idx = tl.minimum(tl.minimum(tl.min(tl.where(x0 == best, cols0, none), axis=0),
                                tl.min(tl.where(x1 == best, cols1, none), axis=0)),
                     tl.minimum(tl.min(tl.where(x2 == best, cols2, none), axis=0),
                                tl.min(tl.where(x3 == best, cols3, none), axis=0)))
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, idx)


def gumbel_sample_triton(
    logits: torch.Tensor,  # [num_rows, vocab], any float dtype, last dim contiguous
    temperatures: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    seeds: torch.Tensor,  # [num_rows] int64, used where temperature > 0
    chunk: int = 4096,
) -> torch.Tensor:  # [num_rows] int64
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    if rows:
        _sample_chunk_kernel[(rows, num_chunks)](
            logits, temperatures, seeds, best, idx, logits.stride(0), vocab, num_chunks, CHUNK=chunk, num_warps=8
        )
    winner = best.argmax(dim=1, keepdim=True)  # first chunk with the max
    return idx.gather(1, winner).squeeze(1).long()
