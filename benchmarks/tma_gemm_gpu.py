"""A TMA tensor-core GEMM for mid-sized decode batches (17-256 rows) against cuBLAS, in a chain.

    PYTHONPATH=. python3 benchmarks/tma_gemm_gpu.py [--ms 32,64,128,256] [--quick]
    PYTHONPATH=. python3 benchmarks/tma_gemm_gpu.py --silu-down   # SiLU fused into down_proj's prologue

Session 13's question: can a GEMM of our own beat cuBLAS at the decoder layers' shapes once it is
chained with PDL (its weight tiles stream into L2 while the previous kernel finishes)? The old
tensor-core tiles of skinny_gemm.py (pointer loads, weight as the A operand) lost to cuBLAS by
0.4 ms per 256-row step in the real chain (decode_configs.py --mid). This kernel loads both
operands with TMA descriptors (x as A: [BLOCK_M, BLOCK_K], the weight as B: [BLOCK_N, BLOCK_K]
row-major, transposed in shared memory), splits K across programs when the output tiles cannot
fill the SMs (fp32 partials, the last split to arrive sums them in split order), and under PDL
prefetches its weight share into L2 before `griddepcontrol.wait`.

Each measurement is a CUDA graph of 28 calls on 28 distinct weights (cold in L2, as in a decode
step), every call reading the output of the call before as its x (so each waits on the previous
one, as in a layer chain); time per call = graph time / 28. cuBLAS and every config run side by
side, two rounds in turn; the table gives us per call and the best config per shape.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels import graph_seconds
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from nvcli.kernels.arrival_counters import arrival_counters
from nvcli.kernels.pdl import prefetch_l2
from nvcli.kernels.skinny_gemm import sum_splits_if_last

# down_proj configs of the first sweep's best and runner-up per M (session 13, call 2)
DOWN_CONFIGS = {32: [(64, 32, 128, 4, 4, 132), (64, 64, 128, 4, 4, 132)],
                64: [(64, 32, 128, 4, 4, 132), (64, 32, 64, 4, 4, 132)],
                128: [(64, 32, 128, 4, 4, 132), (128, 32, 128, 8, 4, 132)],
                256: [(128, 32, 128, 8, 4, 132), (64, 32, 128, 4, 4, 132)]}
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def _tma_gemm_kernel(x_desc, w_desc, w_ptr, part_ptr, out_ptr, cnt_ptr, M, N, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT,
                     SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, L2_LINES: tl.constexpr,
                     SILU_MUL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    k0 = pid_k * K_SPLIT
    if PDL:
        gdc_launch_dependents()
        if L2_LINES > 0:  # the weights do not depend on the previous kernel
            rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            cols = tl.minimum(k0 + tl.arange(0, L2_LINES) * 64, K - 1)
            prefetch_l2(w_ptr + rows[:, None] * K + cols[None, :])
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k0, k0 + K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([pid_m * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]
        if SILU_MUL:  # x_desc covers the [M, 2K] gate_up rows: SiLU(gate) * up, rounded as the SiLU kernel does
            up = x_desc.load([pid_m * BLOCK_M, K + k])
            g = a.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        b = w_desc.load([pid_n * BLOCK_N, k])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
        sum_splits_if_last(part_ptr, out_ptr, part_ptr, cnt_ptr + pid_m * tl.num_programs(0) + pid_n, offs_n, offs_m,
                           offs_n, mask, M, N, N, SPLIT_K, False)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def auto_split(m: int, n: int, k: int, bm: int, bn: int, bk: int, target: int) -> int:
    tiles = cdiv(n, bn) * cdiv(m, bm)
    k_iters = cdiv(k, bk)
    split = 1
    while tiles * split * 2 <= target and k_iters % (split * 2) == 0 and k_iters // (split * 2) >= 2:
        split *= 2
    return split


def tma_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple, pdl: bool, silu_mul: bool = False) -> torch.Tensor:
    """x @ w.T; silu_mul: x is [M, 2K] gate_up and the product is (SiLU(gate) * up) @ w.T."""
    bm, bn, bk, warps, stages, target = cfg
    m, k = x.shape
    k //= 2 if silu_mul else 1
    n = w.shape[0]
    split = auto_split(m, n, k, bm, bn, bk, target)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (cdiv(n, bn), split, cdiv(m, bm))
    cnt = arrival_counters(x.device, grid[0] * grid[2]) if split > 1 else out
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    k_split = k // split
    l2_lines = triton.next_power_of_2(cdiv(k_split, 64)) if pdl else 0
    _tma_gemm_kernel[grid](x_desc, w_desc, w, part, out, cnt, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           K_SPLIT=k_split, SPLIT_K=split, NUM_STAGES=stages, PDL=pdl, L2_LINES=l2_lines, SILU_MUL=silu_mul,
                           num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out


def chain_us(fn, xs: torch.Tensor, ws: list[torch.Tensor], reps: int = 20) -> float:
    """us per call of a graph that calls fn(x_i, w_i) for each weight, x_i the previous output's first K columns."""
    k = ws[0].shape[1]

    def body():
        x = xs
        for w in ws:
            y = fn(x, w)
            x = y[:, :k] if y.shape[1] >= k else xs
        return x

    return graph_seconds(body, warm_runs=1, replays=reps + 1, skip=1) * 1e6 / len(ws)


