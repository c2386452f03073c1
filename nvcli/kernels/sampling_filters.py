"""Top-k, top-p and min-p as one floor per row, found without sorting the vocabulary.

vLLM's filters keep, per row of tempered logits x / T: the k most likely tokens (top-k); of those, the most likely
ones until their renormalized mass reaches top_p (a token stays while the mass of the tokens more likely than it is
below top_p); of those, the tokens at least min_p times as likely as the most likely one (min-p). Each keeps the tokens
at or above some logit, so together they are one floor per row: keep x >= floor. Ties with the last token kept are
kept too (a sort breaks them arbitrarily; vLLM's top-k-only path keeps them as well). A greedy row (T = 0) keeps all.

Sorting [rows, vocab] float32 every step, as the filters were first written, took 5.5 ms at 256 rows of Qwen3's
151,936-token vocabulary on an H100, against 45 us for the sampler itself, and Qwen3's generation_config.json asks for
top_k 20 and top_p 0.95 on every request. `_filter_floor_kernel` instead searches
the logits' order keys (an int32 that orders as the float does: `_order_key`), one program per row. Each pass over
the row tallies, for PROBES candidate keys at once, the tokens (top-k) or the tempered mass (top-p) at or above each
candidate, and narrows the range to the gap between two neighbouring candidates (half of them spaced in key space, half in
value space: `_search`). The sampler then drops every column below its row's floor as it reads the logits
(sampling.py), so no filtered copy of the logits is written either.

`filter_floors_reference` is the same floor from a sort, in torch: the CPU path and the kernel's oracle.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

PROBES = 8  # candidate keys per pass (the pass's arithmetic grows with them, and the row's read does not)
BLOCK = 512  # columns per load in a tally (its accumulators are [PROBES, BLOCK])
SCAN_BLOCK = 2048  # columns per load in the bounds and compaction passes (one compare per column)
STAGES = 4  # loads in flight in a pass over a row (tl.range's pipelining): one program's passes are latency-bound
CAPACITY = 4096  # candidates a row's scratch holds
NUCLEUS_LANES = 128  # top-p alone first tries the tokens at or above this many lanes' maxima (a hundred or two)


@triton.jit
def _order_key(x, KEY16: tl.constexpr):
    """int32 keys that order as the values x do (x in the logits' own dtype: 16-bit keys for bf16 / fp16)."""
    if KEY16:
        b = x.to(tl.int16, bitcast=True).to(tl.int32)
        return b ^ ((b >> 15) & 0x7FFF)
    else:
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key, KEY16: tl.constexpr, DTYPE: tl.constexpr):
    """The float32 value of a key of `_order_key` (its inverse, then the exact conversion to float32)."""
    if KEY16:
        b = tl.where(key < 0, key ^ 0x7FFF, key).to(tl.int16)
        return b.to(DTYPE, bitcast=True).to(tl.float32)
    else:
        b = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
        return b.to(tl.float32, bitcast=True)


