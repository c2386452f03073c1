"""A decoder layer's post-attention chain as one persistent kernel with grid barriers, against the engine's chain.

    PYTHONPATH=. python3 benchmarks/layer_kernel_gpu.py [--ms 32,64,128,256] [--configs 64:128:8,32:128:4]
    PYTHONPATH=. python3 benchmarks/layer_kernel_gpu.py --diagnose   # where the persistent launch's time goes

Session 14's question. Sessions 13-14 measured that what bf16 decode loses beyond its KV reads is the latency of
~8 dependent kernels per layer (o_proj, add+RMSNorm, gate_up, SiLU, down, add+RMSNorm, qkv): each cuBLAS GEMM costs
5-9 us at 17-256 rows whoever writes it, weights in L2 or not, and fusing elementwise work into a GEMM kernel
costs more than it saves. The one lever left is fewer kernel boundaries. This kernel runs the whole chain in one
launch of one program per SM, phases separated by grid barriers (an atomic arrival count, spun on with acquire
loads):

    0  o_proj, K split: part[s] = attn[:, ks] @ Wo[:, ks].T                     (fp32 partials)
    1  rows: h += sum_s part[s] (fp32 residual stream); xn = RMSNorm(h) (bf16)
    2  gate_up tiles, SiLU(gate) * up in the epilogue (gate/up rows interleaved per tile): act (bf16)
    3  down, K split: part[s] = act[:, ks] @ Wd[:, ks].T
    4  rows: h += sum_s part[s]; xn = RMSNorm(h)
    5  qkv tiles: qkv = xn @ Wqkv.T                                              (then decode attention)

Split-K partials are summed in split order, so results do not depend on timing. Loads of anything written in the
same launch bypass L1 (.cg), which other SMs' stores do not update.

Checked against torch float32 (the same math), then timed per layer in CUDA graphs of 28 layers with distinct
weights: the engine's chain (cuBLAS + our add+RMSNorm and SiLU kernels), this kernel as six launches (one per
phase, no barriers), as one persistent launch, persistent with each program prefetching its next GEMM phase's
weight tiles into L2 before the barrier, and persistent with the next phase's first weight tile held in registers
across the barrier (PRELOAD: whole-K tiles, which fit in shared memory only at the smallest shapes).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels import graph_seconds

from nvcli.kernels.activation import silu_and_mul_triton
from nvcli.kernels.pdl import prefetch_l2
from nvcli.kernels.rms_norm import rms_norm_triton

HID, ATT, INTER, QKV = 1024, 2048, 3072, 4096
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
EPS = 1e-6


@triton.jit
def _grid_barrier(bar_ptr, target):
    tl.debug_barrier()  # this program's stores come before its arrival
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _mm_tile(a_ptr, lda, w_ptr, ldw, m0, n0, k0, M, K_LEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, MODE: tl.constexpr):
    """[BM, BN] fp32 = a[m0:m0+BM, k0:k0+K_LEN] @ w[n0:n0+BN, k0:k0+K_LEN].T

    MODE (timing diagnostics; wrong results except 0): 0 the product; 1 the loads alone (each tile summed into the
    accumulator, no dot); 2 the dots on the first K block, re-read every step (the loads hit L1/L2); 3 no K loop."""
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_end = k0 + K_LEN
    if MODE == 3:
        k_end = k0
    for k in range(k0, k_end, BK):
        if MODE == 2:
            a = tl.load(a_ptr + offs_m[:, None] * lda + (k0 + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * ldw + (k0 + offs_k)[None, :])
        else:
            a = tl.load(a_ptr + offs_m[:, None] * lda + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * ldw + (k + offs_k)[None, :])
        if MODE == 1:
            acc += tl.sum(a.to(tl.float32), axis=1)[:, None] + tl.sum(w.to(tl.float32), axis=1)[None, :]
        elif INTERPRETED:  # the interpreter's bf16 arithmetic is wrong
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _item_tile(item, m_blocks, SPLIT: tl.constexpr):
    """(split, row block, column block) of a GEMM phase's work item: split fastest, then row block, so the programs
    side by side share a weight tile. Compute, L2 prefetch and PRELOAD all walk the items in this order."""
    return item % SPLIT, (item // SPLIT) % m_blocks, item // (SPLIT * m_blocks)


@triton.jit
def _store_partial(part_ptr, acc, s, mb, nb, M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Split s's fp32 partial of the (mb, nb) tile into part[s] ([SPLIT, M, N])."""
    offs_m = mb * BM + tl.arange(0, BM)
    offs_n = nb * BN + tl.arange(0, BN)
    tl.store(part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=offs_m[:, None] < M)


