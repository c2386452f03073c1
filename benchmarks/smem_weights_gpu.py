"""Decoder GEMMs whose weights wait in shared memory before the previous kernel ends (Gluon, Hopper).

    PYTHONPATH=. python3 benchmarks/smem_weights_gpu.py [--ms 32,64,128,256] [--rounds 3]
    python3 benchmarks/smem_weights_gpu.py --compile-only     # any machine: compile for sm_90a, print smem

Sessions 13-14 priced bf16's gap to its target as the latency of the decoder's dependent GEMMs: 5-9 us
each at 17-256 rows, whoever writes them, weights in HBM or in L2, because the K loop waits on its
weight tiles after the previous kernel ended. L2 prefetch under PDL saved ~1 us per GEMM; a
register preload (session 14's PRELOAD) did not fit Triton's dot, which stages operands in shared
memory itself. Gluon exposes shared memory, TMA and mbarriers, so this kernel does the missing step:

- launched with PDL, each program lets the next kernel launch, then issues TMA copies of its whole
  weight share ([BLOCK_N, K_SPLIT], at most ~128 KB) into shared memory, and only then waits in
  `griddepcontrol.wait` for the previous kernel. The weight bytes stream while that kernel runs;
- after the wait it streams x ([M, K_SPLIT] in [BLOCK_M, 64] tiles, a TMA ring of STAGES) against the
  resident weight tiles on wgmma, swap-AB (the weight rows are the MMA's M = BLOCK_N, x rows its N);
- K is split across programs when N / BLOCK_N cannot fill the SMs (o_proj, down: N = 1024); the last
  split to arrive sums the fp32 partials in split order (deterministic), as skinny_gemm.py does.

The question it answers: per decoder layer (o_proj -> gate_up -> down -> qkv, the real shapes, 28
layers with distinct weights chained in one CUDA graph), how much faster is this chain than cuBLAS's
at the decode batch sizes the benchmark spends most of its steps in? The elementwise kernels between
the GEMMs are left out of both chains. The table gives us per layer, the median of `--rounds` rounds
measured in turn.

Answer (H100, RESULTS.md session 20): not faster. Resident weights under PDL save 8.6 us per layer
against the same kernel without PDL at 32 rows, which proves the overlap works, but the best config
reads 25.5-27.3 us per layer at 32-64 rows against cuBLAS's 27.9-28.8, and loses from 96 rows on
(x re-read by every column block: M / BLOCK_N times the weight bytes, through L2). What is left
after the wait (x's TMA round trip, the MMAs, the split-K arrival and sum) is ~6 us per GEMM.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nvcli.kernels.arrival_counters import arrival_counters

BLOCK_K = 64  # 128 bytes of bf16: one 128-byte-swizzled TMA row
LAYER = [("o_proj", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072), ("qkv", 4096, 1024)]
# per shape: (BLOCK_N, SPLIT_K, warps); BLOCK_N x K / SPLIT_K bf16 weights per program, ~128 programs
# and the x ring (X_RING_BYTES)
CONFIGS = {
    "default": ({"o_proj": (64, 8, 4), "gate_up": (64, 1, 4), "down": (64, 8, 4), "qkv": (64, 2, 4)}, "ring"),
    "split2": ({"o_proj": (64, 8, 4), "gate_up": (64, 2, 4), "down": (64, 8, 4), "qkv": (64, 2, 4)}, "ring"),
    "all_x": ({"o_proj": (64, 8, 4), "gate_up": (64, 1, 4), "down": (64, 8, 4), "qkv": (64, 2, 4)}, "all_x"),
    "split2_all_x": ({"o_proj": (64, 8, 4), "gate_up": (64, 2, 4), "down": (64, 8, 4), "qkv": (64, 2, 4)}, "all_x"),
    "few_splits_all_x": ({"o_proj": (64, 4, 4), "gate_up": (64, 1, 4), "down": (64, 4, 4), "qkv": (64, 1, 4)},
                         "all_x"),
    "wide": ({"o_proj": (128, 16, 8), "gate_up": (128, 2, 8), "down": (128, 16, 8), "qkv": (128, 4, 8)}, "ring"),
}


@gluon.jit
def _smem_weights_gemm_kernel(
    x_desc,  # TMA over x [M, K], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA over the weight [N, K], blocks [BLOCK_N, BLOCK_K]
    part_ptr,  # fp32 [SPLIT_K, M, N] partials (SPLIT_K > 1)
    out_ptr,  # [M, N] row stride stride_om
    cnt_ptr,  # int32 arrival counter per column block, zero between calls (SPLIT_K > 1)
    M,
    N,
    stride_om,
    BLOCK_N: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr,  # weight tiles per program: K_SPLIT = K_TILES * BLOCK_K
    SPLIT_K: gl.constexpr,
    STAGES: gl.constexpr,  # x tiles in flight
    PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * BLOCK_N
    k0 = pid_k * (K_TILES * BLOCK_K)

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [K_TILES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(w_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(x_bars.index(s), count=1)
    fence_async_shared()

    if PDL:
        gdc_launch_dependents()
    # the weights do not depend on the previous kernel: they stream while it runs
    mbarrier.expect(w_bar, K_TILES * w_desc.block_type.nbytes)
    for t in gl.static_range(K_TILES):
        tma.async_copy_global_to_shared(w_desc, [off_n, k0 + t * BLOCK_K], w_bar, w_smem.index(t))
    if PDL:
        gdc_wait()

    num_m = gl.cdiv(M, BLOCK_M)
    total = num_m * K_TILES
    for s in gl.static_range(STAGES - 1):
        ok = s < total
        mbarrier.expect(x_bars.index(s), x_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(x_desc, [(s // K_TILES) * BLOCK_M, k0 + (s % K_TILES) * BLOCK_K],
                                        x_bars.index(s), x_smem.index(s), pred=ok)
    mbarrier.wait(w_bar, phase=0)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    # stores: a warp's lanes run along N (the output row), each thread 2 consecutive columns
    out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, num_warps], [0, 1])
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))  # [BLOCK_N]
    for mb in range(num_m):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)  # acc^T: [out features, x rows]
        for t in gl.static_range(K_TILES):
            i = mb * K_TILES + t
            slot = i % STAGES
            mbarrier.wait(x_bars.index(slot), phase=(i // STAGES) & 1)
            acc = warpgroup_mma(w_smem.index(t), x_smem.index(slot).permute((1, 0)), acc, use_acc=t > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            j = i + STAGES - 1  # into the slot the MMA just retired read
            ok = j < total
            js = j % STAGES
            mbarrier.expect(x_bars.index(js), x_desc.block_type.nbytes, pred=ok)
            tma.async_copy_global_to_shared(x_desc, [(j // K_TILES) * BLOCK_M, k0 + (j % K_TILES) * BLOCK_K],
                                            x_bars.index(js), x_smem.index(js), pred=ok)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        res = gl.convert_layout(acc, out_layout)
        rows = mb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))  # [BLOCK_M]
        mask = (rows[None, :] < M) & (cols[:, None] < N)
        if SPLIT_K == 1:
            gl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            gl.store(part_ptr + pid_k * M * N + rows[None, :] * N + cols[:, None], res, mask=mask)

    mbarrier.invalidate(w_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(x_bars.index(s))

    if SPLIT_K > 1:
        gl.thread_barrier()  # every thread's partial stores precede the arrival
        if gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            gl.atomic_xchg(cnt_ptr + pid_n, 0)
            for mb in range(num_m):
                rows = mb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
                mask = (rows[None, :] < M) & (cols[:, None] < N)
                ptrs = part_ptr + rows[None, :] * N + cols[:, None]
                tot = gl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in gl.static_range(1, SPLIT_K):  # split order: deterministic
                    tot += gl.load(ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], tot.to(out_ptr.dtype.element_ty),
                         mask=mask)


def block_m_for(m: int) -> int:
    return min(max(16, triton.next_power_of_2(m)), 128)


X_RING_BYTES = {"ring": 48 << 10, "all_x": 96 << 10}  # shared memory for x tiles in flight


def stages_for(block_m: int, block_n: int, k_tiles: int, ring: str) -> int:
    """x tiles in flight: up to all of a row block's K tiles (one round trip to L2) within the ring's bytes and
    what the weights and the epilogue's layout conversion leave of the 227 KB."""
    tile = block_m * BLOCK_K * 2
    left = (216 << 10) - k_tiles * block_n * BLOCK_K * 2 - block_n * block_m * 4
    return max(2, min(k_tiles, X_RING_BYTES[ring] // tile, left // tile))


def smem_weights_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int], pdl: bool,
                        ring: str = "ring") -> torch.Tensor:
    """x @ w.T with the kernel above; cfg = (BLOCK_N, SPLIT_K, warps)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bn, split, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    assert k % (BLOCK_K * split) == 0 and n % bn == 0
    bm = block_m_for(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, BLOCK_K],
                              gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], gl.bfloat16))
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, BLOCK_K],
                              gl.NVMMASharedLayout.get_default_for([bn, BLOCK_K], gl.bfloat16))
    _smem_weights_gemm_kernel[(n // bn, split)](
        x_desc, w_desc, part, out, arrival_counters(x.device, n // bn), m, n, out.stride(0), BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=BLOCK_K,
        K_TILES=k // (BLOCK_K * split), SPLIT_K=split, STAGES=stages_for(bm, bn, k // (BLOCK_K * split), ring), PDL=pdl, num_warps=warps,
        **({"launch_pdl": True} if pdl else {}))
    return out


def compile_only() -> int:
    """Compile every (shape, config, BLOCK_M) for sm_90a here (no GPU needed) and print its shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _smem_weights_gemm_kernel
    names = fn.arg_names
    for cname, (cfgs, ring) in CONFIGS.items():
        for name, _n, k in LAYER:
            bn, split, warps = cfgs[name]
            for bm in (16, 32, 64, 128):
                xl = gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], gl.bfloat16)
                wl = gl.NVMMASharedLayout.get_default_for([bn, BLOCK_K], gl.bfloat16)
                sig = {"x_desc": f"tensordesc<bf16[{bm}, {BLOCK_K}],{xl!r}>",
                       "w_desc": f"tensordesc<bf16[{bn}, {BLOCK_K}],{wl!r}>",
                       "part_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
                       "stride_om": "i32"}
                const = dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=BLOCK_K, K_TILES=k // (BLOCK_K * split), SPLIT_K=split,
                             STAGES=stages_for(bm, bn, k // (BLOCK_K * split), ring), PDL=True, num_warps=warps)
                for c in const:
                    sig[c] = "constexpr"
                src = GluonASTSource(fn, {nm: sig[nm] for nm in names},
                                     constexprs={(names.index(c),): v for c, v in const.items()})
                kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
                print(f"{cname:15s} {name:8s} BLOCK_M {bm:3d}: smem {kern.metadata.shared // 1024} KB, "
                      f"regs {getattr(kern, 'n_regs', '?')}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--pdl-only", action="store_true", help="time only the PDL launches of each config")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    sys.path.insert(0, "benchmarks")
    from kernels import graph_medians_in_turn, layer_gemm_weights

    torch.manual_seed(0)
    dev = "cuda"
    ok = True
    # correctness: every shape and config at awkward row counts, split K and several row blocks included
    for cname in args.configs.split(","):
        for name, n, k in LAYER:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            for m in (1, 17, 48, 100, 128, 200, 256):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = F.linear(x.float(), w.float())
                for pdl in (False, True):
                    cfgs, ring = CONFIGS[cname]
                    got = smem_weights_linear(x, w, cfgs[name], pdl, ring).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if not err < 1e-2:
                        ok = False
                        print(f"MISMATCH {cname} {name} M={m} pdl={pdl}: rel err {err:.3g}", flush=True)
    print("correctness:", "all passed" if ok else "FAILED", flush=True)
    if not ok:
        return 1

    weights = layer_gemm_weights(args.layers, dev)
    lines = []
    for m in [int(v) for v in args.ms.split(",")]:
        x0 = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)

        def chain(linear, x0=x0):
            def body():
                x = x0
                for wo, wgu, wd, wqkv in weights:
                    h = linear("o_proj", x, wo)
                    g = linear("gate_up", h, wgu)
                    d = linear("down", g[:, :3072], wd)
                    x = linear("qkv", d, wqkv)[:, :2048]
                return x
            return body

        variants = {"cuBLAS": chain(lambda name, x, w: F.linear(x, w))}
        for cname in args.configs.split(","):
            cfgs, ring = CONFIGS[cname]
            variants[f"{cname} PDL"] = chain(lambda name, x, w, c=cfgs, r=ring: smem_weights_linear(x, w, c[name], True, r))
            if not args.pdl_only:
                variants[f"{cname} no PDL"] = chain(
                    lambda name, x, w, c=cfgs, r=ring: smem_weights_linear(x, w, c[name], False, r))
        # the chains agree with cuBLAS's (checks the strided x views and the graphs)
        ref = variants["cuBLAS"]().float()
        for name, fn in variants.items():
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 5e-2:
                print(f"CHAIN MISMATCH M={m} {name}: {err:.3g}", flush=True)
                ok = False
        res = graph_medians_in_turn(variants, args.rounds, args.layers)
        if not lines:
            lines = ["| M | " + " | ".join(variants) + " |", "| --- " * (1 + len(variants)) + "|"]
        lines.append(f"| {m} | " + " | ".join(f"{res[v]:.1f}" for v in variants) + " |")
        print(lines[-1], flush=True)
    print("(us per layer: o_proj, gate_up, down, qkv; 28 layers chained in one CUDA graph)")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
