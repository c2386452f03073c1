"""The fused sampler on decode-sized logits: the inverse-CDF kernels against the Gumbel-max kernel they replaced.

    PYTHONPATH=. python3 benchmarks/sampler_gpu.py    # CUDA only; well under a minute

For 16, 64, 128 and 256 rows of bf16 random logits over a 151,936-token vocabulary at temperature
0.6, times one call of `sample_triton` (nvcli/kernels/sampling.py) and of `_gumbel_reference`
(the earlier one-pass Gumbel-max kernel, kept here for the comparison) with CUDA events: 5 warm-up
calls, then the median of 20. Each call reads its own copy of the logits (>= 256 MiB of copies in
all), so the read comes from HBM, not from the 50 MB L2, and a short device sleep before each call
keeps host launch time out of the events. Prints us per call and the effective bandwidth of the
logits read (rows x vocab x 2 bytes / time).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from nvcli.kernels.sampling import sample_triton

VOCAB = 151936
TEMPERATURE = 0.6
ROWS = (16, 64, 128, 256)
WARMUP, TIMED = 5, 20


@triton.jit
def _gumbel_reference_kernel(
    logits_ptr,  # [num_rows, vocab]
    temps_ptr,  # [num_rows] fp32
    seeds_ptr,  # [num_rows] int64
    max_ptr,  # [num_rows, num_chunks] fp32
    idx_ptr,  # [num_rows, num_chunks] int32
    stride_row,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
):
    # The chunk is four slabs of CHUNK // 4 columns: one Philox call (tl.rand4x) yields the
    # noise of the same position in all four, a quarter of the RNG work of one call per column.
    QUARTER: tl.constexpr = CHUNK // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, QUARTER)
    cols0 = chunk * CHUNK + offs
    cols1 = cols0 + QUARTER
    cols2 = cols1 + QUARTER
    cols3 = cols2 + QUARTER
    base = logits_ptr + row.to(tl.int64) * stride_row
    x0 = tl.load(base + cols0, mask=cols0 < vocab, other=float("-inf")).to(tl.float32)
    x1 = tl.load(base + cols1, mask=cols1 < vocab, other=float("-inf")).to(tl.float32)
    x2 = tl.load(base + cols2, mask=cols2 < vocab, other=float("-inf")).to(tl.float32)
    x3 = tl.load(base + cols3, mask=cols3 < vocab, other=float("-inf")).to(tl.float32)
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        seed = tl.load(seeds_ptr + row)
        # uniform [0, 1) noise, a function of (seed, column) only
        u0, u1, u2, u3 = tl.rand4x(seed, chunk * QUARTER + offs)
        # argmax(x / T - ln(-ln u)) in base 2: scaling by log2(e) and dropping the constant
        # log2(ln 2) keep the argmax, and leave one multiply and two base-2 logs per column
        c = 1.4426950408889634 / temp
        x0 = x0 * c - tl.log2(-tl.log2(u0))
        x1 = x1 * c - tl.log2(-tl.log2(u1))
        x2 = x2 * c - tl.log2(-tl.log2(u2))
        x3 = x3 * c - tl.log2(-tl.log2(u3))
    x0 = tl.where(cols0 < vocab, x0, float("-inf"))
    x1 = tl.where(cols1 < vocab, x1, float("-inf"))
    x2 = tl.where(cols2 < vocab, x2, float("-inf"))
    x3 = tl.where(cols3 < vocab, x3, float("-inf"))
    best = tl.maximum(tl.maximum(tl.max(x0, axis=0), tl.max(x1, axis=0)),
                      tl.maximum(tl.max(x2, axis=0), tl.max(x3, axis=0)))
    # first column holding the max (argmax tie rule)
    none = 2147483647
    idx = tl.minimum(tl.minimum(tl.min(tl.where(x0 == best, cols0, none), axis=0),
                                tl.min(tl.where(x1 == best, cols1, none), axis=0)),
                     tl.minimum(tl.min(tl.where(x2 == best, cols2, none), axis=0),
                                tl.min(tl.where(x3 == best, cols3, none), axis=0)))
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, idx)


def _gumbel_reference(
    logits: torch.Tensor,  # [num_rows, vocab], last dim contiguous
    temperatures: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    seeds: torch.Tensor,  # [num_rows] int64
    chunk: int = 4096,
) -> torch.Tensor:  # [num_rows] int64
    """The Gumbel-max sampler as nvcli/kernels/sampling.py had it: per-chunk (max, argmax) of the
    noisy logits, then a torch argmax over the chunks."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)  # [num_rows, num_chunks]
    idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)  # [num_rows, num_chunks]
    _gumbel_reference_kernel[(rows, num_chunks)](
        logits, temperatures, seeds, best, idx, logits.stride(0), vocab, num_chunks, CHUNK=chunk, num_warps=8
    )
    winner = best.argmax(dim=1, keepdim=True)  # [num_rows, 1] first chunk with the max
    return idx.gather(1, winner).squeeze(1).long()


Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def time_us(fn: Sampler, copies: list[torch.Tensor], temps: torch.Tensor, seeds: torch.Tensor) -> float:
    """Median device time of one call, in us; call i reads copies[i % len(copies)]."""
    times = []
    for i in range(WARMUP + TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # ~1 ms of device work, longer than the host takes to launch a call: the launches queue behind
        # it, so the events time the kernels, not the host
        torch.cuda._sleep(2_000_000)
        start.record()
        fn(copies[i % len(copies)], temps, seeds)
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sampler_gpu.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: vocab {VOCAB} bf16, temperature {TEMPERATURE}, "
          f"median of {TIMED} calls after {WARMUP}")
    lines = [f"{'rows':>5} {'gumbel us':>10} {'GB/s':>6} {'inv-cdf us':>11} {'GB/s':>6} {'speedup':>8}"]
    for rows in ROWS:
        nbytes = rows * VOCAB * 2
        copies = [torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)  # [rows, vocab] each
                  for _ in range(max(2, -(-(256 << 20) // nbytes)))]
        temps = torch.full((rows,), TEMPERATURE, device="cuda")  # [rows]
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919  # [rows]
        greedy = sample_triton(copies[0], torch.zeros_like(temps), seeds)  # [rows]
        assert torch.equal(greedy, copies[0].argmax(dim=1)), "temperature 0 must be argmax"
        old = time_us(_gumbel_reference, copies, temps, seeds)
        new = time_us(sample_triton, copies, temps, seeds)
        lines.append(f"{rows:>5} {old:>10.1f} {nbytes / old / 1e3:>6.0f} {new:>11.1f} {nbytes / new / 1e3:>6.0f} "
                     f"{old / new:>7.2f}x")
        del copies
    print("\n".join(lines))


if __name__ == "__main__":
    main()