def silu_down_us(m: int, cfg: tuple, layers: int) -> dict[str, float]:
    """SiLU + down_proj over `layers` layers in one graph, us per layer: SiLU kernel + cuBLAS, SiLU kernel + this
    GEMM (PDL), and this GEMM with SiLU in its prologue (PDL)."""
    from nvcli.kernels import pdl as pdl_mod
    from nvcli.kernels.activation import silu_and_mul_triton

    n, k = SHAPES["down"]
    pdl_mod.MAX_ROWS = 1 << 20  # the SiLU kernel under PDL too
    gus = [torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    ref = F.linear(silu_and_mul_triton(gus[0]), ws[0]).float()
    fused = tma_linear(gus[0], ws[0], cfg, True, silu_mul=True).float()
    err = (fused - ref).abs().max().item() / ref.abs().max().item()
    variants = {
        "SiLU + cuBLAS": lambda i: F.linear(silu_and_mul_triton(gus[i]), ws[i]),
        "SiLU + TMA": lambda i: tma_linear(silu_and_mul_triton(gus[i]), ws[i], cfg, True),
        "fused TMA": lambda i: tma_linear(gus[i], ws[i], cfg, True, silu_mul=True),
    }
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, fn in variants.items():
            out[name].append(layer_graph_us(fn, layers))
    pdl_mod.MAX_ROWS = 16
    return {"err": err, **{name: statistics.median(v) for name, v in out.items()}}


def layer_graph_us(fn, layers: int, reps: int = 20) -> float:
    """us per layer of a graph that calls fn(i) for each of `layers` layers."""

    def body():
        for i in range(layers):
            fn(i)

    return graph_seconds(body, warm_runs=1, replays=reps + 1, skip=1) * 1e6 / layers


def configs(quick: bool) -> list[tuple]:
    out = []
    for bm, bn, bk, stages, target in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4), (132, 264)):
        if bm == 128 and bn == 128 and bk == 128:
            continue  # shared memory
        if quick and (stages == 3 or target == 264):
            continue
        out.append((bm, bn, bk, 4 if bm == 64 else 8, stages, target))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--silu-down", action="store_true", help="only the SiLU + down_proj fusion study")
    args = ap.parse_args()
    if args.silu_down:
        lines = ["| M | config | SiLU + cuBLAS | SiLU + TMA | fused TMA | fused max rel err |", "| --- " * 6 + "|"]
        for m in [int(v) for v in args.ms.split(",")]:
            for cfg in DOWN_CONFIGS.get(m, [(64, 32, 128, 4, 4, 132)]):
                r = silu_down_us(m, cfg, args.layers)
                lines.append(f"| {m} | {' '.join(map(str, cfg))} | {r['SiLU + cuBLAS']:.2f} | {r['SiLU + TMA']:.2f} | "
                             f"{r['fused TMA']:.2f} | {r['err']:.2e} |")
                print(lines[-1], flush=True)
        print("(us per layer)\n" + "\n".join(lines))
        return 0
    torch.manual_seed(0)
    dev = "cuda"
    lines = ["| shape | M | cuBLAS us | best TMA us (PDL) | config (bm bn bk warps stages target: split) | best no PDL |",
             "| --- | --- | --- | --- | --- | --- |"]
    ok = True
    cfgs = configs(args.quick)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        for m in [int(v) for v in args.ms.split(",")]:
            xs = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(xs, ws[0]).float()
            res: dict = {}
            for cfg in cfgs:
                try:
                    got = tma_linear(xs, ws[0], cfg, True).float()
                    err = (got - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        ok = False
                        print(f"MISMATCH {name} M={m} {cfg}: {err:.3g}", flush=True)
                        continue
                except Exception as e:  # out of shared memory / registers
                    print(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                res[cfg] = []
            cub = []
            for _ in range(2):
                cub.append(chain_us(F.linear, xs, ws))
                for cfg in res:
                    res[cfg].append(chain_us(lambda x, w, c=cfg: tma_linear(x, w, c, True), xs, ws))
            best = min(res, key=lambda c: statistics.median(res[c]))
            nopdl = chain_us(lambda x, w, c=best: tma_linear(x, w, c, False), xs, ws)
            split = auto_split(m, n, k, best[0], best[1], best[2], best[5])
            line = (f"| {name} | {m} | {statistics.median(cub):.2f} | {statistics.median(res[best]):.2f} | "
                    f"{' '.join(map(str, best))}: {split} | {nopdl:.2f} |")
            print(line, flush=True)
            top = sorted(res, key=lambda c: statistics.median(res[c]))[:4]
            print("   top:", [(c, round(statistics.median(res[c]), 2)) for c in top], flush=True)
            lines.append(line)
        del ws
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
