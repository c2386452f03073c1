"""Would the decoder's GEMMs get faster if attention pulled their weights into L2 while it runs?

    PYTHONPATH=. python3 benchmarks/l2_weights_gpu.py [--ms 32,64,128,256]

Session 14's question. A decode step's GEMMs at 17-256 rows take about twice the time their weight
reads take at copy bandwidth (session 13: 5-9 us per GEMM, latency rather than bandwidth), while
decode attention, which runs just before them, is bandwidth-bound for 100-300 us per layer. If the
attention kernel prefetched the weights that the layer reads between one attention and the next
(o_proj, gate_up, down, the next layer's qkv: 31 MB) into L2 with an evict_last hint, and streamed
its own KV with evict_first, the GEMMs would read L2 instead of HBM. The bytes are the same; they
move into a phase that streams at full bandwidth.

This measures the bound and the real thing on synthetic stand-ins, one CUDA graph per variant of 28
layers (28 distinct weight sets, 870 MB, cold as in a decode step):
- "GEMMs cold" / "GEMMs hot": the layer's four cuBLAS GEMMs on distinct weights / on one weight set
  that stays in L2 (the bound on what L2 can give).
- "stream + GEMMs": a KV-like streaming kernel first (M * 8 programs, each summing T tokens of 512
  bytes, as decode attention's programs read a head's K and V), then the GEMMs.
- "+ evict_first": the stream's loads marked evict_first.
- "+ prefetch": the stream's programs also issue `prefetch.global.L2::evict_last` for an equal share
  of the layer's weight lines when they start.
Time per layer, median of two rounds in turn; the gain is "stream + GEMMs" minus the variant.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels import LAYER_GEMMS, graph_medians_in_turn

TOKENS = {32: 1500, 64: 1400, 128: 1000, 256: 800}  # context lengths of the workload at those batch sizes


@triton.jit
def _prefetch_l2_evict_last(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stream_kernel(kv_ptr, out_ptr, w_ptr, tokens, w_lines, BLOCK_T: tl.constexpr, EVICT_FIRST: tl.constexpr,
                   PREFETCH: tl.constexpr, PF_LINES: tl.constexpr):
    """Program p sums its `tokens` x 256 bf16 (a head's K and V); with PREFETCH it first prefetches its
    share of `w_lines` 128-byte weight lines."""
    pid = tl.program_id(0)
    if PREFETCH:
        per = tl.cdiv(w_lines, tl.num_programs(0))
        line = pid * per + tl.arange(0, PF_LINES)
        keep = (line < w_lines) & (tl.arange(0, PF_LINES) < per)
        _prefetch_l2_evict_last(w_ptr + tl.where(keep, line, 0).to(tl.int64) * 64)
    base = kv_ptr + pid.to(tl.int64) * tokens * 256
    offs = tl.arange(0, BLOCK_T)[:, None] * 256 + tl.arange(0, 256)[None, :]
    acc = tl.zeros([BLOCK_T, 256], dtype=tl.float32)
    for t in range(0, tokens, BLOCK_T):
        mask = (t + tl.arange(0, BLOCK_T))[:, None] < tokens
        if EVICT_FIRST:
            x = tl.load(base + t * 256 + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(base + t * 256 + offs, mask=mask, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def measure(m: int, layers: int, rounds: int, flat: torch.Tensor, weights: list, w_lines: int) -> str:
    """The table row for batch size m."""
    dev = "cuda"
    tokens = TOKENS.get(m, 1000)
    programs = m * 8
    kv = torch.randn(programs * tokens * 256, device=dev, dtype=torch.bfloat16)
    sums = torch.empty(programs, device=dev, dtype=torch.float32)
    x0 = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    pf_lines = triton.next_power_of_2(triton.cdiv(w_lines, programs))

    def gemms(ws):
        x = x0
        for w in ws:  # each output has at least the next GEMM's K columns
            x = F.linear(x[:, :w.shape[1]], w)
        return x

    def stream(i, evict_first, prefetch):
        _stream_kernel[(programs,)](kv, sums, flat[i], tokens, w_lines, BLOCK_T=16, EVICT_FIRST=evict_first,
                                    PREFETCH=prefetch, PF_LINES=pf_lines, num_warps=4)

    def layered(evict_first=None, prefetch=False, hot=False, gemm=True):
        def body():
            for i in range(layers):
                if evict_first is not None:
                    stream(i, evict_first, prefetch)
                if gemm:
                    gemms(weights[0] if hot else weights[i])
        return body

    variants = {"cold": layered(), "hot": layered(hot=True), "stream": layered(False, gemm=False),
                "stream+gemms": layered(False), "ef": layered(True), "pf": layered(False, True),
                "ef+pf": layered(True, True)}
    med = graph_medians_in_turn(variants, rounds, layers)
    gain = med["stream+gemms"] - min(med["pf"], med["ef+pf"])
    line = (f"| {m} | {programs * tokens * 512 / 1e6:.0f} MB | {med['cold']:.1f} | {med['hot']:.1f} | "
            f"{med['stream']:.1f} | {med['stream+gemms']:.1f} | {med['ef']:.1f} | {med['pf']:.1f} | "
            f"{med['ef+pf']:.1f} | {gain:+.1f} |")
    print(line, flush=True)
    return line


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    layer_elems = sum(n * k for _, n, k in LAYER_GEMMS)
    flat = torch.randn(args.layers, layer_elems, device=dev, dtype=torch.bfloat16) * 0.02  # a layer's weights, in order
    weights = []
    for i in range(args.layers):
        views, off = [], 0
        for _, n, k in LAYER_GEMMS:
            views.append(flat[i, off:off + n * k].view(n, k))
            off += n * k
        weights.append(views)
    w_lines = layer_elems * 2 // 128
    print(f"a layer's weights: {layer_elems * 2 / 1e6:.1f} MB = {w_lines} lines", flush=True)
    lines = ["| M | KV per layer | GEMMs cold | GEMMs hot | stream | stream + GEMMs | + evict_first | + prefetch "
             "| + evict_first + prefetch | gain |", "| --- " * 10 + "|"]
    for m in [int(v) for v in args.ms.split(",")]:
        lines.append(measure(m, args.layers, args.rounds, flat, weights, w_lines))
    print("(us per layer; a step has 28 layers)\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
