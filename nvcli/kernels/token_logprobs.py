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
# Top-k over k > 1: the partials kernel keeps the largest key of every run of _RUN columns, and the finish kernel takes
# the row's k largest of those (the runs that hold its top k: a run whose largest is not among them has k larger
# columns elsewhere), then its top k from those k runs' columns: sorting networks over _SORT run keys, then over one
# run, each in a loop, per row. A network per 2,048 columns (width 8) had set the kernel's time: 2.1 ms per 880-row
# chunk.
_RUN = {0: 256, 1: 256, 8: 256, 32: 128}  # per width (used from 8 on)
_SORT = 256


_MIN_KEY: tl.constexpr = tl.constexpr(-(1 << 63))  # below every real logit's key: masked columns never enter a top-k


# The kernels' top-k widths (a constexpr: each is a variant, compiled at start-up). logprobs and prompt_logprobs
# take up to 20 alternatives; one (lm-eval-harness's greedy check) is a max per slice.
TOP_WIDTHS = (0, 1, 8, 32)


def top_width(k: int) -> int:
    """The narrowest width that holds k alternatives."""
    return next(w for w in TOP_WIDTHS if w >= k)


@triton.jit
def _logit_keys(x, cols, mask):
    """Keys that order as the logit x (float32), then its column: the float's bits made to sort as signed integers,
    above the column (every logit is exact in float32); masked columns sort below every real one."""
    bits = x.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | cols.to(tl.int64)
    return tl.where(mask, key, _MIN_KEY)


@triton.jit
def _read_block(base, cols, vocab, target, m, s, above):
    """One block of a row: the running max, sum of exp(x - max) and count above the target take it in."""
    mask = cols < vocab
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m, x)
    s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
    above += (x > target).to(tl.int32)
    return m_new, s, above, _logit_keys(x, cols, mask)


