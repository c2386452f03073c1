"""--batch-invariant on the GPU: does a request keep its bits beside other requests, and what does the mode cost?

Bits: a seeded request (temperature 1, logprobs 5) of 300 prompt tokens and 64 output tokens, on dummy Qwen3-0.6B
weights in bf16: alone, alone again, then beside 63 other requests, with and without --batch-invariant. Prints the
first token that differs from the request alone and the largest logprob difference before it.
Cost: output tok/s of 128 requests (random 100-1,000 prompt and 100-500 output tokens), the default engine against
--batch-invariant, all at once (256 slots) and streamed through 32 slots (new prompts join most steps: mixed steps),
each a warm-up then `--repeats` timed runs (median).

    PYTHONPATH=. python3 benchmarks/batch_invariance_gpu.py [--repeats 2] [--kv-cache-dtype fp8] [--prompt-heavy 512]
        [--modes default,invariant]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time

import torch

from nvcli import LLM, SamplingParams
from nvcli.models.presets import preset_dir


def first_difference(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> tuple[int | None, float]:
    """(index of the first differing token or None, max |logprob difference| up to it)."""
    n = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None)
    upto = len(a[0]) if n is None else n
    return n, max((abs(x - y) for x, y in zip(a[1][:upto], b[1][:upto])), default=0.0)


def first_output(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[int], list[float]]:
    """The first request's tokens and their logprobs."""
    o = llm.generate([{"prompt_token_ids": p} for p in prompts], params)[0].outputs[0]
    return o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_runs(llm: LLM, prompts: list[dict], params: list[SamplingParams] | SamplingParams, repeats: int
               ) -> list[float]:
    """Seconds of each of `repeats` runs of the whole list, after a warm-up on its first 16 prompts."""
    llm.generate(prompts[:16], params[:16] if isinstance(params, list) else params)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    ap.add_argument("--modes", default="default,invariant", help="default, invariant (--batch-invariant) or both")
    ap.add_argument("--prompt-heavy", type=int, default=0, metavar="N",
                    help="also time N lines of 1,000 prompt tokens and one output token each (prompt tok/s)")
    ap.add_argument("--smoke", help="a small model directory and a few requests: checks the script on the CPU")
    args = ap.parse_args()
    model = args.smoke or str(preset_dir("qwen3-0.6b", tempfile.mkdtemp(prefix="nv-preset-")))
    n_others, n_work, out_tokens = (3, 4, 8) if args.smoke else (63, 128, 64)
    rnd = random.Random(0)
    target = [rnd.randint(0, 10000) for _ in range(30 if args.smoke else 300)]
    others = [[rnd.randint(0, 10000) for _ in range(rnd.randint(50, 600))] for _ in range(n_others)]
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=out_tokens, logprobs=5, ignore_eos=True)
    neighbour = SamplingParams(temperature=0.6, max_tokens=80, ignore_eos=True)
    w = random.Random(1)
    prompts = [{"prompt_token_ids": [w.randint(0, 10000) for _ in range(w.randint(100, 1000))]} for _ in range(n_work)]
    params = [SamplingParams(temperature=0.6, max_tokens=w.randint(4, 8) if args.smoke else w.randint(100, 500),
                             ignore_eos=True) for _ in prompts]
    total = sum(p.max_tokens for p in params)
    heavy = [{"prompt_token_ids": [w.randint(0, 10000) for _ in range(30 if args.smoke else 1000)]}
             for _ in range(args.prompt_heavy)]
    modes = [m == "invariant" for m in args.modes.split(",")]
    bits, cost, prompt_rate = {}, {}, {}
    for invariant in modes:
        for slots in (256, 32):
            llm = LLM(model, load_format="auto" if args.smoke else "dummy", batch_invariant=invariant,
                      kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False, gpu_memory_utilization=0.4,
                      max_num_seqs=slots)
            if slots == 256:
                alone = first_output(llm, [target], [sp])
                again = first_output(llm, [target], [sp])
                beside = first_output(llm, [target, *others], [sp] + [neighbour] * n_others)
                bits[invariant] = (first_difference(alone, again), first_difference(alone, beside))
            times = timed_runs(llm, prompts, params, args.repeats)
            cost[invariant, slots] = (total / statistics.median(times), times)
            if slots == 256 and heavy:
                heavy_times = timed_runs(llm, heavy, SamplingParams(max_tokens=1), args.repeats)
                prompt_rate[invariant] = (sum(len(h["prompt_token_ids"]) for h in heavy)
                                          / statistics.median(heavy_times), heavy_times)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    heavy_head = f" {len(heavy)} prompts of 1,000 tokens, 1 output token, prompt tok/s (runs, s) |" if heavy else ""
    print(f"\n| mode | alone twice: first differing token / max logprob diff | alone vs beside {n_others} others | "
          f"{n_work} requests at once, output tok/s (runs, s) | through 32 slots |{heavy_head}")
    print("| --- | --- | --- | --- | --- |" + (" --- |" if heavy else ""))
    for invariant in modes:
        again, beside = bits[invariant]
        cells = [f"{tps:,.0f} ({', '.join(f'{t:.2f}' for t in ts)})" for tps, ts in (cost[invariant, s] for s in (256, 32))]
        if heavy:
            rate, ts = prompt_rate[invariant]
            cells.append(f"{rate:,.0f} ({', '.join(f'{t:.2f}' for t in ts)})")
        print(f"| {'--batch-invariant' if invariant else 'default'} | {again[0]} / {again[1]:.3g} | "
              f"{beside[0]} / {beside[1]:.3g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
