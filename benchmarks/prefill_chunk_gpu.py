"""Prefill attention at a long job's mixed-step shape: one fresh prompt chunk of L tokens after 128 one-token rows,
in a few-chunk mixed graph (8 chunk slots, graph-padded tokens, max_query_len = the graph's tokens), bf16, 16-token
pages. Sweeps the kernel's tile configs against the engine's default; us per call from CUDA-graph replays.

    PYTHONPATH=. python3 benchmarks/prefill_chunk_gpu.py [--lengths 256,562,1024,1800]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from nvcli.engine.cuda_graphs import mixed_graph_sizes
from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

HEADS, KV_HEADS, HEAD_DIM, PAGE, DECODE_ROWS, CHUNK_SLOTS = 16, 8, 128, 16, 128, 8


def case(length: int) -> tuple[dict, int]:
    tokens = next(s for s in mixed_graph_sizes(8192) if s >= DECODE_ROWS + length)
    pages = (length + PAGE - 1) // PAGE
    num_blocks = 4096
    k = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qsl = torch.full((CHUNK_SLOTS + 1,), DECODE_ROWS + length, dtype=torch.int32, device="cuda")
    qsl[0] = DECODE_ROWS
    lens = torch.zeros(CHUNK_SLOTS, dtype=torch.int32, device="cuda")
    lens[0] = length
    tables = torch.zeros(CHUNK_SLOTS, 256, dtype=torch.int32, device="cuda")
    tables[0, :pages] = torch.randperm(num_blocks, device="cuda")[:pages].to(torch.int32)
    out = torch.zeros_like(q)
    args = dict(q=q, kv=PagedKV(k, v), query_start_loc=qsl, seq_lens=lens, block_tables=tables,
                max_query_len=tokens, max_seq_len=0, scale=HEAD_DIM**-0.5, out=out)
    return args, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,562,1024,1800")
    lengths = [int(x) for x in ap.parse_args().lengths.split(",")]
    configs = [None] + list(itertools.product([32, 64, 128], [32, 64], [4, 8], [2, 3]))
    rows = []
    for length in lengths:
        args, tokens = case(length)
        ref = paged_prefill_attention_triton(**args).clone()
        flops = 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
        timings = []
        for cfg in configs:
            kw = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))
            try:
                got = paged_prefill_attention_triton(**args, **kw)
                rows_ = slice(DECODE_ROWS, DECODE_ROWS + length)
                err = (got[rows_].float() - ref[rows_].float()).abs().max().item()
                us = triton.testing.do_bench_cudagraph(lambda kw=kw, args=args: paged_prefill_attention_triton(**args, **kw)) * 1e3
            except Exception as e:  # noqa: BLE001  (a config that does not compile: shared memory)
                print(f"L={length} {cfg}: {type(e).__name__}", flush=True)
                continue
            timings.append((us, cfg, err))
        timings.sort(key=lambda t: t[0])
        default = next(t for t in timings if t[1] is None)
        best = timings[0]
        print(f"L={length} ({tokens}-token graph): default {default[0]:.1f} us ({flops / default[0] / 1e6:.0f} TFLOP/s); "
              "best " + ", ".join(f"{c} {u:.1f} us (err {e:.1e})" for u, c, e in timings[:4]), flush=True)
        rows.append((length, tokens, default[0], best[0], best[1]))
    print("\n| chunk tokens | graph tokens | default (us) | best (us) | best config (block_m, block_n, warps, stages) |")
    print("| --- | --- | --- | --- | --- |")
    for length, tokens, d, b, c in rows:
        print(f"| {length} | {tokens} | {d:.1f} | {b:.1f} | {c} |")


if __name__ == "__main__":
    main()
