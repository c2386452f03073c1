"""Where the filter floor kernel's time goes at few rows (one program per row, one SM each).

    PYTHONPATH=. python3 benchmarks/floor_phases_gpu.py [--configs]

Times kernels that stop after each phase of `_filter_floor_kernel` for Qwen3's pair (top_k 20, top_p 0.95) on
[rows, 151,936] bf16 logits (randn * 4, temperature 0.6): the first pass over the row (min, each lane's four largest
keys), then the k-th largest lane maximum (top-k's bound), then the candidates into the scratch (from the first pass's
registers, else by the compaction's passes), then the whole kernel; and the compaction's counting pass alone. us, median
of do_bench_cudagraph (no launch overhead). `--configs` instead times the whole kernel per load width (lanes), warps and
loads in flight, at few rows, where a row's one program on one SM is latency-bound. The table is printed last.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

from nvcli.kernels import sampling_filters as sf

VOCAB = 151_936


@triton.jit
def _phases_kernel(logits_ptr, out_ptr, scratch_ptr, stride_row, vocab, k, STOP: tl.constexpr,
                   SCAN_N: tl.constexpr, CAP: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    buf_ptr = scratch_ptr + row.to(tl.int64) * CAP
    key_lo, key_hi, key_2, key_3, key_4 = sf._first_pass(row_ptr, vocab, True, SCAN_N, STAGES)
    lo = tl.min(key_lo, axis=0).to(tl.int64)
    hi = tl.max(key_hi, axis=0).to(tl.int64) + 1
    result = hi
    if STOP >= 1:
        lo = sf._kth_largest(key_hi, k, lo, hi)
        result = lo
    if STOP == 2:
        result = sf._compact_lanes_or_row(row_ptr, vocab, buf_ptr, lo, key_hi, key_2, key_3, key_4, CAP, True,
                                          tl.bfloat16, SCAN_N, STAGES).to(tl.int64)
    if STOP == 3:  # the compaction's counting pass alone (the path where a lane's fourth key reaches the bound)
        lo32 = lo.to(tl.int32)
        per_lane = tl.zeros([SCAN_N], dtype=tl.int32)
        for start in tl.range(0, vocab, SCAN_N, num_stages=STAGES):
            _, keep = sf._load_kept(row_ptr, start, vocab, lo32, True, SCAN_N)
            per_lane += keep.to(tl.int32)
        result = tl.sum(per_lane, axis=0).to(tl.int64)
    tl.store(out_ptr + row, result)


PHASES = ("first pass", "+ k-th lane maximum", "+ candidates into the scratch",
          "+ k-th lane maximum + the compaction's count pass alone")


def time_rows(rows: int, logits: torch.Tensor) -> list[tuple[int, str, float]]:
    dev = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    scratch = torch.empty(rows, sf.CAPACITY, dtype=torch.bfloat16, device=dev)
    timed: list[tuple[int, str, float]] = []

    def bench(name: str, fn: Callable[[], None]) -> None:
        fn()
        timed.append((rows, name, triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3))
        print(timed[-1], flush=True)

    for stop, name in enumerate(PHASES):
        bench(name, lambda stop=stop: _phases_kernel[(rows,)](
            logits, out, scratch, logits.stride(0), VOCAB, 20, STOP=stop, SCAN_N=sf.SCAN_BLOCK, CAP=sf.CAPACITY,
            STAGES=sf.STAGES, num_warps=8))
    temps = torch.full((rows,), 0.6, device=dev)
    top_k = torch.full((rows,), 20, dtype=torch.int64, device=dev)
    top_p = torch.full((rows,), 0.95, device=dev)
    for name, tk, tp in (("whole kernel, top_k 20 + top_p 0.95", top_k, top_p),
                         ("whole kernel, top_k 20", top_k, None), ("whole kernel, top_p 0.95", None, top_p)):
        bench(name, lambda tk=tk, tp=tp: sf.filter_floors_triton(logits, temps, tk, tp, None))
    return timed


CONFIGS = [(2048, 8, 4), (2048, 16, 4), (2048, 8, 8), (2048, 16, 8), (4096, 8, 4), (4096, 16, 4), (4096, 16, 8),
           (8192, 16, 4)]  # (columns per load = lanes, warps, loads in flight)


def time_configs() -> None:
    """`--configs`: the whole kernel per (scan, warps, stages) at few rows, each checked against the default's floors."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = []
    for rows in (1, 4, 16, 64):
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        temps = torch.full((rows,), 0.6, device="cuda")
        top_k = torch.full((rows,), 20, dtype=torch.int64, device="cuda")
        top_p = torch.full((rows,), 0.95, device="cuda")
        for name, tk, tp in (("top_k 20 + top_p 0.95", top_k, top_p), ("top_p 0.95", None, top_p)):
            want = sf.filter_floors_triton(logits, temps, tk, tp, None)
            for scan, warps, stages in CONFIGS:
                def fn(x=logits, t=temps, tk=tk, tp=tp, scan=scan, warps=warps, stages=stages) -> torch.Tensor:
                    return sf.filter_floors_triton(x, t, tk, tp, None, scan=scan, stages=stages, warps=warps)
                same = torch.equal(fn(), want)
                us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                table.append((rows, name, f"{scan} / {warps} / {stages}", us, same))
                print(table[-1], flush=True)
    print("\n| rows | filter | scan / warps / stages | us | floors as the default's |\n| --- | --- | --- | --- | --- |")
    for rows, name, cfg, us, same in table:
        print(f"| {rows} | {name} | {cfg} | {us:.1f} | {same} |")


def main() -> None:
    if "--configs" in sys.argv:
        time_configs()
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    table: list[tuple[int, str, float]] = []
    for rows in (1, 16, 64, 256):
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        table += time_rows(rows, logits)
    print("\n| rows | phase | us |\n| --- | --- | --- |")
    for rows, name, us in table:
        print(f"| {rows} | {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
