"""Compile the decode-attention kernel for an H100 (sm_90a) on any machine, CPU included, and print what
the GPU would run: registers and spills per thread, shared memory, the instruction mix of the PTX, and the
length and mix of the SASS tile loop (what each warp issues per tile of KV).

    python benchmarks/decode_ptx.py [--kv fp8|bf16] [--block-n 64] [--warps 4] [--stages 3] [--v-dequant-in-tile]
                                    [--per-token-addressing]

Triton compiles ahead of time here with the specialization the JIT applies on the GPU (pointers and
strides divisible by 16; `stride_bt` is not specialized), and the cubin is built by the ptxas bundled
with Triton. Use it to check a kernel change costs no registers or byte-wise shared-memory loads before
spending device time on timing it. The fp8 kernel is bound by instruction issue (Nsight Compute, RESULTS
session 7), so there the tile loop's instruction count predicts speed; the bf16 kernel is bound by bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nvcli.kernels.decode_attention import _decode_split_kernel

WATCH = ["ld.global", "cp.async.cg", "cp.async.ca", "ld.shared.b8", "ld.shared", "st.shared", "ldmatrix",
         "mma.sync", "wgmma", "cvt.rn.f16x2.e4m3x2", "cvt.f32.f16", "ex2.approx", "st.local", "ld.local"]


def compile_decode(kv: str, block_n: int, warps: int, stages: int, v_tile: bool, run_addr: bool = True,
                   rope: bool = False, ordered: bool = False, page: int | None = None,
                   maxnreg: int | None = None):
    """The kernel as the engine launches it at big batches (no splits, no PDL); fp8 with 32-token pages has V
    dims-major (kv_layout.py), as the engine's default fp8 cache does."""
    fp8 = kv == "fp8"
    page = page or (32 if fp8 else 16)
    v_t = fp8 and page == 32
    kv_t = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {
        "q_ptr": "*bf16", "k_cache_ptr": kv_t, "v_cache_ptr": kv_t, "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
        "counter_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "q_rot_ptr": "*bf16",
        "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "qw_ptr": "*bf16",
        "kw_ptr": "*bf16", "slot_ptr": "*i64", "order_ptr": "*i32", "rs_ptr": "*bf16",
    }
    floats = {"k_scale_val", "v_scale_val", "qk_scale", "eps", "rs_eps"}
    const = dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, PAGE=page, BLOCK_N=block_n, DIRECT=True, SCALE_IS_PTR=True,
                 DOT_PREC="tf32", F16_DOT=fp8, PDL=False, KVH_MAJOR=True, FUSED_REDUCE=False, SPLITS_PAD=1,
                 ROPE=rope, ROPE_NORM=rope, ROPE_GROUP_PAD=2, ROPE_ROW_SCALE=False, RS_BLOCK=16, ROPE_QUANT=fp8, FP8_MAX=448.0, L2_PREFETCH=False,
                 KV_LINES=1 if fp8 else 2, V_CONVERT_AT_LOAD=v_tile and fp8 and not v_t, SUB=min(page, block_n),
                 RUN_ADDR=run_addr or v_t, V_T=v_t, V_LINES=128 * page * (1 if fp8 else 2) // 128, ORDERED=ordered)
    names = _decode_split_kernel.arg_names
    sig = {n: "constexpr" if n in const else pointers.get(n) or ("fp32" if n in floats else "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_bt")]
    src = ASTSource(fn=_decode_split_kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages,
                                                                                 maxnreg=maxnreg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--v-dequant-in-tile", action="store_true")
    ap.add_argument("--per-token-addressing", action="store_true", help="K/V addresses per token (the old loop)")
    ap.add_argument("--rope", action="store_true", help="the rotary step folded in (the engine's decode launches)")
    ap.add_argument("--ordered", action="store_true", help="programs take sequences through an order array")
    ap.add_argument("--page", type=int, default=0, help="KV page size (default: 32 for fp8, 16 for bf16)")
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap per thread (ptxas .maxnreg)")
    args = ap.parse_args()
    kernel = compile_decode(args.kv, args.block_n, args.warps, args.stages, args.v_dequant_in_tile,
                            not args.per_token_addressing, args.rope, args.ordered, args.page or None,
                            args.maxnreg or None)
    cubin = Path("/tmp") / f"nv_decode_{args.kv}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    res = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    regs, stack = (int(res.group(1)), int(res.group(2))) if res else (-1, -1)
    counts = collections.Counter()
    for line in kernel.asm["ptx"].splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        for w in WATCH:
            if op.startswith(w):
                counts[w] += 1
                break
    per_sm = min(65536 // max(1, ((regs + 7) // 8 * 8) * 32 * args.warps), (228 << 10) // max(1, kernel.metadata.shared))
    print(f"decode attention, {args.kv} cache, block_n {args.block_n}, {args.warps} warps, {args.stages} stages"
          f"{', V dequantized per tile' if args.v_dequant_in_tile else ''}{', rotary' if args.rope else ''}"
          f"{', ordered' if args.ordered else ''}: {regs} registers/thread, {stack} bytes "
          f"of stack (spills), {kernel.metadata.shared} bytes of shared memory -> {per_sm} programs per SM")
    print("PTX instructions (static count in the kernel body): "
          + ", ".join(f"{w} {counts[w]}" for w in WATCH if counts[w]))
    body = loop_body(subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout)
    print(f"SASS of the tile loop: {len(body)} instructions per warp and tile; most frequent: "
          + ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(12)))
    return 0


def loop_body(sass: str) -> list[str]:
    """Opcodes of the longest backward branch's span: the tile loop, what each warp issues per tile (the fp8
    kernel is bound by instruction issue, not bandwidth, so this count is what a change must lower)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    lo = hi = -1
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > hi - lo:
            lo, hi = int(target.group(1), 16), addr
    return [op for addr, op, _ in ins if lo <= addr <= hi]


if __name__ == "__main__":
    sys.exit(main())
