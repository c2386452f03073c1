"""Which fixed configurations should --batch-invariant's kernels take? Times the batch-invariant GEMM
(kernels/invariant_matmul.py) per tile configuration on Qwen3-0.6B's weight shapes at decode and prompt row counts,
beside cuBLAS, and the prefill attention kernel in its invariant form per query-tile height on one-token rows and on
prompt chunks, beside the default kernels. A configuration may depend on the weight's shape (or the model's heads),
never on the row count. Microseconds, median of triton.testing.do_bench_cudagraph.

    PYTHONPATH=. python3 benchmarks/invariant_tiles_gpu.py [--sections gemms,attention,attention-fp8]
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from nvcli.kernels.decode_attention import paged_decode_attention_triton
from nvcli.kernels.invariant_matmul import Tiles, invariant_linear_triton
from nvcli.kernels.kv_layout import PagedKV, allocate_kv_cache
from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

SHAPES = [("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
          ("lm_head", 151936, 1024)]
ROWS = [1, 32, 128, 256, 2048, 8192]
TILES = [Tiles(64, 128), Tiles(32, 128), Tiles(64, 64), Tiles(32, 64), Tiles(16, 64), Tiles(128, 128, num_warps=8),
         Tiles(64, 256, num_warps=8)]


def us(fn) -> float:
    """Microseconds per call; replayed from a CUDA graph (as the engine's steps are), so that a few-row GEMM's host
    launch time does not stand in for its GPU time."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=40) * 1000


def gemms(tiles: list[Tiles], shapes: list[str], rows: list[int]) -> None:
    dev = torch.device("cuda")
    print("| shape | rows | cuBLAS | "
          + " | ".join(f"{t.block_m}x{t.block_n}x{t.block_k}/{t.num_warps}w/{t.num_stages}s" for t in tiles) + " |")
    print("| --- " * (3 + len(tiles)) + "|")
    for name, n, k in SHAPES:
        if name not in shapes:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        for m in rows:
            if name == "lm_head" and m > 256:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cells = [f"{us(lambda x=x, w=w: F.linear(x, w)):.1f}"]
            for t in tiles:
                cells.append(f"{us(lambda t=t, x=x, w=w: invariant_linear_triton(x, w, tiles=t)):.1f}")
            print(f"| {name} | {m} | " + " | ".join(cells) + " |")


def attention(kv: str, configs: list[dict]) -> None:
    """`kv`: bf16 (16-token pages) or fp8 (32-token pages, V dims-major, fixed scales: the engine's fp8 cache).
    `configs`: the invariant kernel's launch settings to time (block_m, and block_n / num_warps where given)."""
    dev = torch.device("cuda")
    rnd = random.Random(0)
    heads, kv_heads, dim = 16, 8, 128
    page = 32 if kv == "fp8" else 16
    lens = [rnd.randint(100, 1100) for _ in range(128)]
    blocks = sum(-(-n // page) for n in lens) + 8 * (1024 // page) + 8
    if kv == "fp8":
        storage, (cache,) = allocate_kv_cache(1, blocks, page, kv_heads, dim, torch.float8_e4m3fn, dev, scale=0.05)
        storage.copy_((torch.randn(storage.shape, device=dev) * 0.5).to(torch.float8_e4m3fn))
    else:
        k_cache = torch.randn(blocks, page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        cache = PagedKV(k_cache, torch.randn_like(k_cache))
    perm = torch.randperm(blocks, device=dev).to(torch.int32)
    tables = torch.zeros(128, 2048 // page, dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(lens):
        nb = -(-n // page)
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(128, heads, dim, device=dev, dtype=torch.bfloat16)
    one_each = torch.arange(129, dtype=torch.int32, device=dev)
    scale = dim**-0.5
    # eight 1,024-token prompt chunks (prompt step)
    per = 1024 // page
    p_tables = torch.stack([perm[at + per * i : at + per * (i + 1)] for i in range(8)])
    p_lens = torch.full((8,), 1024, dtype=torch.int32, device=dev)
    p_qsl = torch.arange(0, 8 * 1024 + 1, 1024, dtype=torch.int32, device=dev)
    pq = torch.randn(8 * 1024, heads, dim, device=dev, dtype=torch.bfloat16)
    dec = us(lambda: paged_decode_attention_triton(q, cache, tables, seq_lens, scale))
    pre = us(lambda: paged_prefill_attention_triton(pq, cache, p_qsl, p_lens, p_tables, 1024, 1024, scale))
    print(f"\n| attention, {kv} cache | default kernel | "
          + " | ".join("invariant, " + " ".join(f"{k}={v}" for k, v in c.items()) for c in configs) + " |")
    print("| --- " * (2 + len(configs)) + "|")
    row_d, row_p = [f"{dec:.1f}"], [f"{pre:.1f}"]
    for c in configs:
        kw = dict(c, invariant=True)
        row_d.append(f"{us(lambda kw=kw: paged_prefill_attention_triton(q, cache, one_each, seq_lens, tables, 1, 0, scale, **kw)):.1f}")
        row_p.append(f"{us(lambda kw=kw: paged_prefill_attention_triton(pq, cache, p_qsl, p_lens, p_tables, 1024, 0, scale, **kw)):.1f}")
    print("| 128 one-token rows, 100-1,100 tokens of KV | " + " | ".join(row_d) + " |")
    print("| 8 prompt chunks of 1,024 tokens | " + " | ".join(row_p) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="gemms,attention", help="gemms, attention (bf16 cache), attention-fp8")
    ap.add_argument("--tiles", default=None, metavar="MxNxK[xWARPSxSTAGES],...",
                    help="the GEMM configurations to time (default: a fixed list)")
    ap.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--configs", default="128,64,32,16",
                    help="the invariant attention's settings, comma-separated: block_m or block_m x block_n x num_warps")
    args = ap.parse_args()
    sections = args.sections.split(",")
    names = ("block_m", "block_n", "num_warps")
    rows = [dict(zip(names, map(int, c.split("x")))) for c in args.configs.split(",")]
    if "gemms" in sections:
        tiles = TILES if args.tiles is None else [Tiles(*map(int, t.split("x"))) for t in args.tiles.split(",")]
        gemms(tiles, args.shapes.split(","), [int(r) for r in args.rows.split(",")])
    if "attention" in sections:
        attention("bf16", rows)
    if "attention-fp8" in sections:
        attention("fp8", rows)
