"""`nv bench`: throughput on Nano-vLLM's workload (the field's reference) and single-request latency.

Throughput prints vLLM's summary lines and writes vLLM's JSON keys, so results line up with
`vllm bench throughput`. The workload is Nano-vLLM's bench.py: random.seed(0); 256 prompts of
randint(100, 1024) random token ids below 10000; max_tokens randint(100, 1024); temperature 0.6;
ignore_eos; one warm-up generate first; throughput = output tokens / wall time.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nvcli.sampling_params import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens or 0 for p in self.params)


def parse_range(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{flag}: expected N or MIN-MAX, got {text!r}") from None
    if a < 1 or b < a:
        raise ValueError(f"{flag}: expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0,
                  temperature: float = 0.6, vocab: int = 10000) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=rng.randint(*output_len))
              for _ in range(num_prompts)]
    return Workload(prompts, params)


def run_workload(engine, work: Workload, on_step: Callable[[], None] | None = None) -> float:
    """Feed every request, step until done; returns wall seconds."""
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(p, sp, request_id=f"bench-{time.monotonic_ns()}-{i}")
    while engine.has_unfinished():
        engine.step()
        if on_step is not None:
            on_step()
    return time.perf_counter() - t0


def throughput(engine, work: Workload, repeats: int = 1, on_step: Callable[[], None] | None = None) -> dict:
    warm = make_workload(1, (16, 16), (8, 8), seed=1)
    run_workload(engine, warm)
    times = [run_workload(engine, work, on_step) for _ in range(repeats)]
    elapsed = statistics.median(times)
    n = len(work.prompts)
    total = work.prompt_tokens + work.output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": n,
        "total_num_tokens": total,
        "requests_per_second": n / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": work.output_tokens / elapsed,
        "total_num_prompt_tokens": work.prompt_tokens,
        "total_num_output_tokens": work.output_tokens,
        "all_elapsed_times": times,
    }


def latency(engine, prompt_len: int, output_len: int, repeats: int = 3) -> dict:
    """One request alone: time to first token and milliseconds per output token after it."""
    rng = random.Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(prompt_len)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    run_workload(engine, Workload([prompt[:16]], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=8)]))
    latencies, ttfts, tpots = [], [], []
    for r in range(repeats):
        engine.add_request(prompt, sp, request_id=f"latency-{r}-{time.monotonic_ns()}")
        g0 = engine.stats().generation_tokens
        t0 = time.perf_counter()
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None and engine.stats().generation_tokens > g0:
                first = time.perf_counter()
        total = time.perf_counter() - t0
        latencies.append(total)
        ttfts.append((first or t0) - t0)
        tpots.append((total - ttfts[-1]) / max(1, output_len - 1))
    return {
        "avg_latency": statistics.mean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): sorted(latencies)[min(len(latencies) - 1, int(p / 100 * len(latencies)))]
                        for p in (10, 25, 50, 75, 90, 99)},
        "ttft_ms": 1000 * statistics.median(ttfts),
        "ms_per_output_token": 1000 * statistics.median(tpots),
        "prompt_len": prompt_len,
        "output_len": output_len,
    }


def summary_lines(result: dict) -> list[str]:
    return [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens:  {result['total_num_prompt_tokens']}",
        f"Total num output tokens:  {result['total_num_output_tokens']}",
    ]


def write_json(path: Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2))
