"""Prefill attention at prompt-step shapes: the step's own K/V through the block table or from the projection's rows.

    PYTHONPATH=. python3 benchmarks/prefill_gpu.py [--sweep]

A prompt step's keys and values are the qkv projection's rows: contiguous, one row per token. The paged kernel
gathers them back out of the cache a token at a time through the block table; with `k_new` / `v_new` it reads them
from those rows (pointer loads, or TMA descriptors with `kv_desc`) and only a cached prefix from the pages. Shapes
(one layer, bf16, 16 query / 8 KV heads of 128, 16-token pages):
- the DESIGN workload's first prompt step: prompts of randint(100, 1024) tokens packed up to 16,384;
- 16 prompts of 1,000 tokens (a prompt-heavy job's step);
- 8 prompts of 1,024 (the shape of the kernel table in RESULTS.md);
- steps after a cached prefix (a shared system prompt): 64 x 128 new tokens after 2,048, 16 x 512 after 512.
Rows: median of do_bench per variant, TFLOP/s of the causal products, max |difference| from the paged kernel.
torch's flash-attention varlen forward (FA2, contiguous K/V) is timed beside them as a reference rate.
--sweep adds tile shapes (block_m / block_n / warps / stages) for the step-row variants.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels as kb  # noqa: E402

from nvcli.kernels.prefill_attention import paged_prefill_attention_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3),
         (64, 64, 8, 3), (32, 64, 4, 3)]


def workload_step(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < 16384 - 1024:
        lens.append(rng.randint(100, 1024))
    return lens


def study(label: str, lens: list[int], sweep: bool, dev: str, prefix: int = 0) -> list[str]:
    """prefix: every sequence has that many tokens cached before the step's `lens` (a shared system prompt)."""
    torch.manual_seed(0)
    t = sum(lens)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev).to(torch.bfloat16)
    q = qkv[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
    k_new = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
    v_new = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(t, KV_HEADS, HEAD_DIM)
    full = [prefix + n for n in lens]
    k_cache, v_cache, tables = kb.paged_kv(full, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16, dev, table_width=256)
    # the cache holds the same rows at the step's positions, as the rotary kernel's store leaves it
    pos = [torch.arange(prefix, prefix + n, device=dev) for n in lens]
    slots = torch.cat([tables[s, p // PAGE].long() * PAGE + p % PAGE for s, p in enumerate(pos)])
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = k_new
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = v_new
    qsl = kb.i32([sum(lens[:i]) for i in range(len(lens) + 1)], dev)
    sl = kb.i32(full, dev)
    flops = sum(4 * (n * (n + 1) // 2 + n * prefix) * HEADS * HEAD_DIM for n in lens)
    call = functools.partial(paged_prefill_attention_triton, q, k_cache, v_cache, qsl, sl, tables, max(lens),
                             max(full), HEAD_DIM**-0.5)
    base = call()
    rows = []

    def row(name: str, fn) -> None:
        try:
            out = fn()
            err = (out.float() - base.float()).abs().max().item()
            sec = kb.bench(fn, True)
        except Exception as e:  # out of shared memory, an API this torch lacks, ...
            rows.append(f"| {label} | {name} | {type(e).__name__}: {str(e)[:60]} | | |")
            print(rows[-1], flush=True)
            return
        rows.append(f"| {label} | {name} | {sec * 1e6:.0f} | {flops / sec / 1e12:.0f} | {err:.1e} |")
        print(rows[-1], flush=True)

    row("paged (engine before)", call)
    row("step rows, pointers", functools.partial(call, k_new=k_new, v_new=v_new, kv_desc=False))
    row("step rows, TMA", functools.partial(call, k_new=k_new, v_new=v_new, kv_desc=True))
    if sweep:
        row("paged, 64/64/4/3", functools.partial(call, block_m=64, block_n=64, num_warps=4, num_stages=3))
        for bm, bn, w, st in SWEEP:
            knobs = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            for desc in (False, True):
                row(f"step rows, {'TMA' if desc else 'pointers'}, {bm}/{bn}/{w}/{st}",
                    functools.partial(call, k_new=k_new, v_new=v_new, kv_desc=desc, **knobs))
    if prefix == 0:
        cu = qsl.clone()

        def flash() -> torch.Tensor:
            return torch.ops.aten._flash_attention_forward(q, k_new, v_new, cu, cu, max(lens), max(lens), 0.0, True,
                                                           False, scale=HEAD_DIM**-0.5)[0]
        row("torch flash varlen (FA2), contiguous K/V", flash)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = []
    for label, lens, prefix in [("workload step", workload_step(), 0), ("16 x 1000", [1000] * 16, 0),
                                ("8 x 1024", [1024] * 8, 0), ("64 x 128 after a 2,048-token prefix", [128] * 64, 2048),
                                ("16 x 512 after a 512-token prefix", [512] * 16, 512)]:
        rows += study(f"{label} ({len(lens)} prompts, {sum(lens)} tokens)", lens, args.sweep, "cuda", prefix)
    print("\n| shape | kernel | us | TFLOP/s | max diff from paged |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
