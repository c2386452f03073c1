"""`nv bench`: throughput on Nano-vLLM's workload (the field's reference) and single-request latency.

Throughput prints vLLM's summary lines and writes vLLM's JSON keys, so results line up with
`vllm bench throughput`. The workload is Nano-vLLM's bench.py: random.seed(0); 256 prompts of
randint(100, 1024) random token ids below 10000; max_tokens randint(100, 1024); temperature 0.6;
ignore_eos; one warm-up generate first; throughput = output tokens / wall time.
"""

from __future__ import annotations

import dataclasses
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
    times = []
    for _ in range(repeats):
        engine.reset_prefix_cache()  # a repeat must not reuse the previous run's prompts from the cache
        times.append(run_workload(engine, work, on_step))
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


def latency(engine, prompt_len: int, output_len: int, repeats: int = 3,
            sampling: SamplingParams | None = None) -> dict:
    """One request alone: time to first token and milliseconds per output token after it. `sampling`: how it samples
    (greedy by default); max_tokens and ignore_eos are the benchmark's."""
    rng = random.Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(prompt_len)]
    sp = dataclasses.replace(sampling or SamplingParams(temperature=0.0), ignore_eos=True, max_tokens=output_len)
    run_workload(engine, Workload([prompt[:16]], [dataclasses.replace(sp, max_tokens=8)]))
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


class _Progress:
    """Feeds the generate dashboard from the engine while a benchmark runs (at most 4 frames/s)."""

    def __init__(self, engine, reporter, total: int, model_name: str) -> None:
        self.engine, self.reporter, self.total, self.model_name = engine, reporter, total, model_name
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.base_finished = engine.stats().num_finished

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self.last < 0.25:
            return
        self.last = now
        from nvcli.jobs.runner import JobProgress

        s = self.engine.stats()
        done = s.num_finished - self.base_finished
        self.reporter.update(JobProgress(
            elapsed_s=now - self.t0, written=done, failed=0, skipped=0, read=self.total,
            in_flight=s.num_running + s.num_waiting, buffered=0, total=self.total,
            prompt_tokens=s.prompt_tokens, completion_tokens=s.generation_tokens, stats=s,
            model_name=self.model_name,
        ))


def run_bench(config, *, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
              temperature: float, repeats: int, latency_mode: bool, latency_input_len: int,
              latency_output_len: int, output_json: str | None, quiet: bool) -> dict:
    """Build the engine from `config`, run the throughput (or latency) benchmark, print vLLM's lines."""
    import sys

    from rich.console import Console

    from nvcli.engine import build_engine

    if latency_mode and config.data_parallel_size > 1:
        raise ValueError("--latency times one request on one replica: leave --data-parallel-size out")
    num_prompts *= config.data_parallel_size  # each replica gets the one-GPU workload's share
    t0 = time.perf_counter()
    engine = build_engine(config)
    startup = time.perf_counter() - t0
    err = Console(stderr=True)
    if not quiet:
        err.print(f"[dim]nv bench: engine ready in {startup:.1f} s ({engine.stats().kv_blocks_total} KV blocks)[/]")
    try:
        if latency_mode:
            result = latency(engine, latency_input_len, latency_output_len, repeats=max(repeats, 3))
            lines = [f"Avg latency: {result['avg_latency']:.4f} seconds",
                     f"Time per output token: {result['ms_per_output_token']:.3f} ms (TTFT {result['ttft_ms']:.1f} ms)"]
        else:
            work = make_workload(num_prompts, input_len, output_len, seed=seed, temperature=temperature)
            reporter = None
            if not quiet:
                from nvcli.dashboard import LiveDashboard, PlainProgress

                reporter = LiveDashboard(err) if err.is_terminal else PlainProgress(sys.stderr, name="nv bench")
                reporter.start("warming up")
            progress = _Progress(engine, reporter, num_prompts, str(config.model)) if reporter else None
            try:
                result = throughput(engine, work, repeats=repeats, on_step=progress)
            finally:
                if reporter is not None:
                    reporter.stop()
            lines = summary_lines(result)
        result["startup_s"] = startup
        stats = engine.stats()
        result["kv_blocks"] = stats.kv_blocks_total
        if config.speculative_config is not None:  # the engine's totals, its warm-up included
            result.update(spec_draft_tokens=stats.spec_draft_tokens, spec_accepted_tokens=stats.spec_accepted_tokens,
                          spec_verify_steps=stats.spec_verify_steps)
        for line in lines:
            print(line, flush=True)
        if output_json:
            write_json(Path(output_json), result)
        return result
    finally:
        engine.shutdown()
