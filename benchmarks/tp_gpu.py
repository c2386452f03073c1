"""Tensor parallelism on 2+ GPUs, in one run (see benchmarks/RESULTS.md).

    PYTHONPATH=. python3 benchmarks/tp_gpu.py [--tp 2] [--skip-bench]

1. Greedy TP=N vs TP=1 on tiny random Qwen3 / Llama models: float32 (expect identical) and bf16
   (report the agreement rate); with CUDA graphs also a streaming float32 case (48 prompts through 8 slots, so
   most steps replay a mixed graph on every rank).
2. `nv bench` on dummy Qwen3-8B weights with the DESIGN workload (benchmarks/RESULTS.md) at TP=1 and TP=N, each
   in its own process; throughput and the scaling ratio.
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.monotonic()

ROWS: list[tuple[str, str]] = []


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"## {name}: {value}", flush=True)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens equal before the first divergence, averaged over requests."""
    from nvcli.testing.kv_quality import greedy_agreement

    return greedy_agreement(a, b).prefix_frac


def correctness(tp: int, tmp: Path, eager: bool = False) -> None:
    import gc

    import torch

    from nvcli import LLM, SamplingParams
    from nvcli.testing.tiny_models import make_tiny_model

    prompts = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate([5, 17, 33, 64, 100, 250])]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for arch in ("qwen3", "llama")[: 1 if eager else 2]:
        d = str(make_tiny_model(tmp / arch, arch, num_attention_heads=8, num_key_value_heads=4))
        for dtype in ("float32", "bfloat16"):
            outs = {}
            for size in (1, tp):
                print(f"-- {arch} {dtype} TP={size} eager={eager} (at {time.monotonic() - START:.0f} s)", flush=True)
                llm = LLM(d, device="cuda", dtype=dtype, tensor_parallel_size=size, num_kvcache_blocks=512,
                          max_model_len=512, max_num_batched_tokens=256, enforce_eager=eager, max_num_seqs=16)
                outs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
                llm.shutdown()
                del llm
                gc.collect()
                torch.cuda.empty_cache()
            same = sum(x == y for x, y in zip(outs[1], outs[tp]))
            row(f"{arch} {dtype} TP={tp} vs TP=1 greedy", f"{same}/{len(prompts)} identical, "
                f"agreement {agreement(outs[1], outs[tp]):.3f}")


def streaming_correctness(tp: int, tmp: Path) -> None:
    """A long job in miniature at TP=N and TP=1, float32 greedy, CUDA graphs: 48 prompts through 8 slots, so most
    steps admit a prompt chunk beside running decodes (the mixed graphs on every rank). Expect identical tokens."""
    import gc
    import random

    import torch

    from nvcli import LLM, SamplingParams
    from nvcli.testing.tiny_models import make_tiny_model

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 200))] for _ in range(48)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 40), ignore_eos=True) for _ in prompts]
    d = str(make_tiny_model(tmp / "qwen3-stream", "qwen3", num_attention_heads=8, num_key_value_heads=4))
    outs, mixed = {}, {}
    for size in (1, tp):
        print(f"-- streaming qwen3 float32 TP={size} (at {time.monotonic() - START:.0f} s)", flush=True)
        llm = LLM(d, device="cuda", dtype="float32", tensor_parallel_size=size, num_kvcache_blocks=512,
                  max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)
        outs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        mixed[size] = stats.num_steps - stats.num_decode_steps  # steps that carried prompt chunks
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(x == y for x, y in zip(outs[1], outs[tp]))
    row(f"streaming qwen3 float32 TP={tp} vs TP=1 greedy (steps with prompt chunks {mixed[tp]} / {mixed[1]})",
        f"{same}/{len(prompts)} identical")


def bench(tp: int, out_dir: Path, extra: list[str]) -> float | None:
    out = out_dir / f"tp{tp}.json"
    cmd = [sys.executable, "-m", "nvcli", "bench", "--model", "qwen3-8b", "--load-format", "dummy", "--tp", str(tp),
           "--output-json", str(out), "--quiet", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True, env=os.environ.copy())
    print(proc.stdout, proc.stderr[-3000:], flush=True)
    if proc.returncode != 0:
        row(f"nv bench qwen3-8b TP={tp}", f"FAILED (exit {proc.returncode})")
        return None
    data = json.loads(out.read_text())
    tps = data["output_tokens_per_second"]
    row(f"nv bench qwen3-8b TP={tp}", f"{tps:,.0f} output tok/s, {data['elapsed_time']:.2f} s, "
        f"start-up {data['startup_s']:.1f} s, {data['kv_blocks']} KV blocks")
    return tps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs in the correctness runs")
    ap.add_argument("--stacks-after", type=float, default=0,
                    help="dump this process's stacks and exit after this many seconds (a hang in the correctness runs)")
    args = ap.parse_args()
    if args.stacks_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_after, exit=True)
    import torch

    row("devices", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    tmp = Path(tempfile.mkdtemp())
    try:
        correctness(args.tp, tmp, args.eager)
        if not args.eager:
            streaming_correctness(args.tp, tmp)
    except Exception as e:  # keep going to the benchmark
        import traceback

        traceback.print_exc()
        row("correctness", f"FAILED: {e}")
    if not args.skip_bench:
        extra = ["--enforce-eager"] if args.eager else []
        one = bench(1, tmp, extra)
        many = bench(args.tp, tmp, extra)
        if one and many:
            row(f"scaling TP={args.tp} / TP=1", f"{many / one:.2f}x")
    print("\n| what | result |\n| --- | --- |")
    for k, v in ROWS:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
