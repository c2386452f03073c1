"""What top-k / top-p / min-p cost the sampler per step, against temperature alone.

    PYTHONPATH=. python3 benchmarks/sampling_filters_gpu.py

Qwen3's generation_config.json asks for top_k 20 and top_p 0.95, and `nv generate` takes a model's recommendations as
its defaults, so a Qwen3 job filters every row of every step. The DESIGN workload samples with temperature alone.
This times `engine.sampler.sample` on [rows, 151,936] bf16 logits (Qwen3's vocabulary; values randn * 4, a peaked
distribution) at temperature 0.6, median of triton's do_bench, per filter and row count, and checks that every
filter's draws stay in the set the filter keeps. The table is printed last.
"""

from __future__ import annotations

import random

import torch
import triton.testing

from nvcli.engine.sampler import SamplingBatch, kept_mask, sample
from nvcli.sampling_params import SamplingParams

VOCAB = 151_936
FILTERS = {
    "temperature only": {},
    "top_k 20, top_p 0.95 (Qwen3)": {"top_k": 20, "top_p": 0.95},
    "top_p 0.95": {"top_p": 0.95},
    "top_k 50": {"top_k": 50},
    "min_p 0.05": {"min_p": 0.05},
}


def main() -> int:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    table: list[tuple[int, str, float, str]] = []
    for rows in (1, 16, 64, 128, 256):
        logits = (torch.randn(rows, VOCAB, device=dev, generator=gen) * 4).to(torch.bfloat16)
        for name, kw in FILTERS.items():
            params = [SamplingParams(temperature=0.6, max_tokens=16, **kw) for _ in range(rows)]
            batch = SamplingBatch.build(params, [0] * rows, VOCAB, dev, random.Random(0))
            us = triton.testing.do_bench(lambda b=batch, x=logits: sample(x, b), warmup=10, rep=100,
                                         return_mode="median") * 1e3
            tokens = sample(logits, batch)
            check = "-"
            if batch.needs_filter:
                kept = kept_mask(logits, batch)
                inside = kept.gather(1, tokens[:, None]).all().item()
                check = f"draws kept: {inside}, kept per row {kept.sum(1).float().mean().item():,.0f}"
            table.append((rows, name, us, check))
            print(table[-1], flush=True)
    print("\n| rows | filter | us per sample() | check |\n| --- | --- | --- | --- |")
    for rows, name, us, check in table:
        print(f"| {rows} | {name} | {us:,.0f} | {check} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
