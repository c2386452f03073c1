"""Where one request's time per token goes when it samples: host or device.

    PYTHONPATH=. python3 benchmarks/sampled_latency_gpu.py [--cprofile]

One request of 128 prompt + 512 output tokens on dummy Qwen3-0.6B weights, greedy, temperature 0.6 alone, and Qwen3's
sampling (temperature 0.6, top_k 20, top_p 0.95). Per token: the wall time, the host time spent in the model runner's
`launch` (building the step's sampling inputs and enqueueing forward and sampler) and in the whole `engine.step`, and
the device time of the sampler's kernels alone (CUDA events around the eager `sample`). When the host's time per step
reaches the wall time per token, the step is bound by the host and a faster kernel does not show. Decode steps of a
few rows sample inside CUDA graphs (engine/sampler_graphs.py; `NV_SAMPLER_GRAPHS=0` turns that off), so with them the
eager sampler runs only for each request's first token, from its prompt step: the table gives how many steps called it.
`--cprofile` also prints the functions with the most host time inside `launch`, per case. The table is printed last.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from nvcli import LLM, SamplingParams
from nvcli.bench import latency
from nvcli.engine import model_runner
from nvcli.models.presets import preset_dir

CASES = {"greedy": SamplingParams(temperature=0.0),
         "temperature 0.6": SamplingParams(temperature=0.6),
         "Qwen3's sampling": SamplingParams(temperature=0.6, top_k=20, top_p=0.95)}


def main() -> None:
    llm = LLM(str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp()))), load_format="dummy", max_model_len=4096)
    runner = llm.engine.executor.runner
    spent = {"launch": 0.0, "calls": 0}
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    real_launch, real_sample = runner.launch, model_runner.sample

    def timed_launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = real_launch(*args, **kwargs)
        spent["launch"] += time.perf_counter() - t0
        spent["calls"] += 1
        return out

    def timed_sample(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = real_sample(*args, **kwargs)
        b.record()
        events.append((a, b))
        return out

    runner.launch = timed_launch
    model_runner.sample = timed_sample
    table = []
    for name, sp in CASES.items():
        latency(llm.engine, 128, 512, repeats=1, sampling=sp)  # warm-up
        spent.update(launch=0.0, calls=0)
        events.clear()
        res = latency(llm.engine, 128, 512, repeats=3, sampling=sp)
        torch.cuda.synchronize()
        if "--cprofile" in sys.argv:
            prof = cProfile.Profile()
            runner.launch = lambda *a, prof=prof, **k: prof.runcall(timed_launch, *a, **k)
            latency(llm.engine, 128, 128, repeats=1, sampling=sp)
            runner.launch = timed_launch
            print(f"== {name}: launch under cProfile")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        sampler_us = sorted(a.elapsed_time(b) for a, b in events)[len(events) // 2] * 1e3
        table.append((name, res["ms_per_output_token"], 1e3 * spent["launch"] / spent["calls"], sampler_us,
                      f"{len(events)} of {spent['calls']}"))
        print(table[-1], flush=True)
    llm.shutdown()
    print("\n| sampling | wall ms/token | host ms in launch per step | eager sampler's kernels, us (median) "
          "| steps sampling eagerly |")
    print("| --- | --- | --- | --- | --- |")
    for name, wall, host, dev, eager in table:
        print(f"| {name} | {wall:.3f} | {host:.3f} | {dev:.0f} | {eager} |")


if __name__ == "__main__":
    main()
