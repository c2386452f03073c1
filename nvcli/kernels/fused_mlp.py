"""A decoder layer's whole MLP for one token in one launch: down(SiLU(gate) * up) of RMSNorm(x + residual).

Decoding one sequence runs five kernels per layer, each streaming a few MB of weights in a few
microseconds, and every kernel boundary costs the chain a drain and a ramp even with PDL (the
next kernel may not read what the previous one wrote before that one has finished as a whole).
This kernel runs the MLP's two GEMVs in one persistent grid of one program per SM, with a grid
barrier between them instead of a boundary:

  prologue  every program: 1 / RMS of x + residual over the whole row (program 0 stores the new
            residual); before `griddepcontrol.wait` each program prefetches its weight rows of
            both phases into L2, so they stream from HBM while the previous kernel finishes
  phase 1   gate and up rows in blocks of BLOCK_R, blocks dealt round-robin to the programs:
            h = SiLU(gate) * up, rounded as the unfused kernels round, into a scratch row
  barrier   an arrival counter and a generation flag in global memory (acq_rel atomics): the last
            program to arrive resets the counter and bumps the flag, the others spin on the flag.
            Every program must be resident at once, so the grid is at most one program per SM
  phase 2   down rows in blocks of BLOCK_N, reading h from L2 (`.cg`: other SMs wrote it)

Only for one row (one sequence decoding), where the boundaries are the time; the counters stay
zeroed between launches, so CUDA graphs replay it.

Measured on the H100, it loses, so it is off by default (NV_FUSED_MLP=1 turns it on):
`benchmarks/fused_mlp.py` (28 layers in a CUDA graph) gives 16.2 us per layer at its best config
against 13.7 us for the two PDL-chained kernels (weight floor 6.3 us), and one request decoded
1.234 ms per token with it against 1.033 without. One program per SM (all must be resident for
the barrier) keeps too few loads in flight to stream the weights, and the barrier's spin costs
about what the kernel boundary did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nvcli.kernels.pdl import L2_PREFETCH, launch_kwargs, prefetch_l2, use_pdl
from nvcli.kernels.skinny_gemm import num_sms

ENABLED = os.environ.get("NV_FUSED_MLP", "0") == "1"
_barriers: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def _grid_barrier(sync_ptr, num_programs):
    """Every program of the grid waits here until all have arrived; stores before it are visible after it.
    sync_ptr: int32 [2] = (arrivals, generation), arrivals zero between barriers."""
    tl.debug_barrier()  # every thread's stores of this program are issued before its arrival
    gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")  # read before arriving: the last arrival bumps it
    if tl.atomic_add(sync_ptr, 1, sem="acq_rel") == num_programs - 1:
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def _fused_mlp_kernel(
    x_ptr,  # [H] hidden state before the norm
    r_ptr,  # [H] residual (HAS_RES)
    nw_ptr,  # [H] RMSNorm weight
    new_r_ptr,  # [H] x + residual, stored by program 0 (HAS_RES)
    eps,
    w_gu_ptr,  # [2 * N_INTER, H]: gate rows, then up rows
    w_down_ptr,  # [H, N_INTER]
    h_ptr,  # [N_INTER] scratch: SiLU(gate) * up
    out_ptr,  # [H]
    sync_ptr,  # int32 [2], zero / any
    N_INTER,
    H: tl.constexpr,
    H_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,  # gate (and as many up) rows per phase-1 block
    BLOCK_K1: tl.constexpr,  # phase-1 K step (over H)
    BLOCK_N: tl.constexpr,  # down rows per phase-2 block
    BLOCK_K2: tl.constexpr,  # phase-2 K step (over N_INTER)
    EVEN_K1: tl.constexpr,  # H % BLOCK_K1 == 0
    EVEN_K2: tl.constexpr,  # N_INTER % BLOCK_K2 == 0
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,  # PDL: prefetch the weight rows of both phases into L2 before waiting
    LINE_ELEMS: tl.constexpr,  # weight elements per 128-byte line
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks1 = tl.cdiv(N_INTER, BLOCK_R)
    num_blocks2 = tl.cdiv(H, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
        if PREFETCH:  # the weights do not depend on the previous kernel
            lines1 = tl.arange(0, H_POW2 // LINE_ELEMS) * LINE_ELEMS
            for blk in range(pid, num_blocks1, num_programs):
                rows = tl.minimum(blk * BLOCK_R + tl.arange(0, BLOCK_R), N_INTER - 1).to(tl.int64)
                cols = tl.minimum(lines1, H - 1)
                prefetch_l2(w_gu_ptr + rows[:, None] * H + cols[None, :])
                prefetch_l2(w_gu_ptr + (rows + N_INTER)[:, None] * H + cols[None, :])
            for blk in range(pid, num_blocks2, num_programs):
                rows = tl.minimum(blk * BLOCK_N + tl.arange(0, BLOCK_N), H - 1).to(tl.int64)
                for k in range(0, N_INTER, BLOCK_K2):
                    cols = tl.minimum(k + tl.arange(0, BLOCK_K2 // LINE_ELEMS) * LINE_ELEMS, N_INTER - 1)
                    prefetch_l2(w_down_ptr + rows[:, None] * N_INTER + cols[None, :])
        gdc_wait()

    # prologue: the row's RMS (every program), the new residual (program 0)
    offs_h = tl.arange(0, H_POW2)
    h_ok = offs_h < H
    xv = tl.load(x_ptr + offs_h, mask=h_ok, other=0.0)
    if HAS_RES:
        rv = tl.load(r_ptr + offs_h, mask=h_ok, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
        if pid == 0:
            tl.store(new_r_ptr + offs_h, xv, mask=h_ok)
    xf = xv.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)

    # phase 1: h = SiLU(x_n @ gate.T) * (x_n @ up.T), x_n = RMSNorm(x + residual)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k1 = tl.arange(0, BLOCK_K1)
    for blk in range(pid, num_blocks1, num_programs):
        rows = blk * BLOCK_R + offs_r
        rows_c = tl.minimum(rows, N_INTER - 1).to(tl.int64)  # clamped: unmasked weight loads
        acc_g = tl.zeros((BLOCK_R, BLOCK_K1), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_K1), dtype=tl.float32)
        for k in tl.range(0, H, BLOCK_K1, num_stages=2):
            cols = k + offs_k1
            if EVEN_K1:
                xk = tl.load(x_ptr + cols)
                if HAS_RES:
                    xk = (xk.to(tl.float32) + tl.load(r_ptr + cols).to(tl.float32)).to(xk.dtype)
                nw = tl.load(nw_ptr + cols)
                wg = tl.load(w_gu_ptr + rows_c[:, None] * H + cols[None, :])
                wu = tl.load(w_gu_ptr + (rows_c + N_INTER)[:, None] * H + cols[None, :])
            else:
                k_ok = cols < H
                xk = tl.load(x_ptr + cols, mask=k_ok, other=0.0)
                if HAS_RES:
                    xk = (xk.to(tl.float32) + tl.load(r_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)).to(xk.dtype)
                nw = tl.load(nw_ptr + cols, mask=k_ok, other=0.0)
                wg = tl.load(w_gu_ptr + rows_c[:, None] * H + cols[None, :], mask=k_ok[None, :], other=0.0)
                wu = tl.load(w_gu_ptr + (rows_c + N_INTER)[:, None] * H + cols[None, :], mask=k_ok[None, :], other=0.0)
            # rounded as the add+RMSNorm kernel stores it
            normed = (xk.to(tl.float32) * rstd).to(xk.dtype).to(tl.float32)
            xn = (normed * nw.to(tl.float32)).to(xk.dtype).to(tl.float32)
            acc_g += wg.to(tl.float32) * xn[None, :]
            acc_u += wu.to(tl.float32) * xn[None, :]
        # rounded as the gate_up GEMM stores its output and the SiLU-and-mul kernel its result
        gate = tl.sum(acc_g, axis=1).to(xv.dtype).to(tl.float32)
        up = tl.sum(acc_u, axis=1).to(xv.dtype)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(h_ptr + rows, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=rows < N_INTER)

    _grid_barrier(sync_ptr, num_programs)

    # phase 2: out = h @ down.T
    offs_n = tl.arange(0, BLOCK_N)
    offs_k2 = tl.arange(0, BLOCK_K2)
    for blk in range(pid, num_blocks2, num_programs):
        rows = blk * BLOCK_N + offs_n
        rows_c = tl.minimum(rows, H - 1).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_K2), dtype=tl.float32)
        for k in tl.range(0, N_INTER, BLOCK_K2, num_stages=3):
            cols = k + offs_k2
            if EVEN_K2:
                hk = tl.load(h_ptr + cols, cache_modifier=".cg")
                w = tl.load(w_down_ptr + rows_c[:, None] * N_INTER + cols[None, :])
            else:
                k_ok = cols < N_INTER
                hk = tl.load(h_ptr + cols, mask=k_ok, other=0.0, cache_modifier=".cg")
                w = tl.load(w_down_ptr + rows_c[:, None] * N_INTER + cols[None, :], mask=k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * hk.to(tl.float32)[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < H)


def _barrier_counters(device: torch.device) -> torch.Tensor:
    """Zeroed (arrivals, generation) for the grid barrier; kept for the process (launches leave the arrivals
    at zero; captured CUDA graphs hold the address). One per stream: launches on one stream never overlap."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _barriers:
        _barriers[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _barriers[key]


def use_fused_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """One row on the GPU, contiguous weights of one dtype with x, no biases handled here (the caller
    checks), shapes [2 * N_INTER, H] and [H, N_INTER]."""
    if not (ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] == 1):
        return False
    h = x.shape[1]
    return (gate_up_weight.dim() == 2 and gate_up_weight.shape[1] == h and gate_up_weight.shape[0] % 2 == 0
            and down_weight.shape == (h, gate_up_weight.shape[0] // 2)
            and gate_up_weight.dtype == down_weight.dtype == x.dtype
            and gate_up_weight.is_contiguous() and down_weight.is_contiguous() and x.is_contiguous())


@dataclass(frozen=True)
class MlpConfig:
    block_r: int = 8  # gate (and as many up) rows per phase-1 block
    block_k1: int = 256  # phase-1 K step, at most the hidden size
    block_n: int = 8  # down rows per phase-2 block
    block_k2: int = 512  # phase-2 K step, at most the intermediate size
    num_warps: int = 4


def fused_mlp_triton(
    x: torch.Tensor,  # [1, H] before the norm
    residual: torch.Tensor | None,  # [1, H] or None (no add)
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2 * N_INTER, H]
    down_weight: torch.Tensor,  # [H, N_INTER]
    num_programs: int | None = None,  # default: one per SM (tests: fewer; all must be resident at once)
    config: MlpConfig | None = None,  # benchmarks/fused_mlp.py sweeps these
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(SiLU(gate) * up) of RMSNorm(x + residual), x + residual), each [1, H], in one launch."""
    cfg = config or MlpConfig()
    h = x.shape[1]
    i = gate_up_weight.shape[0] // 2
    has_res = residual is not None
    new_residual = torch.empty_like(x) if has_res else x
    out = torch.empty_like(x)
    scratch = torch.empty(i, dtype=x.dtype, device=x.device)
    grid = num_programs or min(num_sms(x.device), max(triton.cdiv(i, cfg.block_r), triton.cdiv(h, cfg.block_n)))
    pdl = use_pdl(x, 1)
    block_k1 = min(cfg.block_k1, triton.next_power_of_2(h))
    block_k2 = min(cfg.block_k2, triton.next_power_of_2(i))
    line_elems = 128 // x.element_size()
    _fused_mlp_kernel[(grid,)](
        x, residual if has_res else x, norm_weight, new_residual, eps, gate_up_weight, down_weight, scratch, out,
        _barrier_counters(x.device), i,
        H=h, H_POW2=max(triton.next_power_of_2(h), line_elems), BLOCK_R=cfg.block_r, BLOCK_K1=block_k1,
        BLOCK_N=cfg.block_n, BLOCK_K2=block_k2, EVEN_K1=h % block_k1 == 0, EVEN_K2=i % block_k2 == 0,
        HAS_RES=has_res, PDL=pdl, PREFETCH=pdl and L2_PREFETCH and block_k2 >= line_elems, LINE_ELEMS=line_elems,
        num_warps=cfg.num_warps,
        **launch_kwargs(pdl),
    )
    return out, new_residual
