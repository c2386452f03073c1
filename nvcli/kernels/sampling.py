"""Fused temperature + Gumbel-max sampling over the vocabulary, one read of the logits.

token = argmax(logits / T + Gumbel noise) samples from softmax(logits / T); T = 0 is plain
argmax. The noise comes from Philox keyed by a per-row seed, so a request with a seed draws
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
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        seed = tl.load(seeds_ptr + row)
        u = tl.rand(seed, cols)  # uniform [0, 1), a function of (seed, column) only
        u = tl.maximum(u, 1e-20)
        x = x / temp - tl.log(-tl.log(u))
    x = tl.where(mask, x, float("-inf"))
    best = tl.max(x, axis=0)
    # first column holding the max (argmax tie rule)
    idx = tl.min(tl.where(x == best, cols, 2147483647), axis=0)
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
