"""A given token's log-softmax and rank in each row of logits, in one read of the logits (the torch form is in
engine/sampler.token_logprobs).

prompt_logprobs score every prompt token: a 2,048 x 1,000-token job reads 311 G logits. The torch form takes a float32
copy, a log-sum-exp and a compare-and-count, each its own pass over [rows, vocab] (15 s of device time for that job
on an H100, against 5 s for the job itself); here each program reads one slice of one row once, in the logits' own
dtype, and leaves (max, sum of exp(x - max), count of logits above the token's) for its slice. The host side merges
the slices: [rows, slices] numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048
_SLICE = 8 * _BLOCK  # vocabulary columns per program: 10 slices per row for a 151,936-token vocabulary


# targets_ptr is a slice of a longer tensor at a row offset: its alignment would make a variant of its own
@triton.jit(do_not_specialize=["targets_ptr"])
def _logprob_partials_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    targets_ptr,  # [rows] int64
    max_ptr,  # [rows, slices] float32
    sum_ptr,  # [rows, slices] float32: sum of exp(x - max) over the slice
    count_ptr,  # [rows, slices] int32: logits of the slice above the target's
    stride_logits,
    vocab,
    slices,
    BLOCK: tl.constexpr,
    SLICE: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_logits
    target = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
    m = tl.full([BLOCK], -1e30, tl.float32)  # finite: a slice of -inf (padding) must not give exp(-inf + inf)
    s = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(SLICE // BLOCK):
        cols = part * SLICE + i * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
        above += (x > target).to(tl.int32)
    m_all = tl.max(m, axis=0)
    out = row * slices + part
    tl.store(max_ptr + out, m_all)
    tl.store(sum_ptr + out, tl.sum(s * tl.exp(m - m_all), axis=0))
    tl.store(count_ptr + out, tl.sum(above, axis=0))


def logprob_and_rank_triton(logits: torch.Tensor, targets: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (row-contiguous), targets [rows] int64 -> (log-softmax at the targets [rows] float32,
    rank [rows] int32: 1 + logits strictly above the target's, log-sum-exp [rows, 1] float32)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel reads each row as one contiguous run"
    slices = triton.cdiv(vocab, _SLICE)
    maxes = torch.empty((rows, slices), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    counts = torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    if rows:
        _logprob_partials_kernel[(rows, slices)](logits, targets, maxes, sums, counts, logits.stride(0), vocab, slices,
                                                 BLOCK=_BLOCK, SLICE=_SLICE)
    top = maxes.max(dim=1, keepdim=True).values  # [rows, 1]
    lse = top + (sums * torch.exp(maxes - top)).sum(dim=1, keepdim=True).log()  # [rows, 1]
    chosen = logits.gather(1, targets.unsqueeze(1)).float() - lse  # [rows, 1]
    return chosen.squeeze(1), counts.sum(dim=1, dtype=torch.int32) + 1, lse