@triton.jit
def _split_gemm_phase(a_ptr, lda, w_ptr, part_ptr, pid, M, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
                      NUM_PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      MODE: tl.constexpr):
    m_blocks = tl.cdiv(M, BM)
    items = m_blocks * (N // BN) * SPLIT
    for item in range(pid, items, NUM_PROGS):
        s, mb, nb = _item_tile(item, m_blocks, SPLIT)
        acc = _mm_tile(a_ptr, lda, w_ptr, K, mb * BM, nb * BN, s * (K // SPLIT), M, K // SPLIT, BM, BN, BK, MODE)
        _store_partial(part_ptr, acc, s, mb, nb, M, N, BM, BN)


@triton.jit
def _prefetch_phase_weights(w_ptr, pid, M, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
                            NUM_PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """L2 prefetch of the weight tiles this program will read in a (split) GEMM phase, items ordered as there."""
    m_blocks = tl.cdiv(M, BM)
    LINES: tl.constexpr = K // SPLIT // 64  # 128-byte lines of bf16 per weight row slice (at most 48 here)
    rows = tl.arange(0, BN)
    lines = tl.minimum(tl.arange(0, 64), LINES - 1)  # a power of two for arange; repeats are harmless
    for item in range(pid, m_blocks * (N // BN) * SPLIT, NUM_PROGS):
        s, _, nb = _item_tile(item, m_blocks, SPLIT)
        prefetch_l2(w_ptr + (nb * BN + rows)[:, None].to(tl.int64) * K + s * (K // SPLIT) + lines[None, :] * 64)


@triton.jit
def _w_tile(w_ptr, ldw, item, items, m_blocks, SPLIT: tl.constexpr, K_LEN: tl.constexpr, BN: tl.constexpr):
    """PRELOAD: the whole weight tile [BN, K_LEN] of `item`, zeros past the last item."""
    s, _, nb = _item_tile(item, m_blocks, SPLIT)
    rows = nb * BN + tl.arange(0, BN)
    cols = s * K_LEN + tl.arange(0, K_LEN)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * ldw + cols[None, :], mask=(rows[:, None] >= 0) & (item < items),
                   other=0.0)


@triton.jit
def _whole_k_dot(a_ptr, lda, w, item, m_blocks, M, SPLIT: tl.constexpr, K_LEN: tl.constexpr, BM: tl.constexpr):
    """PRELOAD: [BM, BN] fp32 = the item's activation rows (all of its K slice, one load) @ w.T"""
    s, mb, _ = _item_tile(item, m_blocks, SPLIT)
    offs_m = mb * BM + tl.arange(0, BM)
    cols = s * K_LEN + tl.arange(0, K_LEN)
    a = tl.load(a_ptr + offs_m[:, None] * lda + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                cache_modifier=".cg")
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(a, tl.trans(w))


@triton.jit
def _preloaded_split_phase(a_ptr, lda, w_ptr, w_first, part_ptr, pid, M, N: tl.constexpr, K: tl.constexpr,
                           SPLIT: tl.constexpr, NUM_PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    m_blocks = tl.cdiv(M, BM)
    items = m_blocks * (N // BN) * SPLIT
    w = w_first
    for item in range(pid, items, NUM_PROGS):
        if item != pid:
            w = _w_tile(w_ptr, K, item, items, m_blocks, SPLIT, K // SPLIT, BN)
        acc = _whole_k_dot(a_ptr, lda, w, item, m_blocks, M, SPLIT, K // SPLIT, BM)
        s, mb, nb = _item_tile(item, m_blocks, SPLIT)
        _store_partial(part_ptr, acc, s, mb, nb, M, N, BM, BN)


@triton.jit
def _rows_phase(h_ptr, part_ptr, norm_ptr, xn_ptr, pid, M, eps, SPLIT: tl.constexpr, NUM_PROGS: tl.constexpr,
                H: tl.constexpr):
    cols = tl.arange(0, H)
    w = tl.load(norm_ptr + cols).to(tl.float32)
    for r in range(pid, M, NUM_PROGS):
        h = tl.load(h_ptr + r * H + cols, cache_modifier=".cg")
        for s in tl.static_range(SPLIT):
            h += tl.load(part_ptr + (s * M + r) * H + cols, cache_modifier=".cg")
        tl.store(h_ptr + r * H + cols, h)
        rms = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
        tl.store(xn_ptr + r * H + cols, (h * rms * w).to(xn_ptr.dtype.element_ty))


@triton.jit
def _layer_kernel(attn_ptr, h_ptr, part_ptr, xn_ptr, act_ptr, qkv_ptr, wo_ptr, wgu_ptr, wd_ptr, wqkv_ptr,
                  n1_ptr, n2_ptr, bar_ptr, M, eps, PHASE: tl.constexpr, NUM_PROGS: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, SPLIT_O: tl.constexpr, SPLIT_D: tl.constexpr,
                  H: tl.constexpr, ATT_DIM: tl.constexpr, INTER_DIM: tl.constexpr, Q: tl.constexpr,
                  PREFETCH: tl.constexpr, MODE: tl.constexpr = 0, PRELOAD: tl.constexpr = False):
    """PHASE -1: every phase, with grid barriers between them; 0-5: that phase alone (one launch per phase).

    PRELOAD (with PHASE -1): every GEMM tile takes all of its K slice at once, and each program loads the weight
    tile of its first item of the next GEMM phase into registers before the barrier in front of it, so those
    reads overlap the barrier and the row pass."""
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BM)
    if PRELOAD:
        w_o = _w_tile(wo_ptr, ATT_DIM, pid, m_blocks * (H // BN) * SPLIT_O, m_blocks, SPLIT_O, ATT_DIM // SPLIT_O, BN)
        _preloaded_split_phase(attn_ptr, ATT_DIM, wo_ptr, w_o, part_ptr, pid, M, H, ATT_DIM, SPLIT_O, NUM_PROGS,
                               BM, BN)
        w_gu = _w_tile(wgu_ptr, H, pid, m_blocks * (2 * INTER_DIM // BN), m_blocks, 1, H, BN)
    elif PHASE == -1 or PHASE == 0:
        _split_gemm_phase(attn_ptr, ATT_DIM, wo_ptr, part_ptr, pid, M, H, ATT_DIM, SPLIT_O, NUM_PROGS, BM, BN, BK, MODE)
    if PHASE == -1:
        if PREFETCH:
            _prefetch_phase_weights(wgu_ptr, pid, M, 2 * INTER_DIM, H, 1, NUM_PROGS, BM, BN)
        _grid_barrier(bar_ptr, NUM_PROGS)
    if PHASE == -1 or PHASE == 1:
        _rows_phase(h_ptr, part_ptr, n1_ptr, xn_ptr, pid, M, eps, SPLIT_O, NUM_PROGS, H)
    if PHASE == -1:
        _grid_barrier(bar_ptr, 2 * NUM_PROGS)
    if PHASE == -1 or PHASE == 2:  # tile nb holds gate rows nb*BN/2.. then the same up rows
        for item in range(pid, m_blocks * (2 * INTER_DIM // BN), NUM_PROGS):
            _, mb, nb = _item_tile(item, m_blocks, 1)
            if PRELOAD:
                if item != pid:
                    w_gu = _w_tile(wgu_ptr, H, item, m_blocks * (2 * INTER_DIM // BN), m_blocks, 1, H, BN)
                acc = _whole_k_dot(xn_ptr, H, w_gu, item, m_blocks, M, 1, H, BM)
            else:
                acc = _mm_tile(xn_ptr, H, wgu_ptr, H, mb * BM, nb * BN, 0, M, H, BM, BN, BK, MODE)
            gate, up = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), (0, 2, 1)))
            act = gate / (1.0 + tl.exp(-gate)) * up
            offs_m = mb * BM + tl.arange(0, BM)
            offs_n = nb * (BN // 2) + tl.arange(0, BN // 2)
            tl.store(act_ptr + offs_m[:, None] * INTER_DIM + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                     mask=offs_m[:, None] < M)
    if PHASE == -1:
        if PREFETCH:
            _prefetch_phase_weights(wd_ptr, pid, M, H, INTER_DIM, SPLIT_D, NUM_PROGS, BM, BN)
        if PRELOAD:
            w_d = _w_tile(wd_ptr, INTER_DIM, pid, m_blocks * (H // BN) * SPLIT_D, m_blocks, SPLIT_D,
                          INTER_DIM // SPLIT_D, BN)
        _grid_barrier(bar_ptr, 3 * NUM_PROGS)
    if PRELOAD:
        _preloaded_split_phase(act_ptr, INTER_DIM, wd_ptr, w_d, part_ptr, pid, M, H, INTER_DIM, SPLIT_D, NUM_PROGS,
                               BM, BN)
        w_qkv = _w_tile(wqkv_ptr, H, pid, m_blocks * (Q // BN), m_blocks, 1, H, BN)
    elif PHASE == -1 or PHASE == 3:
        _split_gemm_phase(act_ptr, INTER_DIM, wd_ptr, part_ptr, pid, M, H, INTER_DIM, SPLIT_D, NUM_PROGS, BM, BN, BK, MODE)
    if PHASE == -1:
        if PREFETCH:
            _prefetch_phase_weights(wqkv_ptr, pid, M, Q, H, 1, NUM_PROGS, BM, BN)
        _grid_barrier(bar_ptr, 4 * NUM_PROGS)
    if PHASE == -1 or PHASE == 4:
        _rows_phase(h_ptr, part_ptr, n2_ptr, xn_ptr, pid, M, eps, SPLIT_D, NUM_PROGS, H)
    if PHASE == -1:
        _grid_barrier(bar_ptr, 5 * NUM_PROGS)
    if PHASE == -1 or PHASE == 5:
        for item in range(pid, m_blocks * (Q // BN), NUM_PROGS):
            _, mb, nb = _item_tile(item, m_blocks, 1)
            if PRELOAD:
                if item != pid:
                    w_qkv = _w_tile(wqkv_ptr, H, item, m_blocks * (Q // BN), m_blocks, 1, H, BN)
                acc = _whole_k_dot(xn_ptr, H, w_qkv, item, m_blocks, M, 1, H, BM)
            else:
                acc = _mm_tile(xn_ptr, H, wqkv_ptr, H, mb * BM, nb * BN, 0, M, H, BM, BN, BK, MODE)
            offs_m = mb * BM + tl.arange(0, BM)
            offs_n = nb * BN + tl.arange(0, BN)
            tl.store(qkv_ptr + offs_m[:, None] * Q + offs_n[None, :], acc.to(qkv_ptr.dtype.element_ty),
                     mask=offs_m[:, None] < M)
    if PHASE == -1:  # the last program out resets the counter for the next launch
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == NUM_PROGS - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(bar_ptr + 1, 0, sem="release", scope="gpu")


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, bn: int) -> torch.Tensor:
    """[2I, H]: per tile of bn rows, bn/2 gate rows then the same bn/2 up rows."""
    i, h = w_gate.shape
    return torch.stack([w_gate.view(i // (bn // 2), bn // 2, h), w_up.view(i // (bn // 2), bn // 2, h)],
                       dim=1).reshape(2 * i, h).contiguous()


def pick_split(m_blocks: int, n_blocks: int, k: int, bk: int, programs: int) -> int:
    split = 1
    while m_blocks * n_blocks * split * 2 <= programs and (k // (split * 2)) % bk == 0:
        split *= 2
    return split


class Layer:
    def __init__(self, bn: int, dev: str = "cuda"):
        g = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.wo, self.wg, self.wu, self.wd, self.wqkv = g(HID, ATT), g(INTER, HID), g(INTER, HID), g(HID, INTER), g(QKV, HID)
        self.n1 = 1 + 0.1 * torch.randn(HID, device=dev, dtype=torch.bfloat16)
        self.n2 = 1 + 0.1 * torch.randn(HID, device=dev, dtype=torch.bfloat16)
        self.wgu = torch.cat([self.wg, self.wu])  # the engine's layout
        self.wgu_tiles = interleave_gate_up(self.wg, self.wu, bn)


class Runner:
    """Buffers and launches for one batch size and tile config."""

    def __init__(self, m: int, bm: int, bn: int, bk: int, warps: int, stages: int, programs: int, dev: str = "cuda"):
        self.m, self.bm, self.bn, self.bk, self.warps, self.stages, self.programs = m, bm, bn, bk, warps, stages, programs
        m_blocks = triton.cdiv(m, bm)
        self.split_o = pick_split(m_blocks, HID // bn, ATT, bk, programs)
        self.split_d = pick_split(m_blocks, HID // bn, INTER, bk, programs)
        # PRELOAD takes a tile's whole K slice, a power of two: down_proj's 3072 splits by 3 * 2^i
        self.split_d_preload = max([3 * 2 ** i for i in range(5) if m_blocks * (HID // bn) * 3 * 2 ** i <= programs],
                                   default=3)
        self.part = torch.empty(max(self.split_o, self.split_d, self.split_d_preload), m, HID, device=dev,
                                dtype=torch.float32)
        self.xn = torch.empty(m, HID, device=dev, dtype=torch.bfloat16)
        self.act = torch.empty(m, INTER, device=dev, dtype=torch.bfloat16)
        self.qkv = torch.empty(m, QKV, device=dev, dtype=torch.bfloat16)
        self.bar = torch.zeros(2, device=dev, dtype=torch.int32)

    def __call__(self, layer: Layer, attn: torch.Tensor, h: torch.Tensor, phases: bool,
                 prefetch: bool = False, mode: int = 0, preload: bool = False) -> torch.Tensor:
        split_d = self.split_d_preload if preload else self.split_d
        for phase in (range(6) if phases else [-1]):
            _layer_kernel[(self.programs,)](
                attn, h, self.part, self.xn, self.act, self.qkv, layer.wo, layer.wgu_tiles, layer.wd, layer.wqkv,
                layer.n1, layer.n2, self.bar, self.m, EPS, PHASE=phase, NUM_PROGS=self.programs, BM=self.bm,
                BN=self.bn, BK=self.bk, SPLIT_O=self.split_o, SPLIT_D=split_d, H=HID, ATT_DIM=ATT, INTER_DIM=INTER,
                Q=QKV, PREFETCH=prefetch, MODE=mode, PRELOAD=preload, num_warps=self.warps, num_stages=self.stages)
        return self.qkv


def reference(layer: Layer, attn: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = lambda t: t.float()  # noqa: E731
    h1 = h + f(attn) @ f(layer.wo).T
    x1 = h1 * torch.rsqrt(h1.pow(2).mean(-1, keepdim=True) + EPS) * f(layer.n1)
    gu = x1.bfloat16().float() @ f(layer.wgu).T
    act = (F.silu(gu[:, :INTER]) * gu[:, INTER:]).bfloat16().float()
    h2 = h1 + act @ f(layer.wd).T
    x2 = h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + EPS) * f(layer.n2)
    return x2.bfloat16().float() @ f(layer.wqkv).T, h2


def relative_errors(run: Runner, layer: Layer, attn: torch.Tensor, h0: torch.Tensor,
                    ref: tuple[torch.Tensor, torch.Tensor], **variant: bool) -> list[float]:
    """Max relative errors of qkv and of the residual stream after one launch of `run` (variant: its flags)
    against reference()."""
    h = h0.clone()
    qkv = run(layer, attn, h, **variant).float()
    return [((got - want).abs().max() / want.abs().max()).item() for got, want in zip((qkv, h), ref)]


def engine_chain(layer: Layer, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What the engine runs between two decode attentions at these batch sizes."""
    o = F.linear(attn, layer.wo)
    x, residual = rms_norm_triton(o, layer.n1, EPS, residual)
    act = silu_and_mul_triton(F.linear(x, layer.wgu))
    d = F.linear(act, layer.wd)
    x, residual = rms_norm_triton(d, layer.n2, EPS, residual)
    return F.linear(x, layer.wqkv)


def diagnose(args: argparse.Namespace, programs: int) -> int:
    """us per layer of the persistent launch: whole, loads only, dots on cached blocks, no K loop."""
    best = {32: (32, 64, 128, 8), 64: (64, 64, 128, 8), 128: (128, 64, 64, 8), 256: (128, 64, 64, 8)}
    lines = ["| M | config | full | loads only, no dots | dots on cached blocks | no K loop (barriers, row passes, "
             "stores) |", "| --- " * 6 + "|"]
    for m in [int(v) for v in args.ms.split(",")]:
        bm, bn, bk, warps = best.get(m, best[64])
        if args.configs:
            v = [int(x) for x in args.configs.split(",")[0].split(":")]
            bm, bn, bk, warps = (v[3] if len(v) > 3 else bm), v[0], v[1], v[2]
        layers = [Layer(bn) for _ in range(args.layers)]
        attn = torch.randn(m, ATT, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(m, HID, device="cuda", dtype=torch.float32)
        run = Runner(m, bm, bn, bk, warps, 3, programs)
        res: dict[int, list[float]] = {mode: [] for mode in range(4)}
        for r in range(args.rounds):
            for mode in (range(4) if r % 2 == 0 else reversed(range(4))):
                fn = lambda mode=mode, run=run, a=attn, h=h, ls=layers: [run(lay, a, h, False, False, mode) for lay in ls]  # noqa: E731
                res[mode].append(graph_seconds(fn, warm_runs=1, replays=11, skip=1) * 1e6 / args.layers)
        med = [statistics.median(res[mode]) for mode in range(4)]
        lines.append(f"| {m} | {bm} {bn} {bk} {warps}; {run.split_o}/{run.split_d} | " + " | ".join(f"{t:.1f}" for t in med)
                     + " |")
        print(lines[-1], flush=True)
    print("(us per layer)\n" + "\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="", help="bn:bk:warps[:bm],... (block_m defaults to the rows, 16-64); "
                    "default: the three of session 14's first calls")
    ap.add_argument("--diagnose", action="store_true",
                    help="time the persistent launch with its GEMM phases cut down (see _mm_tile's MODE), first config")
    args = ap.parse_args()
    torch.manual_seed(0)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    if args.diagnose:
        return diagnose(args, programs)
    ok = True
    lines = ["| M | engine chain (7 kernels) | ours, 6 launches | ours, 1 persistent launch | + next weights to L2 before "
             "each barrier | + next weight tile in registers before each barrier, whole-K tiles | config (bm bn bk warps "
             "stages; splits o/down) | max rel err |", "| --- " * 8 + "|"]
    for m in [int(v) for v in args.ms.split(",")]:
        bm = min(64, max(16, triton.next_power_of_2(m)))
        cfgs = [(bm, 64, 64, 8, 3), (bm, 64, 128, 8, 3), (min(128, max(16, triton.next_power_of_2(m))), 64, 64, 8, 3)]
        if args.configs:
            cfgs = []
            for c in args.configs.split(","):
                v = [int(x) for x in c.split(":")]
                cfgs.append((v[3] if len(v) > 3 else bm, v[0], v[1], v[2], 3))
        cfgs = list(dict.fromkeys(cfgs))
        layers = [Layer(cfgs[0][1]) for _ in range(args.layers)]
        attn = torch.randn(m, ATT, device="cuda", dtype=torch.bfloat16)
        h0 = torch.randn(m, HID, device="cuda", dtype=torch.float32)
        res0 = h0.bfloat16()
        for cfg in cfgs:
            bm, bn, bk, warps, stages = cfg
            for lay in layers:
                lay.wgu_tiles = interleave_gate_up(lay.wg, lay.wu, bn)
            run = Runner(m, bm, bn, bk, warps, stages, programs)
            ref = reference(layers[0], attn, h0)
            errs = []
            for phases, prefetch in ((True, False), (False, False), (False, True)):
                errs += relative_errors(run, layers[0], attn, h0, ref, phases=phases, prefetch=prefetch)
            try:  # whole-K tiles may not fit in shared memory at every shape
                errs += relative_errors(run, layers[0], attn, h0, ref, phases=False, preload=True)
                preload_ok = True
            except Exception as e:
                print(f"M={m} {cfg} preload: {type(e).__name__}: {str(e)[:160]}", flush=True)
                preload_ok = False
            torch.cuda.synchronize()
            if max(errs) > 2e-2 or int(run.bar.abs().sum()) != 0:
                ok = False
                print(f"MISMATCH M={m} {cfg}: errors {errs}, barrier {run.bar.tolist()}", flush=True)
                continue
            h = h0.clone()
            variants = {
                "engine": lambda ls=layers, a=attn, r=res0: [engine_chain(lay, a, r) for lay in ls],
                "phases": lambda ls=layers, a=attn, h=h, run=run: [run(lay, a, h, True) for lay in ls],
                "persistent": lambda ls=layers, a=attn, h=h, run=run: [run(lay, a, h, False) for lay in ls],
                "prefetch": lambda ls=layers, a=attn, h=h, run=run: [run(lay, a, h, False, True) for lay in ls],
            }
            if preload_ok:
                variants["preload"] = lambda ls=layers, a=attn, h=h, run=run: [run(lay, a, h, False, preload=True)
                                                                              for lay in ls]
            res: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(args.rounds):
                for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                    res[name].append(graph_seconds(variants[name], warm_runs=1, replays=11, skip=1) * 1e6 / args.layers)
            med = {k: statistics.median(v) for k, v in res.items()}
            pre = f"{med['preload']:.1f}" if "preload" in med else "failed"
            lines.append(f"| {m} | {med['engine']:.1f} | {med['phases']:.1f} | {med['persistent']:.1f} | {med['prefetch']:.1f} | "
                         f"{pre} | {bm} {bn} {bk} {warps} {stages}; {run.split_o}/{run.split_d} "
                         f"({run.split_d_preload} preloaded) | {max(errs):.1e} |")
            print(lines[-1], flush=True)
    print("(us per layer, graphs of 28 layers)\n" + "\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