# targets_ptr is a slice of a longer tensor at a row offset: its alignment would make a variant of its own
@triton.jit(do_not_specialize=["targets_ptr"])
def _logprob_partials_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    targets_ptr,  # [rows] int64
    max_ptr,  # [rows, slices] float32
    sum_ptr,  # [rows, slices] float32: sum of exp(x - max) over the slice
    count_ptr,  # [rows, slices] int32: logits of the slice above the target's
    top_ptr,  # TOPK 1: [rows, slices] int64, the slice's largest key; TOPK > 1: [rows, slices * SLICE / RUN], each
    # run's largest key; unused when TOPK is 0
    stride_logits,
    vocab,
    slices,
    BLOCK: tl.constexpr,
    SLICE: tl.constexpr,
    RUN: tl.constexpr,
    TOPK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_logits
    target = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
    m = tl.full([BLOCK], -1e30, tl.float32)  # finite: a slice of -inf (padding) must not give exp(-inf + inf)
    s = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.int32)
    out = row * slices + part
    best = _MIN_KEY
    for i in tl.static_range(SLICE // BLOCK):  # unrolled: the blocks' loads in flight together
        m, s, above, key = _read_block(base, part * SLICE + i * BLOCK + tl.arange(0, BLOCK), vocab, target, m, s,
                                       above)
        if TOPK == 1:
            best = tl.maximum(best, tl.max(key, axis=0))
        if TOPK > 1:  # each run's largest key
            runs = (out.to(tl.int64) * SLICE + i * BLOCK) // RUN + tl.arange(0, BLOCK // RUN)
            tl.store(top_ptr + runs, tl.max(tl.reshape(key, [BLOCK // RUN, RUN]), axis=1))
    if TOPK == 1:
        tl.store(top_ptr + out, best)
    m_all = tl.max(m, axis=0)
    tl.store(max_ptr + out, m_all)
    tl.store(sum_ptr + out, tl.sum(s * tl.exp(m - m_all), axis=0))
    tl.store(count_ptr + out, tl.sum(above, axis=0))


# targets_ptr may be a slice of a longer tensor at a row offset, out_ptr is one: alignment would make variants of them;
# and k = 16 a variant of its own (Triton specializes multiples of 16), compiled mid-run; the logits' stride serves
# one scalar load here
@triton.jit(do_not_specialize=["targets_ptr", "out_ptr", "k", "stride_logits"])
def _logprob_finish_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    targets_ptr,  # [rows] int64
    max_ptr,  # [rows, slices] float32, as the partials kernel left them
    sum_ptr,  # [rows, slices] float32
    count_ptr,  # [rows, slices] int32
    top_ptr,  # as the partials kernel left it
    out_ptr,  # [rows, 3 + 2k] int32: token id, logprob (float32 bits), rank, k top logprobs (bits), k top ids
    stride_logits,
    stride_out,
    vocab,
    slices,
    runs,  # per row: slices * SLICE / RUN
    k,
    SLICES: tl.constexpr,  # a power of two >= slices
    RUN: tl.constexpr,
    RUNS: tl.constexpr,  # a multiple of SORT >= runs
    SORT: tl.constexpr,  # run keys taken per step of the run selection
    TOPK: tl.constexpr,
):
    """One program per row: merge the row's slices into its log-sum-exp, the target's logprob and rank, and its top k,
    all written to one row of `out` (one copy to the host for the whole step). In torch this was about 25 small ops
    per step, each a launch the host pays for (benchmarks/RESULTS.md: 2.1 ms against 0.8 ms per small step)."""
    row = tl.program_id(0)
    offs = tl.arange(0, SLICES)
    mask = offs < slices
    m = tl.load(max_ptr + row * slices + offs, mask=mask, other=-1e30)  # the partials' own floor: finite
    m_all = tl.max(m, axis=0)
    s = tl.load(sum_ptr + row * slices + offs, mask=mask, other=0.0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), axis=0))
    above = tl.sum(tl.load(count_ptr + row * slices + offs, mask=mask, other=0), axis=0)
    target = tl.load(targets_ptr + row)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + target).to(tl.float32)
    out = out_ptr + row.to(tl.int64) * stride_out
    tl.store(out, target.to(tl.int32))
    tl.store(out + 1, (x - lse).to(tl.int32, bitcast=True))
    tl.store(out + 2, above + 1)
    if TOPK == 1:
        best = tl.max(tl.load(top_ptr + row * slices + offs, mask=mask, other=_MIN_KEY), axis=0)
    if TOPK > 1:
        # loops, each with its sorting networks compiled once: unrolled over a row's runs and then over its TOPK
        # runs' columns, the width-32 variant took 6 s to compile (2 s of a cold start-up's compile-ahead phase)
        top_runs = tl.full([TOPK], _MIN_KEY, tl.int64)  # the runs that hold the row's top TOPK (padding: _MIN_KEY)
        for a in range(0, RUNS, SORT):
            r = a + tl.arange(0, SORT)
            block = tl.load(top_ptr + row.to(tl.int64) * runs + r, mask=r < runs, other=_MIN_KEY)
            top_runs = tl.topk(tl.reshape(tl.join(top_runs, tl.topk(block, TOPK)), [2 * TOPK]), TOPK)
        slot = tl.arange(0, TOPK)
        best = tl.full([TOPK], _MIN_KEY, tl.int64)
        for j in range(TOPK):
            run_key = tl.max(tl.where(slot == j, top_runs, _MIN_KEY), axis=0)
            cols = (run_key & 0xFFFFFFFF) // RUN * RUN + tl.arange(0, RUN)
            # a padding run reads nothing (a select, not `&`: see skinny_gemm's row loop)
            valid = tl.where(run_key != _MIN_KEY, cols < vocab, False)
            logit = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + cols, mask=valid, other=float("-inf"))
            keys = _logit_keys(logit.to(tl.float32), cols, valid)
            best = tl.topk(tl.reshape(tl.join(best, tl.topk(keys, TOPK)), [2 * TOPK]), TOPK)  # the largest first
    if TOPK > 0:
        ordered = (best >> 32).to(tl.int32)
        value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True) - lse
        ids = (best & 0xFFFFFFFF).to(tl.int32)
        if TOPK == 1:
            tl.store(out + 3, value.to(tl.int32, bitcast=True), mask=k > 0)
            tl.store(out + 3 + k, ids, mask=k > 0)
        else:
            o = tl.arange(0, TOPK)
            tl.store(out + 3 + o, value.to(tl.int32, bitcast=True), mask=o < k)
            tl.store(out + 3 + k + o, ids, mask=o < k)


def logprob_and_rank_triton(logits: torch.Tensor, targets: torch.Tensor, k: int = 0,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab] (row-contiguous), targets [rows] int64 -> [rows, 3 + 2k] int32 (`out` where given): per
    row the target, its log-softmax (float32 bits), its rank (1 + logits strictly above the target's), then the row's
    k most likely tokens, their log-softmax (float32 bits) and ids, in descending order (of equal logits the higher id
    first). engine/sampler.TokenLogprobs reads it."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel reads each row as one contiguous run"
    assert k <= vocab, f"{k} top tokens of a {vocab}-token vocabulary"
    if out is None:
        out = torch.empty((rows, 3 + 2 * k), dtype=torch.int32, device=logits.device)
    assert out.shape == (rows, 3 + 2 * k) and out.stride(1) == 1
    if not rows:
        return out
    slices = triton.cdiv(vocab, _SLICE)
    width = top_width(k)
    maxes = torch.empty((rows, slices), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    counts = torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    run = _RUN[width]
    runs = slices * (_SLICE // run)
    tops = torch.empty((rows, slices if width <= 1 else runs), dtype=torch.int64, device=logits.device)
    _logprob_partials_kernel[(rows, slices)](logits, targets, maxes, sums, counts, tops, logits.stride(0), vocab,
                                             slices, BLOCK=_BLOCK, SLICE=_SLICE, RUN=run, TOPK=width)
    _logprob_finish_kernel[(rows,)](logits, targets, maxes, sums, counts, tops, out, logits.stride(0), out.stride(0),
                                    vocab, slices, runs, k, SLICES=triton.next_power_of_2(slices), RUN=run,
                                    RUNS=triton.cdiv(runs, _SORT) * _SORT, SORT=_SORT, TOPK=width)
    return out
