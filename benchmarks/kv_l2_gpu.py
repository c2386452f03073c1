"""Would decode attention get faster if part of its KV were pulled into L2 while the GEMMs run?

    PYTHONPATH=. python3 benchmarks/kv_l2_gpu.py [--ms 32,64,128,256] [--mbs 16,32,48] [--layers 8]

Session 15's question, the converse of session 14's (l2_weights_gpu.py). Between two decode
attentions a layer runs its GEMM chain: at 17-256 rows it takes 30-40 us and reads 31 MB of
weights, so HBM streams at about a third of its bandwidth, waiting on latency. The next
attention then streams 100-900 MB of KV at copy bandwidth. The KV of earlier tokens does not
depend on the chain, so its first bytes could stream into L2 while the chain runs: every byte the
attention then finds in L2 is a byte less at the bandwidth bound (32 MB at 3 TB/s is 10.7 us of a
layer's 130-340 us).

A prefetch kernel issues `prefetch.global.L2` (optionally `::evict_last`) for the first
`tokens` K and V rows of each of the attention's first `--wave` programs, in the attention grid's
order (KV heads side by side, rows through `order`, splits last), so it fetches what the first
wave of resident programs reads first. The bytes prefetched per layer are the MB column.

Variants, one CUDA graph each of `--layers` layers, every layer with its own weights and KV cache
(cold in L2, as in a decode step), time per layer:
- base: the four cuBLAS GEMMs (o_proj, gate_up, down, qkv), then the engine's decode attention;
- serial: the prefetch kernel first on the same stream (its prefetches stay in flight after it ends);
- side: the prefetch kernel on a forked stream, joined before the attention;
- attn / attn+pf: attention alone, without and with the prefetch just before it (what L2 can give
  when nothing else runs).
Outputs are checked bitwise against base (a prefetch changes no data).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from decode_variants import workload_lens
from kernels import graph_medians_in_turn, layer_gemm_weights, paged_kv

from nvcli.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton

STEP = {32: 950, 64: 850, 128: 500, 256: 300}  # decode steps into the workload at those batch sizes
BLOCK_N = 64  # the decode kernel's bf16 tile: a split's length is a multiple of it
KV_HEADS, HEAD_DIM, PAGE = 8, 128, 16


@triton.jit
def _prefetch(ptrs, EVICT_LAST: tl.constexpr):
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_first_wave(k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, num_seqs, num_splits, tokens, stride_bt,
                         stride_kb, stride_kt, stride_kh, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, LINES: tl.constexpr, TILE: tl.constexpr,
                         EVICT_LAST: tl.constexpr):
    """Program p prefetches the first `tokens` K and V rows of decode attention's program p."""
    p = tl.program_id(0)
    kvh = p % NUM_KV_HEADS
    row = (p // NUM_KV_HEADS) % num_seqs
    split = p // (NUM_KV_HEADS * num_seqs)
    seq = tl.load(order_ptr + row)
    seq_len = tl.load(lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(tl.minimum(start + split_len, seq_len), start + tokens)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    lines = tl.arange(0, LINES) * 64  # first bf16 element of each 128-byte line of a head's row
    for t in range(start, end, TILE):
        pos = tl.minimum(t + tl.arange(0, TILE), end - 1)
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
        row_off = blk * stride_kb + (pos % PAGE).to(tl.int64) * stride_kt + kvh * stride_kh
        _prefetch(k_ptr + row_off[:, None] + lines[None, :], EVICT_LAST)
        _prefetch(v_ptr + row_off[:, None] + lines[None, :], EVICT_LAST)


def measure(m: int, layers: int, rounds: int, mbs: list[int], wave: int, weights: list) -> list[str]:
    dev = "cuda"
    lens = workload_lens(m, STEP.get(m, 500), 1)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    gen = torch.Generator().manual_seed(m)
    caches = [paged_kv(lens, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16, dev, gen=gen) for _ in range(layers)]
    kv_mb = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2 / 1e6
    splits = choose_num_splits(m, KV_HEADS, caches[0][2].shape[1] * PAGE, BLOCK_N, 132)
    programs = min(wave, m * KV_HEADS * splits)
    x0 = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def attention(i: int, qkv: torch.Tensor) -> torch.Tensor:
        k, v, bt = caches[i]
        q = qkv[:, : 16 * HEAD_DIM].view(m, 16, HEAD_DIM)
        return paged_decode_attention_triton(q, k, v, bt, sl, scale, order=order).view(m, 2048)

    def chain(i: int, x: torch.Tensor) -> torch.Tensor:
        o, gate_up, down, qkv = weights[i % len(weights)]
        h = F.linear(x, o)
        h = F.linear(h, gate_up)[:, :3072].contiguous()  # stands in for SiLU-and-mul
        h = F.linear(h, down)
        return F.linear(h, qkv)

    def prefetch(i: int, mb: int, evict_last: bool) -> None:
        k, v, bt = caches[i]
        tokens = max(1, int(mb * 1e6 / (programs * 2 * HEAD_DIM * 2)))
        _prefetch_first_wave[(programs,)](k, v, bt, sl, order, m, splits, tokens, bt.stride(0), k.stride(0),
                                          k.stride(1), k.stride(2), NUM_KV_HEADS=KV_HEADS, PAGE=PAGE,
                                          BLOCK_N=BLOCK_N, LINES=HEAD_DIM * 2 // 128, TILE=32,
                                          EVICT_LAST=evict_last, num_warps=1)

    side = torch.cuda.Stream()

    def layered(mode: str, mb: int = 0, evict_last: bool = True, gemms: bool = True):
        def body() -> torch.Tensor:
            x = x0
            for i in range(layers):
                if mode == "side":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        prefetch(i, mb, evict_last)
                elif mode == "serial":
                    prefetch(i, mb, evict_last)
                qkv = chain(i, x) if gemms else torch.cat([x, x], dim=1)
                if mode == "side":
                    torch.cuda.current_stream().wait_stream(side)
                x = attention(i, qkv)
            return x
        return body

    variants = {"base": layered("base"), "attn": layered("base", gemms=False)}
    for mb in mbs:
        variants[f"serial {mb}"] = layered("serial", mb)
        variants[f"side {mb}"] = layered("side", mb)
        variants[f"attn+pf {mb}"] = layered("serial", mb, gemms=False)
    variants[f"serial {mbs[-1]} normal"] = layered("serial", mbs[-1], evict_last=False)
    ref = variants["base"]()
    for name, body in variants.items():
        if "attn" not in name:
            assert torch.equal(body(), ref), f"{name}: output differs from base"
    torch.cuda.synchronize()
    med = graph_medians_in_turn(variants, rounds, layers)
    head = f"{m} x ~{sum(lens) // m} ({kv_mb:.0f} MB KV, {splits} split(s), {programs} programs prefetched)"
    rows = [f"| {head} | base | {med['base']:.1f} | | attn alone | {med['attn']:.1f} | |"]
    for name in variants:
        if name.startswith("serial") or name.startswith("side"):
            rows.append(f"| | {name} MB | {med[name]:.1f} | {med[name] - med['base']:+.1f} | | | |")
        elif name.startswith("attn+pf"):
            rows.append(f"| | | | | {name} MB | {med[name]:.1f} | {med[name] - med['attn']:+.1f} |")
    for r in rows:
        print(r, flush=True)
    caches.clear()
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--mbs", default="16,32,48", help="MB of KV prefetched per layer")
    ap.add_argument("--wave", type=int, default=396, help="attention programs whose first rows are prefetched")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = layer_gemm_weights(args.layers, "cuda")
    mbs = [int(v) for v in args.mbs.split(",")]
    lines = ["| batch | variant | us per layer | vs base | | us per layer | vs attn |", "| --- " * 7 + "|"]
    for m in [int(v) for v in args.ms.split(",")]:
        lines += measure(m, args.layers, args.rounds, mbs, args.wave, weights)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