@triton.jit
def _tally(src_ptr, n, probes, top, scale, MASS: tl.constexpr, KEY16: tl.constexpr, NUM_PROBES: tl.constexpr,
           BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """Per candidate key of `probes` [NUM_PROBES] int32, over the n values at src_ptr: the tempered mass
    exp2((x - top) * scale) at or above it (MASS True; else the count, as float32), and the count (int32). Columns past
    n load -inf, whose key is below every candidate (candidates lie above the row's smallest key) and whose mass is 0."""
    count = tl.zeros([NUM_PROBES, BLOCK_N], dtype=tl.int32)
    mass = tl.zeros([NUM_PROBES, BLOCK_N], dtype=tl.float32)
    for start in tl.range(0, n, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(src_ptr + cols, mask=cols < n, other=float("-inf"))  # [BLOCK_N], the logits' dtype
        above = _order_key(x, KEY16)[None, :] >= probes[:, None]  # [NUM_PROBES, BLOCK_N]
        count += above.to(tl.int32)
        if MASS:
            mass += tl.where(above, tl.exp2((x.to(tl.float32) - top) * scale)[None, :], 0.0)
    counts = tl.sum(count, axis=1)  # [NUM_PROBES]
    if MASS:
        return tl.sum(mass, axis=1), counts
    else:
        return counts.to(tl.float32), counts


@triton.jit
def _load_kept(row_ptr, start, vocab, key_lo, KEY16: tl.constexpr, SCAN_N: tl.constexpr):
    """The row's SCAN_N values from column `start` (-inf past the row) and which of them have a key of at least
    key_lo (int32)."""
    cols = start + tl.arange(0, SCAN_N)
    valid = cols < vocab
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf"))
    return x, valid & (_order_key(x, KEY16) >= key_lo)


@triton.jit
def _lane_pass(row_ptr, vocab, key_lo, skip, KEY16: tl.constexpr, SCAN_N: tl.constexpr, STAGES: tl.constexpr):
    """One pass over the row: per lane (column c is lane c % SCAN_N), how many values have a key of at least key_lo,
    and the three that come skip-th, (skip + 1)-th and (skip + 2)-th among them (0-based, in column order)."""
    per_lane = tl.zeros([SCAN_N], dtype=tl.int32)
    first = tl.zeros([SCAN_N], dtype=row_ptr.dtype.element_ty)
    second = tl.zeros([SCAN_N], dtype=row_ptr.dtype.element_ty)
    third = tl.zeros([SCAN_N], dtype=row_ptr.dtype.element_ty)
    for start in tl.range(0, vocab, SCAN_N, num_stages=STAGES):
        x, keep = _load_kept(row_ptr, start, vocab, key_lo, KEY16, SCAN_N)
        first = tl.where(keep & (per_lane == skip), x, first)
        second = tl.where(keep & (per_lane == skip + 1), x, second)
        third = tl.where(keep & (per_lane == skip + 2), x, third)
        per_lane += keep.to(tl.int32)
    return per_lane, first, second, third


@triton.jit
def _store_lanes(buf_ptr, pos, per_lane, skip, first, second, third):
    """Stores each lane's skip-th to (skip + 2)-th value at its places in the scratch."""
    tl.store(buf_ptr + pos + skip, first, mask=per_lane > skip)
    tl.store(buf_ptr + pos + skip + 1, second, mask=per_lane > skip + 1)
    tl.store(buf_ptr + pos + skip + 2, third, mask=per_lane > skip + 2)


@triton.jit
def _compact(row_ptr, vocab, buf_ptr, key_lo, CAP: tl.constexpr, KEY16: tl.constexpr, SCAN_N: tl.constexpr,
             STAGES: tl.constexpr):
    """Copies the row's values whose key is at least key_lo into buf_ptr, as far as CAP of them; returns how many the
    row has (more than CAP: nothing is copied and the scratch is not used).

    The scratch holds them lane after lane (column c is lane c % SCAN_N), each lane's in column order: a fixed order,
    so the tallies over the scratch sum in a fixed order. The first pass counts each lane's values and keeps its first
    three in registers, stored from there; a lane with more takes one more such pass per three values (up to 9 a lane),
    and beyond that one pass stores them as it reads them. No pass runs a reduction, and only that last one stores
    inside its loop: a single pass placed each load's values by a cumsum over the load, carrying the count
    from load to load, and took 107 of the kernel's 128 us at one row; a pass that stores as it reads is not pipelined
    and costs about 2.5 of the others."""
    key_lo = key_lo.to(tl.int32)  # the search carries it as int64: int64 compares would double a pass's arithmetic
    per_lane, first, second, third = _lane_pass(row_ptr, vocab, key_lo, 0, KEY16, SCAN_N, STAGES)
    n = tl.sum(per_lane, axis=0)
    if n <= CAP:
        pos = tl.cumsum(per_lane, axis=0) - per_lane  # each lane's first place in the scratch
        most = tl.max(per_lane, axis=0)
        if most <= 9:
            _store_lanes(buf_ptr, pos, per_lane, 0, first, second, third)
            for skip in tl.range(3, most, 3):
                _, first, second, third = _lane_pass(row_ptr, vocab, key_lo, skip, KEY16, SCAN_N, STAGES)
                _store_lanes(buf_ptr, pos, per_lane, skip, first, second, third)
        else:
            for start in tl.range(0, vocab, SCAN_N, num_stages=STAGES):
                x, keep = _load_kept(row_ptr, start, vocab, key_lo, KEY16, SCAN_N)
                tl.store(buf_ptr + pos, x, mask=keep)
                pos += keep.to(tl.int32)
        tl.debug_barrier()  # the scratch is read back by other threads of this program
    return n


@triton.jit
def _first_pass(row_ptr, vocab, KEY16: tl.constexpr, SCAN_N: tl.constexpr, STAGES: tl.constexpr):
    """One pass over the row -> per lane (column c is lane c % SCAN_N), [SCAN_N] int32 each: its smallest key (the
    search's lower bound, once reduced), then its four largest, in descending order. The lanes' maxima bound top-k
    from below, and where no lane's fourth reaches a bound, the lanes' three largest are all the tokens at or above it
    (_compact_lanes_or_row)."""
    key_lo = tl.full([SCAN_N], 2147483647, tl.int32)
    key_hi = tl.full([SCAN_N], -2147483648, tl.int32)
    key_2 = tl.full([SCAN_N], -2147483648, tl.int32)
    key_3 = tl.full([SCAN_N], -2147483648, tl.int32)
    key_4 = tl.full([SCAN_N], -2147483648, tl.int32)
    for start in tl.range(0, vocab, SCAN_N, num_stages=STAGES):
        cols = start + tl.arange(0, SCAN_N)
        valid = cols < vocab
        key = _order_key(tl.load(row_ptr + cols, mask=valid, other=0.0), KEY16)
        key_lo = tl.minimum(key_lo, tl.where(valid, key, 2147483647))
        key = tl.where(valid, key, -2147483648)
        # insert into key_hi >= key_2 >= key_3 >= key_4, each from the old values
        key_4 = tl.maximum(key_4, tl.minimum(key, key_3))
        key_3 = tl.maximum(key_3, tl.minimum(key, key_2))
        key_2 = tl.maximum(key_2, tl.minimum(key, key_hi))
        key_hi = tl.maximum(key_hi, key)
    return key_lo, key_hi, key_2, key_3, key_4


@triton.jit
def _compact_lanes_or_row(row_ptr, vocab, buf_ptr, key_lo, key_hi, key_2, key_3, key_4, CAP: tl.constexpr,
                          KEY16: tl.constexpr, DTYPE: tl.constexpr, SCAN_N: tl.constexpr, STAGES: tl.constexpr):
    """_compact's copy and count, from the first pass's registers where they hold every value at or above key_lo:
    `key_hi` to `key_4` [SCAN_N] are each lane's four largest keys, so where no lane's fourth reaches key_lo a lane
    has at most three such values, its largest three. Those are stored lane after lane, the largest first (a fixed
    order, as _compact's), with no pass over the row: the compaction's passes were over half the kernel at few rows
   . Else _compact reads the row."""
    key_lo = key_lo.to(tl.int32)
    if tl.max(key_4, axis=0) < key_lo:
        in_1 = key_hi >= key_lo
        in_2 = key_2 >= key_lo
        in_3 = key_3 >= key_lo
        per_lane = in_1.to(tl.int32) + in_2.to(tl.int32) + in_3.to(tl.int32)
        n = tl.sum(per_lane, axis=0)
        if n <= CAP:
            pos = tl.cumsum(per_lane, axis=0) - per_lane
            # the keys descend within a lane, so its first per_lane of them are the ones at or above key_lo
            _store_lanes(buf_ptr, pos, per_lane, 0, _key_value(key_hi, KEY16, DTYPE).to(DTYPE),
                         _key_value(key_2, KEY16, DTYPE).to(DTYPE), _key_value(key_3, KEY16, DTYPE).to(DTYPE))
            tl.debug_barrier()  # the scratch is read back by other threads of this program
    else:
        n = _compact(row_ptr, vocab, buf_ptr, key_lo, CAP, KEY16, SCAN_N, STAGES)
    return n


@triton.jit
def _search(row_ptr, vocab, buf_ptr, in_buf, n_buf, lo, hi, n_lo, target, top, scale, MASS: tl.constexpr,
            KEY16: tl.constexpr, DTYPE: tl.constexpr, NUM_PROBES: tl.constexpr, BLOCK_N: tl.constexpr,
            SCAN_N: tl.constexpr, CAP: tl.constexpr, STAGES: tl.constexpr):
    """The largest key K with lo <= K < hi whose tally reaches `target`, given that lo's does and hi's does not (the
    tally only falls as the key rises). K is then a key of the row (the tally changes only at the row's keys). The
    tallies read the row's scratch where `in_buf` (it holds every value at or above lo, n_buf of them), else the whole
    row; once the values at or above lo (n_lo) fit the scratch, they are copied there and later passes read only them.
    Returns (K, the count at or above K, in_buf, n_buf).

    Half the candidates are spaced evenly in key space (so every pass shrinks the range at least NUM_PROBES / 2 times;
    the first is lo + 1, so every pass makes progress), half evenly in value space: keys are logarithmic in the value,
    so a wide key range spends most of its keys on magnitudes no logit has, and the value-spaced candidates bracket
    the floor among the values the row does have in far fewer passes."""
    j = tl.arange(0, NUM_PROBES)
    while hi - lo > 1:
        by_key = lo + 1 + ((hi - lo - 1) * j.to(tl.int64)) // NUM_PROBES  # [NUM_PROBES] int64
        v_lo = _key_value(lo, KEY16, DTYPE)
        v_hi = _key_value(hi - 1, KEY16, DTYPE)
        values = v_lo + (v_hi - v_lo) * ((j + 1).to(tl.float32) / (NUM_PROBES + 1))  # NaN where v_lo is -inf
        by_value = _order_key(values.to(DTYPE), KEY16).to(tl.int64)
        by_value = tl.where(values == values, tl.minimum(tl.maximum(by_value, lo + 1), hi - 1), by_key)
        probes = tl.where(j % 2 == 0, by_key, by_value)
        if in_buf != 0:
            tally, count = _tally(buf_ptr, n_buf, probes.to(tl.int32), top, scale, MASS, KEY16, NUM_PROBES, BLOCK_N,
                                  STAGES)
        else:
            tally, count = _tally(row_ptr, vocab, probes.to(tl.int32), top, scale, MASS, KEY16, NUM_PROBES, BLOCK_N,
                                  STAGES)
        ok = tally >= target
        lo = tl.max(tl.where(ok, probes, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, probes), axis=0)
        n_lo = tl.min(tl.where(ok, count, n_lo), axis=0)
        if (in_buf == 0) & (n_lo <= CAP) & (hi - lo > 1):
            n_buf = _compact(row_ptr, vocab, buf_ptr, lo, CAP, KEY16, SCAN_N, STAGES)
            in_buf = 1
    return lo, n_lo, in_buf, n_buf


@triton.jit
def _kth_largest(keys, k, lo, hi):
    """The largest K with lo <= K < hi and at least k of `keys` at or above it (lo if none above lo qualifies)."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = tl.sum((keys >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _filter_floor_kernel(
    logits_ptr,  # [num_rows, vocab] bf16 / fp16 / fp32
    temps_ptr,  # [num_rows] fp32, 0 = greedy
    top_k_ptr,  # [num_rows] int64, vocab where off
    top_p_ptr,  # [num_rows] fp32, 1 where off
    min_p_ptr,  # [num_rows] fp32, 0 where off
    floor_ptr,  # [num_rows] fp32 out: keep x >= floor
    scratch_ptr,  # [num_rows, CAP], the logits' dtype: each row's candidates
    stride_row,
    vocab,
    KEY16: tl.constexpr,
    NUM_PROBES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN_N: tl.constexpr,
    CAP: tl.constexpr,
    STAGES: tl.constexpr,
    NUCLEUS_LANES: tl.constexpr,
):
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row)
    floor = float("-inf")
    if temp > 0:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        buf_ptr = scratch_ptr + row.to(tl.int64) * CAP
        scale = 1.4426950408889634 / temp  # exp2((x - top) * scale) = exp((x - top) / T)
        key_lo, key_hi, key_2, key_3, key_4 = _first_pass(row_ptr, vocab, KEY16, SCAN_N, STAGES)
        lo = tl.min(key_lo, axis=0).to(tl.int64)  # every token is at or above it
        hi = tl.max(key_hi, axis=0).to(tl.int64) + 1  # none is
        n_lo = vocab + tl.sum(tl.zeros([SCAN_N], dtype=tl.int32), axis=0)  # tokens at or above lo
        in_buf = tl.sum(tl.zeros([SCAN_N], dtype=tl.int32), axis=0)
        n_buf = in_buf
        dtype = logits_ptr.dtype.element_ty
        top = _key_value(hi - 1, KEY16, dtype)  # the row's largest logit
        # Off is a value, not a variant (top_k = vocab, top_p = 1, min_p = 0): one compiled kernel per key width
        k = tl.load(top_k_ptr + row)
        if k < vocab:
            # the k-th largest of the lanes' maxima: k distinct tokens are at or above it, so top-k's floor is too,
            # and few others are (a few dozen for Qwen3's top_k 20): the search then reads only those
            lo = _kth_largest(key_hi, k, lo, hi)
            n_lo = _compact_lanes_or_row(row_ptr, vocab, buf_ptr, lo, key_hi, key_2, key_3, key_4, CAP, KEY16,
                                         dtype, SCAN_N, STAGES)
            n_buf = n_lo
            in_buf = (n_lo <= CAP).to(tl.int32)
            lo, n_lo, in_buf, n_buf = _search(row_ptr, vocab, buf_ptr, in_buf, n_buf, lo, hi, n_lo, k.to(tl.float32),
                                              top, scale, False, KEY16, dtype, NUM_PROBES, BLOCK_N, SCAN_N, CAP,
                                              STAGES)
        p = tl.load(top_p_ptr + row)
        if p < 1.0:
            at_lo = tl.full([1], 0, tl.int32) + lo.to(tl.int32)
            if in_buf != 0:
                kept, _ = _tally(buf_ptr, n_buf, at_lo, top, scale, True, KEY16, 1, BLOCK_N, STAGES)
            else:
                kept, _ = _tally(row_ptr, vocab, at_lo, top, scale, True, KEY16, 1, BLOCK_N, STAGES)
            kept_mass = tl.max(kept, axis=0)
            target = p * kept_mass
            if in_buf == 0:
                # First the NUCLEUS_LANES-th largest lane maximum: the usual nucleus lies above it, and so do few
                # tokens. It bounds the floor if the tokens at or above it hold the nucleus's mass.
                bound = _kth_largest(key_hi, NUCLEUS_LANES, lo, hi)
                if bound > lo:
                    n_bound = _compact_lanes_or_row(row_ptr, vocab, buf_ptr, bound, key_hi, key_2, key_3, key_4, CAP,
                                                    KEY16, dtype, SCAN_N, STAGES)
                    if n_bound <= CAP:
                        at_bound = tl.full([1], 0, tl.int32) + bound.to(tl.int32)
                        held, _ = _tally(buf_ptr, n_bound, at_bound, top, scale, True, KEY16, 1, BLOCK_N, STAGES)
                        if tl.max(held, axis=0) >= target:
                            lo = bound
                            n_lo = n_bound
                            n_buf = n_bound
                            in_buf = 1
            if in_buf == 0:
                # the tokens below top + T (ln((1 - p) kept_mass / vocab) - 0.05) hold less than (1 - p) of the kept
                # mass, so the nucleus lies at or above it (the 0.05 covers rounding)
                t = top + temp * (tl.log((1.0 - p) * kept_mass / vocab) - 0.05)
                bound = tl.minimum(tl.maximum(_order_key(t.to(dtype), KEY16).to(tl.int64) - 1, lo), hi - 1)
                if bound > lo:
                    lo = bound
                    n_lo = _compact_lanes_or_row(row_ptr, vocab, buf_ptr, lo, key_hi, key_2, key_3, key_4, CAP,
                                                 KEY16, dtype, SCAN_N, STAGES)
                    n_buf = n_lo
                    in_buf = (n_lo <= CAP).to(tl.int32)
            lo, n_lo, in_buf, n_buf = _search(row_ptr, vocab, buf_ptr, in_buf, n_buf, lo, hi, n_lo, target,
                                              top, scale, True, KEY16, dtype, NUM_PROBES, BLOCK_N, SCAN_N, CAP,
                                              STAGES)
        floor = _key_value(lo, KEY16, dtype)
        min_p = tl.load(min_p_ptr + row)
        if min_p > 0:  # p_i >= min_p * p_max  <=>  x_i >= top + T * ln(min_p)
            floor = tl.maximum(floor, top + temp * tl.log(min_p))
    tl.store(floor_ptr + row, floor)


def filter_floors_triton(
    logits: torch.Tensor,  # [num_rows, vocab], last dim contiguous
    temperatures: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    top_k: torch.Tensor | None,  # [num_rows] int64, vocab where off
    top_p: torch.Tensor | None,  # [num_rows] fp32, 1 where off
    min_p: torch.Tensor | None,  # [num_rows] fp32, 0 where off
    capacity: int = CAPACITY,  # candidates per row's scratch (a power of 2; the tests make it small)
    scan: int = SCAN_BLOCK,  # columns per load, and lanes (a power of 2)
    stages: int = STAGES,
    warps: int = 8,
) -> torch.Tensor:  # [num_rows] fp32
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert scan > 0 and scan & (scan - 1) == 0, f"scan={scan}: columns per load must be a power of two"
    floors = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return floors
    dev = logits.device
    _filter_floor_kernel[(rows,)](
        logits, temperatures,
        torch.full((rows,), vocab, dtype=torch.int64, device=dev) if top_k is None else top_k,
        torch.ones(rows, dtype=torch.float32, device=dev) if top_p is None else top_p,
        torch.zeros(rows, dtype=torch.float32, device=dev) if min_p is None else min_p,
        floors, torch.empty(rows, capacity, dtype=logits.dtype, device=dev), logits.stride(0), vocab,
        KEY16=logits.element_size() == 2, NUM_PROBES=PROBES, BLOCK_N=BLOCK, SCAN_N=scan, CAP=capacity,
        STAGES=stages, NUCLEUS_LANES=NUCLEUS_LANES,
        num_warps=warps,
    )
    return floors


def filter_floors_reference(
    logits: torch.Tensor,  # [num_rows, vocab]
    temperatures: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:  # [num_rows] fp32
    """The floors of `_filter_floor_kernel`, from a sort of each row."""
    x = logits.float()  # [num_rows, vocab]
    rows, vocab = x.shape
    sampled = temperatures > 0
    temps = torch.where(sampled, temperatures, torch.ones_like(temperatures)).unsqueeze(1)  # [num_rows, 1]
    desc = x.sort(dim=-1, descending=True).values  # [num_rows, vocab]
    floor = desc[:, -1]  # keep all
    if top_k is not None:
        floor = desc.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1)).squeeze(1)  # the k-th largest
    if top_p is not None:
        kept = desc >= floor.unsqueeze(1)  # the top-k set, its ties included
        probs = torch.softmax((desc / temps).masked_fill(~kept, -math.inf), dim=-1)
        reached = probs.cumsum(dim=-1) >= top_p.unsqueeze(1)  # the first position where the mass reaches top_p
        first = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1), kept.sum(dim=-1) - 1)
        nucleus = desc.gather(1, first.unsqueeze(1)).squeeze(1)
        floor = torch.where(top_p < 1.0, torch.maximum(floor, nucleus), floor)
    if min_p is not None:
        share = desc[:, 0] + temps.squeeze(1) * torch.log(min_p)  # log(0) = -inf: off
        floor = torch.maximum(floor, share)
    return torch.where(sampled, floor, torch.full_like(floor, -math.inf))
