"""Bandwidth-bound GEMM for small batches in Triton: y = x @ weight.T (+ bias) with M <= 16.

At decode with a handful of sequences a linear layer is a matrix-vector product: the time
is the time to stream the weight ([N, K], nn.Linear layout) from HBM once. Each program
owns BLOCK_N output columns (= weight rows) and walks K in BLOCK_K chunks; every weight
tile is one ~16 KiB read of BLOCK_N contiguous row segments (16-byte vector loads); the
few x rows are re-read per tile from L1/L2 (they are tiny); accumulation is fp32.

Two inner products, picked per config:

* FMA (M <= 2, and the one-pass tiles up to 4 rows): the weight tile times the broadcast x
  rows on the CUDA cores, accumulated element-wise over K and reduced across K once at the
  end. Tall-thin tiles (few rows, long K) give enough programs to fill the SMs without
  splitting K. The loop carries a
  `tl.range(num_stages=...)` attribute because Triton only software-pipelines loads of a
  dot-free loop when asked.
* DOT (the other tiles of M > 2): `tl.dot(w_tile, x_tile.T)` on the tensor cores with x
  padded to 16 rows (masked, so the padding is never read); the weight is the A operand ("swap AB"), so
  BLOCK_N = 64 maps to one 64-row MMA and the acc is [BLOCK_N, 16].

When there are too few column blocks to fill the GPU (o_proj / down_proj: N = hidden),
K is split across programs: each writes an fp32 partial [SPLIT_K, M, N], counts its arrival
on its output tile's counter, and the last split to arrive sums the partials in split order,
adds the bias and casts (deterministic: the order does not depend on who arrives last), so a split
needs no second kernel.

Launched with PDL (see pdl.py), a program prefetches its whole weight share into L2 before
`griddepcontrol.wait` (weights of at most 24 MiB: every decoder layer, not an LM head), so the
weight streams from HBM while the previous kernel of the chain finishes. For up to four rows, a
decoder layer's GEMM goes further (`_one_pass_config`): each program takes whole weight rows, all of K in
one step, and loads them into registers before the wait; once the previous kernel ends, only x's
loads, the FMAs and the store are left. That took one request from 1.03 to 0.80 ms per token on
the H100 (benchmarks/RESULTS.md).

Past MAX_M rows cuBLAS takes every GEMM: on the H100 tensor-core Triton tiles of 32-256 rows lost to it,
alone (`benchmarks/skinny_gemm.py --mid`) and in the real decode chain under PDL with every tile shape tried
(benchmarks/RESULTS.md).

CUDA-graph safety: the config is a pure function of (M, N, K, element size, SM count),
cached on the host; no autotuning, no host syncs, the only allocations are the output and
(for split K) the fp32 partials, both from the caching allocator. M is not specialised,
so one compile per (config, K) serves every batch size that maps to it.

Entry points: `linear(x, weight, bias)` is F.linear that takes this kernel when
`use_skinny(x, weight)` (CUDA, bf16/fp16, 1..MAX_M rows, K % 16 == 0, row-major weight).
The configs `choose_config` gives decoder layers at 1-16 rows were picked end to end
(configs swapped into the real decode chain); the rest were written
from first principles, and `benchmarks/skinny_gemm.py --sweep` times alternatives in isolation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nvcli.kernels.arrival_counters import arrival_counters
from nvcli.kernels.pdl import launch_kwargs, prefetch_l2, use_pdl

# use_skinny's bound: up to here one row block, the fused add+RMSNorm and SiLU-and-mul prologues and PDL (decode
# of a few sequences); past it cuBLAS
MAX_M = 16
FMA_MAX_M = 2  # M above this uses the tensor-core (DOT) inner product
TILE_BYTES = 16384  # weight bytes per program per loop iteration
# use_skinny's bound on the weight: every decoder layer of a small model (Qwen3-0.6B's largest, gate_up, is 12 MiB).
# Larger weights (an 8B's layers, every LM head) go to cuBLAS, which streams them at 1.2-2.8 TB/s from 1 to 16 rows
# on the H100 where these tiles made 0.04-1.5 (Qwen3-8B's gate_up at 1 row: 5.4 ms against 83 us,
# benchmarks/RESULTS.md). Up to it a few rows take the whole K in one step (_one_pass_config), the tensor-core tiles
# 64 x 256 weight tiles, and the weight is prefetched into L2.
ONE_PASS_MAX_BYTES = 24 << 20
# rows up to which the one-pass tiles replace the tensor-core ones: each further row costs its own cross-warp
# reduction, and at 8 rows the tensor-core tiles win
ONE_PASS_MAX_M = 4
ONE_PASS_ELEMS = 16384  # longest K step (elements) of a one-pass tile: 64 fp32 per thread at 8 warps


@triton.jit
def _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, mask, K: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
            HAS_RES: tl.constexpr):
    """An x tile. SILU_MUL: x is the [M, 2K] gate_up output and the tile is SiLU(gate) * up, rounded as
    the separate SiLU-and-mul kernel (activation.py) stores it. NORM: the tile is RMSNorm(x + residual)
    with the row's `rstd`, rounded as the separate add+RMSNorm kernel (rms_norm.py) stores it."""
    if mask is None:
        gate = tl.load(x_ptrs)
    else:
        gate = tl.load(x_ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        if mask is None:
            up = tl.load(x_ptrs + K)
        else:
            up = tl.load(x_ptrs + K, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        gate = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    if NORM:
        if HAS_RES:
            if mask is None:
                r = tl.load(r_ptrs)
            else:
                r = tl.load(r_ptrs, mask=mask, other=0.0)
            gate = (gate.to(tl.float32) + r.to(tl.float32)).to(gate.dtype)
        if mask is None:
            nw = tl.load(nw_ptrs)
        else:
            nw = tl.load(nw_ptrs, mask=mask, other=0.0)
        normed = (gate.to(tl.float32) * rstd[:, None]).to(gate.dtype).to(tl.float32)
        gate = (normed * nw.to(tl.float32)).to(gate.dtype)
    return gate


@triton.jit
def _load_tiles(w_ptrs, x_ptrs, r_ptrs, nw_ptrs, rstd, m_ok, k_cols, K: tl.constexpr, EVEN_K: tl.constexpr,
                SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The weight tile and the x tile of one K step; `k_cols` [BLOCK_K] are the step's K indices (masked
    against K unless EVEN_K), `m_ok` the row mask or None (one row: nothing to mask)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        x = _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, m_ok, K, SILU_MUL, NORM, HAS_RES)
    else:
        k_ok = k_cols[None, :] < K
        w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        x_ok = k_ok if m_ok is None else m_ok & k_ok
        x = _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, x_ok, K, SILU_MUL, NORM, HAS_RES)
    return w, x


