"""The fused sampler (nvcli/kernels/sampling.py) on decode-sized logits.

    PYTHONPATH=. python3 benchmarks/sampler_gpu.py    # CUDA only; well under a minute

For 16, 64, 128 and 256 rows of bf16 random logits over a 151,936-token vocabulary at temperature 0.6, times one
call of `sample_triton` with CUDA events: 5 warm-up calls, then the median of 20. Each call reads its own copy of
the logits (>= 256 MiB of copies in all), so the read comes from HBM, not from the 50 MB L2, and a short device
sleep before each call keeps host launch time out of the events. Prints us per call and the effective bandwidth of
the logits read (rows x vocab x 2 bytes / time), after checking that temperature 0 is argmax.
"""

from __future__ import annotations

import statistics
import sys

import torch

from nvcli.kernels.sampling import sample_triton

VOCAB = 151936
TEMPERATURE = 0.6
ROWS = (16, 64, 128, 256)
WARMUP, TIMED = 5, 20


def time_us(copies: list[torch.Tensor], temps: torch.Tensor, seeds: torch.Tensor) -> float:
    """Median device time of one call, in us; call i reads copies[i % len(copies)]."""
    times = []
    for i in range(WARMUP + TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # ~1 ms of device work, longer than the host takes to launch a call: the launches queue behind
        # it, so the events time the kernels, not the host
        torch.cuda._sleep(2_000_000)
        start.record()
        sample_triton(copies[i % len(copies)], temps, seeds)
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
    lines = ["| rows | us per call | GB/s of logits |", "| --- | --- | --- |"]
    for rows in ROWS:
        nbytes = rows * VOCAB * 2
        copies = [torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)  # [rows, vocab] each
                  for _ in range(max(2, -(-(256 << 20) // nbytes)))]
        temps = torch.full((rows,), TEMPERATURE, device="cuda")  # [rows]
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919  # [rows]
        greedy = sample_triton(copies[0], torch.zeros_like(temps), seeds)  # [rows]
        assert torch.equal(greedy, copies[0].argmax(dim=1)), "temperature 0 must be argmax"
        us = time_us(copies, temps, seeds)
        lines.append(f"| {rows} | {us:.1f} | {nbytes / us / 1e3:,.0f} |")
        del copies
    print("\n".join(lines))


if __name__ == "__main__":
    main()