@triton.jit
def _row_rstd(x_ptr, r_ptr, new_r_ptr, stride_xm, stride_rm, offs_m, m_ok, eps, write_res,
              K: tl.constexpr, NORM_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_RES: tl.constexpr):
    """1 / RMS of each row of x (+ residual) over all K columns, NORM_BLOCK columns per load (all of
    them for one row: each round trip to L2 is latency every program of a one-token step waits for);
    the program with `write_res` also stores x + residual (the layer's new residual, [M, K] contiguous)."""
    offs = tl.arange(0, NORM_BLOCK)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kk in tl.static_range(0, K, NORM_BLOCK):
        cols = kk + offs
        mask = m_ok & (cols[None, :] < K)
        xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:
            rv = tl.load(r_ptr + offs_m[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
            if write_res:
                tl.store(new_r_ptr + offs_m[:, None] * K + cols[None, :], xv, mask=mask)
        xf = xv.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit(do_not_specialize=["M"])  # one compile serves every batch size of a config
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    r_ptr,  # [M, K] residual added to x before the norm (NORM and HAS_RES)
    nw_ptr,  # [K] RMSNorm weight (NORM)
    new_r_ptr,  # [M, K] x + residual, written by program (0, 0) (NORM and HAS_RES)
    eps,
    stride_rm,
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x.dtype (SPLIT_K == 1) or fp32 partials [SPLIT_K, M, N]
    fin_ptr,  # [M, N] in x.dtype: the sum of the partials (SPLIT_K > 1)
    cnt_ptr,  # [column blocks] int32 arrival counters, zero between calls (SPLIT_K > 1)
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements per program, a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: the last split of each output tile sums the partials into fin_ptr
    EVEN_K: tl.constexpr,  # SPLIT_K * K_SPLIT == K: no K masks
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot (no tf32)
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x is [M, 2K] gate_up: multiply by SiLU(gate) * up (fused activation)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see pdl.py)
    PREFETCH: tl.constexpr,  # PDL, CUDA-core tiles, even K or no split: load the first weight tile before waiting
    K_START: tl.constexpr,  # BLOCK_K with PREFETCH (the peeled first iteration), else 0
    NORM: tl.constexpr,  # x is pre-norm: the GEMM input is RMSNorm(x + residual) (fused add+RMSNorm)
    HAS_RES: tl.constexpr,
    L2_LINES: tl.constexpr,  # PDL: prefetch L2_LINES 128-byte lines per weight row before waiting (0: none)
    LINE_ELEMS: tl.constexpr,  # weight elements per 128-byte line
    NORM_BLOCK: tl.constexpr,  # NORM: columns per load of the row pass that computes the RMS
    ROW_LOOP: tl.constexpr,  # CUDA cores, several rows, one K step, no split: one row at a time (see below)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)  # every row in one block (M <= BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamp instead of masking: unmasked 16-byte loads
    k0 = pid_k * K_SPLIT
    if PDL:
        gdc_launch_dependents()
        if L2_LINES > 0:  # the weights do not depend on the previous kernel
            cols = tl.minimum(k0 + tl.arange(0, L2_LINES) * LINE_ELEMS, K - 1)
            prefetch_l2(w_ptr + rows[:, None] * stride_wn + cols[None, :])
        if not PREFETCH:
            gdc_wait()
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    r_ptrs = r_ptr + offs_m[:, None] * stride_rm + (k0 + offs_k)[None, :]
    nw_ptrs = nw_ptr + (k0 + offs_k)[None, :]
    m_ok = offs_m[:, None] < M
    if PREFETCH or ROW_LOOP:  # PREFETCH: the weights do not depend on the previous kernel, stream them while
        if EVEN_K:  # it finishes; the row loop's one K step is this tile, with or without PDL
            w_first = tl.load(w_ptrs)
        else:
            w_first = tl.load(w_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
    if PREFETCH:
        gdc_wait()
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        rstd = _row_rstd(x_ptr, r_ptr, new_r_ptr, stride_xm, stride_rm, offs_m, m_ok, eps,
                         (pid_n == 0) & (pid_k == 0), K, NORM_BLOCK, BLOCK_M, HAS_RES)

    if PREFETCH and BLOCK_M > 1:  # the rows' x mask of the peeled first iteration (the 3-D product below)
        if EVEN_K:
            x_first_mask = m_ok
        else:
            x_first_mask = m_ok & ((k0 + offs_k)[None, :] < K)
    if ROW_LOOP:
        # One K step, several rows: the weight tile stays in registers and each row's products come
        # straight from it, one row after another, each reduced on its own. A 3-D [rows, BLOCK_N,
        # BLOCK_K] product (below) costs layout shuffles and registers per row.
        wf = w_first.to(tl.float32)  # [BLOCK_N, BLOCK_K]
        k_ok = (k0 + offs_k)[None, :] < K
        y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for row in tl.static_range(BLOCK_M):
            rstd_r = tl.zeros([1], dtype=tl.float32) + tl.sum(tl.where(offs_m == row, rstd, 0.0), axis=0)
            xr_ptrs = x_ptr + row * stride_xm + (k0 + offs_k)[None, :]
            rr_ptrs = r_ptr + row * stride_rm + (k0 + offs_k)[None, :]
            # a row past M reads nothing; a select, not `(row < M) & k_ok`: Triton 3.9's interpreter broadcasts that
            # scalar comparison as int32 data, which its masked loads reject
            xr = _load_x(xr_ptrs, rr_ptrs, nw_ptrs, rstd_r, tl.where(row < M, k_ok, False), K, SILU_MUL, NORM, HAS_RES)
            yr = tl.sum(wf * xr.to(tl.float32), axis=1)  # [BLOCK_N]
            # kept in registers and stored once below: a store between two rows' x loads would keep them
            # apart (they might alias), one L2 round trip per row
            y = tl.where(offs_m[:, None] == row, yr[None, :], y)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(0, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            w, x = _load_tiles(w_ptrs, x_ptrs, r_ptrs, nw_ptrs, rstd, m_ok, k0 + k + offs_k, K, EVEN_K, SILU_MUL,
                               NORM, HAS_RES)
            if IEEE:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PREFETCH:  # the peeled first iteration, on the tile loaded before the wait
            if EVEN_K:
                x = _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, None, K, SILU_MUL, NORM, HAS_RES)
            else:
                x = _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, (k0 + offs_k)[None, :] < K, K, SILU_MUL, NORM, HAS_RES)
            acc2 += w_first.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        for k in tl.range(K_START, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            w, x = _load_tiles(w_ptrs, x_ptrs, r_ptrs, nw_ptrs, rstd, None, k0 + k + offs_k, K, EVEN_K, SILU_MUL,
                               NORM, HAS_RES)
            acc2 += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        y = tl.sum(acc2, axis=1)[None, :]
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PREFETCH:  # the peeled first iteration, on the tile loaded before the wait
            x = _load_x(x_ptrs, r_ptrs, nw_ptrs, rstd, x_first_mask, K, SILU_MUL, NORM, HAS_RES)
            acc3 += x.to(tl.float32)[:, None, :] * w_first.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        for k in tl.range(K_START, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            w, x = _load_tiles(w_ptrs, x_ptrs, r_ptrs, nw_ptrs, rstd, m_ok, k0 + k + offs_k, K, EVEN_K, SILU_MUL,
                               NORM, HAS_RES)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        y = tl.sum(acc3, axis=2)

    out_mask = m_ok & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows)[None, :].to(tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_ptrs = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, y, mask=out_mask)
        sum_splits_if_last(out_ptr, fin_ptr, b_ptr, cnt_ptr + pid_n, rows, offs_m, offs_n, out_mask, M, N, stride_om,
                           SPLIT_K, HAS_BIAS)


@triton.jit
def sum_splits_if_last(part_ptr, fin_ptr, b_ptr, cnt, rows, offs_m, offs_n, mask, M, N, stride_om,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Split K without a second kernel: after a split stored its fp32 partial of the (offs_m, offs_n) tile into
    part_ptr ([SPLIT_K, M, N]), it counts its arrival on the tile's counter `cnt`; the last split to arrive sums
    the partials (+ bias[rows]) into fin_ptr ([M, N], row stride stride_om) and resets the counter.
    acq_rel: this split's partial is visible before the count moves, and the last split sees all of them; it sums
    them in split order (the same bits whichever split arrives last); the reset serves the next call (a CUDA graph
    replays with the same counters)."""
    if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT_K - 1:
        tl.atomic_xchg(cnt, 0)
        tile_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        total = tl.load(tile_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(tile_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + rows)[None, :].to(tl.float32)
        fin_ptrs = fin_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(fin_ptrs, total.to(fin_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int = 1  # requested splits; the wrapper evens them out so that none is empty
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 1


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: pick the H100's configs
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def norm_block(k: int, block_m: int) -> int:
    """Columns per load of the fused norm's row pass: the whole row for one or two rows (K <= 4096 / rows),
    else up to 4096 values per load (registers)."""
    return min(triton.next_power_of_2(k), max(16, 4096 // block_m))


def block_m_for(m: int, use_dot: bool) -> int:
    return max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)


@lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, elt: int, sms: int) -> SkinnyConfig:
    """Config from shapes only (CUDA-graph safe, deterministic); `elt` is the weight's element size."""
    assert 1 <= m <= MAX_M, m
    if m <= ONE_PASS_MAX_M and n * k * elt <= ONE_PASS_MAX_BYTES and triton.next_power_of_2(k) <= ONE_PASS_ELEMS:
        return _one_pass_config(m, n, k, elt, sms)
    kp = max(16, triton.next_power_of_2(k))
    tile = TILE_BYTES // elt  # weight elements per program per iteration
    use_dot = m > FMA_MAX_M
    if use_dot and n * k * elt <= ONE_PASS_MAX_BYTES:
        # a decoder layer: whole 64-row MMAs over 256-wide K steps, and K split until the SMs have work
        # (8 rows 1.56 -> 1.45, 16 rows 1.72 -> 1.61 ms per step)
        block_n, min_n, num_warps = 64, 64, 4
        tile *= 2
    elif use_dot:
        # BLOCK_N >= 32 keeps the x re-reads (16 padded rows, masked) well below the weight bytes
        block_n, min_n, num_warps = 64, 32, 4
    else:
        # acc is BLOCK_M x tile fp32 values: 64 registers per thread at 4 warps per x row; one row of a
        # weight too big for the one-pass tiles (an LM head) streams faster at 8 (0.818 vs 0.827 ms/token)
        block_n, min_n, num_warps = 64, 1, 4 * block_m_for(m, False) * (2 if m == 1 else 1)
    while block_n > min_n and _cdiv(n, block_n) < sms:  # more, thinner column blocks first...
        block_n //= 2
    block_k = min(kp, max(16, tile // block_n))
    even = block_k
    while even > 64 and k % even:  # a K step that divides K: no masks, and the M=1 prefetch of the first tile
        even //= 2
    if k % even == 0:
        block_k = even
    n_blocks, k_iters = _cdiv(n, block_n), _cdiv(k, block_k)
    split = 1
    if n_blocks < sms // 2:  # ...then split K when fewer than half the SMs would have work
        split = max(1, min(k_iters, 16, _cdiv(sms, n_blocks)))
        split = _cdiv(k_iters, _cdiv(k_iters, split))
    iters = _cdiv(k_iters, split)
    num_stages = min(4 if use_dot else 3, iters)
    return SkinnyConfig(block_n, block_k, split, use_dot, num_warps, num_stages)


def _one_pass_config(m: int, n: int, k: int, elt: int, sms: int) -> SkinnyConfig:
    """A decoder layer's GEMM for up to ONE_PASS_MAX_M rows: each program takes whole weight rows (all of K in one
    masked step) and as few rows as still gives every SM a program. Under PDL the kernel loads that whole
    share before `griddepcontrol.wait`, so after the previous kernel ends only x's loads, the FMAs and the
    store remain; several rows are taken one at a time from the tile in registers (ROW_LOOP).
    ms per step against the looped tiles: 1 row 1.03 -> 0.80, 2 rows
    1.24 -> 0.98, 3-4 rows 1.51 -> 1.31; at 8 rows each row's cross-warp reduction makes it slower than the
    tensor-core tiles (2.1 vs 1.6)."""
    block_k = max(16, triton.next_power_of_2(k))
    block_n = max(1, (TILE_BYTES // elt) // block_k)
    if block_k > k:  # the masked part of the step loads nothing: twice the rows, at 8 warps (measured for
        block_n *= 2  # down_proj, K = 3072 in 4096: 0.810 vs 0.827 ms/token for 4 rows instead of 2)
    while block_n > 1 and _cdiv(n, block_n) < sms:
        block_n //= 2
    # the weight tile in fp32 at 64 values per thread (rows after the first are taken one at a time)
    num_warps = max(4, block_n * block_k // (32 * 64))
    return SkinnyConfig(block_n, block_k, 1, False, num_warps, 1)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shape/dtype/layout conditions of use_skinny, device aside."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return False
    k = weight.shape[1]
    m = x.numel() // k if k else 0
    return (
        1 <= m <= MAX_M
        and weight.numel() * weight.element_size() <= ONE_PASS_MAX_BYTES
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and k % 16 == 0
        and weight.stride(1) == 1
        and weight.stride(0) % 16 == 0
        and x.stride(-1) == 1
    )


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear_triton should replace F.linear(x, weight, bias) for this call."""
    return x.is_cuda and skinny_supported(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through skinny_linear_triton when use_skinny(x, weight)."""
    if use_skinny(x, weight):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(SiLU(gate) * up, weight, bias) for gate_up = [..., 2K]: one fused kernel for a few rows,
    else the SiLU-and-mul kernel and then cuBLAS."""
    k = gate_up.shape[-1] // 2
    x = gate_up[..., :k]  # the gate half: the shape and strides the kernel's x pointers walk
    if use_skinny(x, weight) and gate_up.stride(-1) == 1:
        return skinny_linear_triton(x, weight, bias, silu_mul=True)
    from nvcli.kernels.activation import silu_and_mul_triton

    return F.linear(silu_and_mul_triton(gate_up.reshape(-1, 2 * k)).view(*gate_up.shape[:-1], k), weight, bias)


def norm_linear(
    x: torch.Tensor,  # [rows, K] hidden states before the norm
    residual: Optional[torch.Tensor],  # [rows, K] or None (first layer: no add)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(RMSNorm(x + residual), weight, bias), x + residual): for a few rows one kernel, the norm
    computed in the GEMM's prologue; otherwise the add+RMSNorm kernel and then the GEMM."""
    if x.dim() == 2 and use_skinny(x, weight) and (residual is None or residual.stride(-1) == 1):
        new_residual = torch.empty_like(x) if residual is not None else x
        y = skinny_linear_triton(x, weight, bias, norm_weight=norm_weight, residual=residual, eps=eps,
                                 new_residual=new_residual)
        return y, new_residual
    from nvcli.kernels.rms_norm import rms_norm_triton

    normed, new_residual = rms_norm_triton(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), new_residual


def skinny_linear_triton(
    x: torch.Tensor,  # [..., K], at most MAX_M rows in all
    weight: torch.Tensor,  # [N, K], row-major
    bias: Optional[torch.Tensor] = None,  # [N]
    *,
    config: Optional[SkinnyConfig] = None,  # overrides choose_config (tests, benchmarks)
    silu_mul: bool = False,  # x is the gate half of a [..., 2K] gate_up row: use SiLU(gate) * up as x
    norm_weight: Optional[torch.Tensor] = None,  # [K]: use RMSNorm(x + residual) as x (fused add+norm)
    residual: Optional[torch.Tensor] = None,  # [M, K], with norm_weight; None: no add
    eps: float = 1e-6,
    new_residual: Optional[torch.Tensor] = None,  # [M, K] contiguous: receives x + residual
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [..., N] in x.dtype, fp32 accumulation."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.dim() == 2 and weight.shape[1] == k, (tuple(x.shape), tuple(weight.shape))
    assert weight.dtype == x.dtype and weight.stride(1) == 1, "weight: x's dtype, rows contiguous"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    x2 = x.reshape(-1, k)  # a view for a row slice of gate_up (rows stride 2K): the up half stays reachable
    if x2.stride(-1) != 1:
        assert not silu_mul, "gate_up must have contiguous rows"
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        if m and n:
            out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        return out.view(*x.shape[:-1], n)
    assert m <= MAX_M, f"M={m}: the skinny GEMM takes at most {MAX_M} rows"
    cfg = config or choose_config(m, n, k, weight.element_size(), num_sms(x.device))
    block_m = block_m_for(m, cfg.use_dot)
    if cfg.use_dot:
        assert cfg.block_n >= 16 and cfg.block_k >= 16, "tl.dot needs 16x16 tiles"
    k_iters = _cdiv(k, cfg.block_k)
    iters = _cdiv(k_iters, max(1, min(cfg.split_k, k_iters)))
    split = _cdiv(k_iters, iters)
    k_split = iters * cfg.block_k
    has_bias = bias is not None
    pdl = use_pdl(x, m)
    even_k = split * k_split == k
    line_elems = 128 // weight.element_size()
    # L2 prefetch only where the whole weight fits in L2 with room to spare (every decoder layer; not an
    # LM head, whose programs would evict each other's lines)
    l2_lines = 0
    if pdl and weight.numel() * weight.element_size() <= ONE_PASS_MAX_BYTES:
        l2_lines = triton.next_power_of_2(_cdiv(min(k_split, k), line_elems))
    row_loop = not cfg.use_dot and block_m > 1 and split == 1 and k_iters == 1
    # the tensor-core tiles of 3-16 rows load nothing before the wait: measured neutral there
    prefetch = pdl and (even_k or split == 1) and not cfg.use_dot
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    norm = norm_weight is not None
    has_res = norm and residual is not None
    if norm:
        assert not silu_mul and norm_weight.shape == (k,) and norm_weight.is_contiguous()
        if has_res:
            assert residual.shape == x2.shape and residual.stride(-1) == 1
            assert new_residual is not None and new_residual.shape == x2.shape and new_residual.is_contiguous()
    grid = (_cdiv(n, cfg.block_n), split)
    _skinny_gemm_kernel[grid](
        x2,
        residual if has_res else x2,
        norm_weight if norm else weight,
        new_residual if has_res else x2,
        eps,
        residual.stride(0) if has_res else 0,
        weight,
        bias if has_bias else weight,
        dst,
        out,
        arrival_counters(x.device, grid[0]) if split > 1 else out,
        m,
        n,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        K=k,
        K_SPLIT=k_split,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        EVEN_K=even_k,
        USE_DOT=cfg.use_dot,
        IEEE=x.dtype == torch.float32,
        HAS_BIAS=has_bias,
        NUM_STAGES=cfg.num_stages,
        SILU_MUL=silu_mul,
        PDL=pdl,
        PREFETCH=prefetch,
        K_START=cfg.block_k if prefetch else 0,
        NORM=norm,
        HAS_RES=has_res,
        L2_LINES=l2_lines,
        LINE_ELEMS=line_elems,
        NORM_BLOCK=norm_block(k, block_m) if norm else 0,
        ROW_LOOP=row_loop,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_kwargs(pdl),
    )
    return out.view(*x.shape[:-1], n)
