"""Where the time goes on one GPU: decode-step kernel breakdowns, a per-step timeline of the
benchmark workload, and decode-attention config sweeps (bf16 and fp8 caches).

    PYTHONPATH=. python3 benchmarks/profile_gpu.py [--sections steps,timeline,sweep] [--kv-cache-dtype fp8]

steps: torch.profiler over 10 decode steps (CUDA graphs) at the --batches sizes (each with its
  prompt length, default 600): per-step kernel count, GPU busy time (sum of kernel durations),
  wall time, and the kernels that take the most time per step.
timeline: the DESIGN.md workload once after a warm-up, each engine step timed; time grouped by
  the launched batch's size (prefill-carrying steps apart), each bucket with the time its KV and
  weight reads take at the measured copy bandwidth (its floor) and what is left per step, so the
  cost of the shrinking tail and of prefill is visible next to the big-batch decode steps.
prefill: the workload's first steps (prompts only, 16,384-token chunks), timed in a fresh engine and again, then
  under torch.profiler: wall and host launch time per step, and the kernels that take it, against the step's GEMM
  FLOPs at the measured bf16 matmul rate.
mixed: steps that carry a new prompt beside running decodes (a long job's steady state, where most steps admit a
  prompt): 128 sequences decoding at ~700 tokens of context, then steps that each also admit one 562-token prompt,
  against decode-only steps of the same batch: wall and host launch time per step, and the kernel table of each.
  PROFILE_CPROFILE_MIXED=1 adds a host cProfile of 12 steps of each kind (slower under it: the shares count).
splits: bf16 decode attention at the workload's batches of 48-256 rows (their length spread, longest first), at
  choose_num_splits' count and at 2x / 4x it.
sweep: the decode-attention kernel at the workload's (batch, context) shapes as it shrinks
  (256 x 800 ... 8 x 1600, and 256 sequences of 100-2000 tokens), over block_n / warps / stages /
  splits / grid order (fp8: stages / splits / V dequantized per tile), bf16 and fp8; also the default
  with the split-reduce kernel instead of the in-kernel merge.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from nvcli import LLM
from nvcli.bench import make_workload, run_workload
from nvcli.kernels.compile_ahead import variant_difference
from nvcli.models.presets import preset_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def short(name: str) -> str:
    for key, label in [("_decode_split", "decode_attn"), ("_decode_reduce", "decode_reduce"),
                       ("_skinny_gemm", "skinny_gemm"), ("_splitk_reduce", "splitk_reduce"),
                       ("rms_norm", "add_rms_norm"), ("rope", "rope_qk_norm"), ("_store_kv", "kv_store"),
                       ("silu", "silu_mul"), ("_sample_", "sampler"), ("_prefill", "prefill_attn"), ("gemm", "cublas_gemm"),
                       ("nvjet", "cublas_gemm"), ("sm90_xmma", "cublas_gemm"), ("Memcpy", "memcpy"),
                       ("memcpy", "memcpy")]:
        if key in name:
            return label
    return name[:40]


def kernel_table(prof, steps: int) -> tuple[int, float, list[tuple[str, float, float]]]:
    """(kernels per step, GPU-busy us per step, [(kernel, calls/step, us/step)])."""
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[short(e.name)].append(e.time_range.elapsed_us())
    rows = sorted(((k, len(v) / steps, sum(v) / steps) for k, v in per.items()), key=lambda r: -r[2])
    count = sum(len(v) for v in per.values()) / steps
    busy = sum(r[2] for r in rows)
    return int(count), busy, rows


def layer_slots(prof) -> list[str]:
    """Each decode-layer kernel's share of a small step: median start-to-next-start time (us) of the kernels at
    one position of the layer, over all layers and steps. With PDL a kernel's own duration includes its wait for
    the previous one, so the start-to-start interval is the cost it adds to the chain."""
    import statistics

    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    names = [short(e.name) for e in ev]
    starts = [e.time_range.start for e in ev]
    durs = [e.time_range.elapsed_us() for e in ev]
    attn = [i for i, n in enumerate(names) if n == "decode_attn"]
    if len(attn) < 2:
        return []
    # a layer: the kernels from one attention kernel to the next, rotated to start at the kernel before it
    width = collections.Counter(b - a for a, b in zip(attn, attn[1:])).most_common(1)[0][0]
    slots: dict[int, list[float]] = collections.defaultdict(list)
    slot_names: dict[int, str] = {}
    slot_durs: dict[int, list[float]] = collections.defaultdict(list)
    for a, b in zip(attn, attn[1:]):
        if b - a != width:
            continue
        for k in range(width):
            i = a - 1 + k
            slots[k].append(starts[i + 1] - starts[i])
            slot_durs[k].append(durs[i])
            slot_names[k] = names[i]
    out = [f"  per layer ({width} kernels; start-to-next-start / own duration, median us):"]
    total = 0.0
    for k in range(width):
        med = statistics.median(slots[k])
        total += med
        out.append(f"    slot {k} {slot_names[k]:28s} {med:6.2f} / {statistics.median(slot_durs[k]):6.2f}")
    out.append(f"    layer total {total:.1f} us")
    # between two steps' layers: the last layer's tail, LM head, sampler, copies, the next step's head
    if len(attn) > 28:
        out.append("  between the 28th and 29th attention kernels (kernel, start-to-next-start us, own us):")
        for i in range(attn[27] + width - 1, attn[28] - 1):
            out.append(f"    {ev[i].name[:70]:70s} {starts[i + 1] - starts[i]:8.2f} {durs[i]:7.2f}")
    print("\n".join(out))
    return out


def steps_section(model_dir: str, batches: list[tuple[int, int]], kv_cache_dtype: str) -> list[str]:
    """batches: (batch size, prompt length) pairs."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=BATCHED_TOKENS,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    for batch, prompt_len in batches:
        work = make_workload(batch, (prompt_len, prompt_len), (200, 200), seed=0)
        for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
            engine.add_request(p, sp, request_id=f"prof-{batch}-{i}")
        for _ in range(40):  # prefill, then decode steps only
            engine.step()
        torch.cuda.synchronize()
        n = 10
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                engine.step()
            torch.cuda.synchronize()
        count, busy, rows = kernel_table(prof, n)
        line = (f"batch {batch}, ~{prompt_len + 40}-token contexts ({kv_cache_dtype}): wall {wall:.0f} us/step (unprofiled), GPU busy {busy:.0f} us/step, "
                f"{count} kernels/step")
        print(line)
        for name, calls, us in rows[:14]:
            print(f"    {name:40s} {calls:6.1f} calls {us:8.1f} us  {us / calls if calls else 0:6.2f} us/call")
        out.append(line)
        if batch <= 16:
            out += layer_slots(prof)
        while engine.has_unfinished():
            engine.step()
    llm.shutdown()
    return out


def _matmul_tflops(m: int, k: int, n: int) -> float:
    """bf16 [m, k] @ [k, n] on the GPU, TFLOP/s (median)."""
    import kernels as kb

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return 2 * m * n * k / kb.bench(lambda: a @ w.T, True) / 1e12


def prefill_section(model_dir: str, kv_cache_dtype: str) -> list[str]:
    """The workload's prefill: its first 4 steps (16,384 prompt tokens each) timed in a fresh engine, timed again
    (the first calls at new shapes pay one-time costs: cuBLAS at new row counts), then profiled."""
    from torch.profiler import ProfilerActivity, profile

    tflops = _matmul_tflops(16384, 1024, 6144)
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=BATCHED_TOKENS,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    cfg = engine.model_config
    # linear FLOPs per token: qkv, o, gate_up, down (the LM head runs on the last token of each prompt only)
    per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * (
        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim + cfg.num_attention_heads * cfg.head_dim
        + 3 * cfg.intermediate_size)
    out = [f"bf16 matmul 16384 x 1024 x 6144: {tflops:.0f} TFLOP/s"]
    for tag in ("first", "again", "profiled"):
        engine.reset_prefix_cache()
        work = make_workload(256, (100, 1024), (100, 1024), seed=0)
        for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
            engine.add_request(p, sp, request_id=f"prefill-{tag}-{i}")
        torch.cuda.synchronize()
        n = 4
        if tag != "profiled":
            launch_s: list[float] = []
            launch = engine.executor.launch

            def timed_launch(*a, launch=launch, launch_s=launch_s, **kw):  # host time to enqueue a step
                t = time.perf_counter()
                handle = launch(*a, **kw)
                launch_s.append(time.perf_counter() - t)
                return handle

            engine.executor.launch = timed_launch
            t0 = time.perf_counter()
            for _ in range(n):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n * 1e3
            engine.executor.launch = launch
            when = "first steps of a fresh engine" if tag == "first" else "the same steps again"
            out.append(f"prefill ({kv_cache_dtype}, {when}): {wall:.1f} ms per 16,384-token step; its linear "
                       f"layers at {tflops:.0f} TFLOP/s would take {16384 * per_token / tflops / 1e9:.1f} ms; host "
                       f"time to launch each step: " + ", ".join(f"{1e3 * t:.1f}" for t in launch_s) + " ms")
        else:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    engine.step()
                torch.cuda.synchronize()
            count, busy, rows = kernel_table(prof, n)
            out.append(f"  GPU busy {busy / 1e3:.1f} ms/step, {count} kernels/step")
            out += [f"    {name:40s} {calls:6.1f} calls {us / 1e3:8.2f} ms" for name, calls, us in rows[:12]]
        for i in range(len(work.prompts)):  # the decode steps are not what this section looks at
            engine.abort(f"prefill-{tag}-{i}")
        while engine.has_unfinished():
            engine.step()
    print("\n".join(out))
    llm.shutdown()
    return out


def mixed_section(model_dir: str, kv_cache_dtype: str) -> list[str]:
    """Decode-only steps of 128 sequences against steps of the same sequences that each admit one prompt."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=BATCHED_TOKENS,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    run_workload(engine, make_workload(1, (16, 16), (8, 8), seed=1))
    work = make_workload(128, (600, 600), (600, 600), seed=0)
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(p, sp, request_id=f"mixed-base-{i}")
    for _ in range(100):  # prompts, then decode steps: contexts ~700
        engine.step()
    extra = make_workload(200, (562, 562), (600, 600), seed=1)
    added = 0
    launch = engine.executor.launch
    out = []

    def steps(n: int, admit: bool) -> tuple[float, list[float], list[int]]:
        nonlocal added
        launch_s: list[float] = []
        tokens: list[int] = []

        def timed_launch(batch, *a, **kw):
            t = time.perf_counter()
            handle = launch(batch, *a, **kw)
            launch_s.append(time.perf_counter() - t)
            tokens.append(batch.num_tokens)
            return handle

        engine.executor.launch = timed_launch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                if admit:
                    engine.add_request(extra.prompts[added], extra.params[added], request_id=f"mixed-new-{added}")
                    added += 1
                engine.step()
            torch.cuda.synchronize()
        finally:
            engine.executor.launch = launch
        return (time.perf_counter() - t0) / n, launch_s, tokens

    for label, admit in (("decode-only", False), ("one prompt admitted per step", True)):
        steps(5, admit)
        wall, launch_s, tokens = steps(12, admit)
        if os.environ.get("PROFILE_CPROFILE_MIXED") == "1":  # where the host's launch time goes (slows it: shares only)
            import cProfile
            import pstats

            host = cProfile.Profile()
            host.enable()
            steps(12, admit)
            host.disable()
            print(f"-- host profile, {label}, 12 steps")
            pstats.Stats(host).sort_stats("tottime").print_stats(18)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            steps(12, admit)
        count, busy, rows = kernel_table(prof, 12)
        line = (f"{label} ({kv_cache_dtype}, ~{len(engine.scheduler.running)} running, tokens/step "
                f"{min(tokens)}-{max(tokens)}): wall {wall * 1e3:.2f} ms/step, host launch "
                f"{1e3 * sorted(launch_s)[len(launch_s) // 2]:.2f} ms (median), GPU busy {busy / 1e3:.2f} ms/step, "
                f"{count} kernels/step")
        out.append(line)
        out += [f"    {name:40s} {calls:6.1f} calls {us / 1e3:8.3f} ms" for name, calls, us in rows[:10]]
    print("\n".join(out), flush=True)
    llm.shutdown()
    return out


BATCHED_TOKENS = int(os.environ.get("BENCH_MAX_BATCHED_TOKENS", "16384"))  # as in gpu_e2e.py
KV_BYTES_PER_TOKEN = 114_688  # Qwen3-0.6B, bf16 (DESIGN.md §4)
WEIGHT_BYTES = 1.19e9


@contextlib.contextmanager
def _run_counters(tag: str) -> Iterator[list[tuple[int, float]]]:
    """What happens beside a run's steps, printed when it ends: Triton specializations compiled or loaded, cudaMalloc
    calls, pinned host blocks allocated; yields the list its garbage collections go to (generation, seconds).
    PROFILE_TRACE_MALLOC=1 also lists each new segment of the caching allocator."""
    import triton

    gc_pauses: list[tuple[int, float]] = []
    gc_started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            gc_pauses.append((info["generation"], time.perf_counter() - gc_started.pop()))

    compiled: list[str] = []
    variants: list[tuple[object, str]] = []

    def on_compile(**kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        variants.append((kwargs["fn"].jit_function, kwargs["key"]))
        return False  # compile as usual

    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
    host = torch.cuda.host_memory_stats()
    trace = os.environ.get("PROFILE_TRACE_MALLOC") == "1"
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        segments = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    gc.callbacks.append(on_gc)
    triton.knobs.runtime.jit_cache_hook = on_compile
    try:
        yield gc_pauses
    finally:
        gc.callbacks.remove(on_gc)
        triton.knobs.runtime.jit_cache_hook = None
    torch.cuda.synchronize()
    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
    if trace:
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if seg["address"] not in segments:
                frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for b in seg["blocks"][:1]
                          for f in b.get("frames", []) if "nvcli" in f["filename"]]
                print(f"[{tag}] new segment of {seg['total_size'] / 2**20:.1f} MiB: {' < '.join(frames[:6])}", flush=True)
        torch.cuda.memory._record_memory_history(enabled=None)
    host_now = torch.cuda.host_memory_stats()
    print(f"[{tag}] Triton specializations compiled or loaded mid-run: {len(compiled)} "
          f"{collections.Counter(compiled).most_common(8)}; cudaMalloc calls: {mallocs}; pinned host blocks "
          f"allocated: {host_now.get('num_host_alloc', 0) - host.get('num_host_alloc', 0)} in "
          f"{(host_now.get('host_alloc_time.total', 0) - host.get('host_alloc_time.total', 0)) / 1e3:.1f} ms",
          flush=True)
    for fn, key in variants:
        print(f"[{tag}]   {fn.__name__}: {variant_difference(fn, key)}", flush=True)



def _timed_run(engine, work, tag: str) -> tuple[float, list[tuple[float, float, int, bool, int, int, int]]]:
    """Run the workload; per launched step (GPU seconds from its first input copy to its sampled tokens'
    copy, GPU idle seconds before the next step's first operation, batch size, decode-only, context
    tokens its attention reads, tokens computed, one-token rows). CUDA events around each launch: the idle time is what host work
    (scheduling, input building, postprocessing) failed to hide. PROFILE_CPROFILE_STEPS=N: a host profile of
    the first N steps."""
    runner = engine.executor.runner
    launch = runner.launch
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, int, bool, int, int, int]] = []

    def timed_launch(batch, step, *rest):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        handle = launch(batch, step, *rest)
        e1.record()
        marks.append((e0, e1, len(batch.seqs), batch.is_decode_only, sum(len(s) for s in batch.seqs),
                      batch.num_tokens, batch.num_single_token_rows))
        return handle

    runner.launch = timed_launch
    try:
        for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
            engine.add_request(p, sp, request_id=f"tl-{tag}-{i}")
        cprofile_steps = int(os.environ.get("PROFILE_CPROFILE_STEPS", "0"))
        t_start = time.perf_counter()
        if cprofile_steps:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(cprofile_steps):
                engine.step()
            prof.disable()
            print(f"[{tag}] host profile of the first {cprofile_steps} steps:", flush=True)
            stats = pstats.Stats(prof, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(45)
        while engine.has_unfinished():
            engine.step()
        total = time.perf_counter() - t_start
    finally:
        runner.launch = launch
    torch.cuda.synchronize()
    records = []
    for i, (e0, e1, bs, dec, ctx, tokens, rows) in enumerate(marks):
        gap = e1.elapsed_time(marks[i + 1][0]) * 1e-3 if i + 1 < len(marks) else 0.0
        records.append((e0.elapsed_time(e1) * 1e-3, max(0.0, gap), bs, dec, ctx, tokens, rows))
    return total, records


def timeline_section(model_dir: str, kv_cache_dtype: str, copy_bw: float) -> list[str]:
    """copy_bw: the device's copy bandwidth (bytes/s): each bucket's floor is its KV and weight reads at it."""
    kv_bytes = KV_BYTES_PER_TOKEN // (2 if kv_cache_dtype == "fp8" else 1)
    # PROFILE_WORKLOAD="REQUESTS,MAX_NUM_SEQS,OUT_MIN,OUT_MAX": a streaming variant of the workload, where requests
    # wait for a free slot and are admitted into steps that also decode (as in a long job)
    requests, max_num_seqs, out_min, out_max = (int(v) for v in os.environ.get("PROFILE_WORKLOAD",
                                                                                "256,512,100,1024").split(","))
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=BATCHED_TOKENS, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    run_workload(engine, make_workload(1, (16, 16), (8, 8), seed=1))
    work = make_workload(requests, (100, 1024), (out_min, out_max), seed=0)
    if os.environ.get("PROFILE_REGEX"):  # structured outputs: this regex on every request
        import dataclasses

        from nvcli import StructuredOutputsParams

        so = StructuredOutputsParams(regex=os.environ["PROFILE_REGEX"])
        work = dataclasses.replace(work, params=[dataclasses.replace(sp, structured_outputs=so) for sp in work.params])
    if os.environ.get("PROFILE_LOGPROBS"):  # this many logprobs' alternatives on every request
        import dataclasses

        k = int(os.environ["PROFILE_LOGPROBS"])
        work = dataclasses.replace(work, params=[dataclasses.replace(sp, logprobs=k) for sp in work.params])
    out = []
    if os.environ.get("PROFILE_GC_FREEZE") == "1":  # A/B probe: the start-up heap out of the collector's way
        gc.collect()
        gc.freeze()
    for run in (1, 2):
        engine.reset_prefix_cache()  # run 2 would otherwise find run 1's prompts cached and skip most of its prefill
        s0 = engine.stats()
        with _run_counters(str(run)) as gc_pauses:
            total, records = _timed_run(engine, work, str(run))
        s1 = engine.stats()
        buckets = [(0, 0), (1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 512)]
        out.append(f"timeline ({kv_cache_dtype}, run {run}): {total:.2f} s, {len(records)} steps, "
                   f"{work.output_tokens / total:,.0f} output tok/s; host: schedule {s1.schedule_s - s0.schedule_s:.2f} s, "
                   f"wait+sample {s1.execute_s - s0.execute_s:.2f} s, postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s")
        for gen in (0, 1, 2):
            ps = [d for g, d in gc_pauses if g == gen]
            if ps:
                out.append(f"  gc generation {gen}: {len(ps)} collections, {1000 * sum(ps):.1f} ms in all, "
                           f"longest {1000 * max(ps):.1f} ms")
        out.append(f"  gc: {len(gc.get_objects())} tracked objects, {gc.get_freeze_count()} frozen")
        pre = [r for r in records if not r[3]]
        out.append(f"  steps carrying prefill: {len(pre)}, GPU {sum(r[0] for r in pre):.3f} s, "
                   f"idle after {sum(r[1] for r in pre):.3f} s")
        for lo, hi in buckets[1:]:  # steps carrying prompt tokens, by their one-token rows
            rs = [r for r in pre if lo <= r[6] <= hi]
            if rs:
                out.append(f"    with {lo:3d}-{hi:3d} one-token rows: {len(rs):4d} steps, "
                           f"{1000 * sum(r[0] for r in rs) / len(rs):6.3f} ms/step GPU + "
                           f"{1000 * sum(r[1] for r in rs) / len(rs):5.3f} idle, "
                           f"{sum(r[5] - r[6] for r in rs) / len(rs):7.0f} prompt tokens/step, "
                           f"{sum(r[4] for r in rs) / len(rs):8.0f} context tokens/step")
        out.append(f"  all steps: GPU {sum(r[0] for r in records):.3f} s, GPU idle between steps "
                   f"{sum(r[1] for r in records):.3f} s")
        for lo, hi in buckets:
            rs = [r for r in records if r[3] and lo <= r[2] <= hi]
            if rs:
                busy, idle = sum(r[0] for r in rs), sum(r[1] for r in rs)
                kv = sum(r[4] for r in rs) * kv_bytes / copy_bw
                floor = kv + len(rs) * WEIGHT_BYTES / copy_bw
                out.append(f"  decode batch {lo:3d}-{hi:3d}: {len(rs):5d} steps, GPU {busy:6.3f} s + idle {idle:5.3f} s "
                           f"({(busy + idle) / total:5.1%}), {1000 * busy / len(rs):6.3f} ms/step; KV reads {kv:.3f} s "
                           f"+ weights = floor {floor:.3f} s ({floor / (busy + idle):.0%}), GPU time beyond the KV "
                           f"reads {1000 * (busy - kv) / len(rs):.2f} ms/step")
        slow = sorted(records, key=lambda r: -(r[0] + r[1]))[:12]
        out.append("  slowest steps (GPU ms + idle ms / batch / decode-only): "
                   + ", ".join(f"{1000 * r[0]:.1f}+{1000 * r[1]:.1f}/{r[2]}/{int(r[3])}" for r in slow))
        out.append("  first 16 steps (GPU ms + idle ms / batch / decode-only): "
                   + " ".join(f"{1000 * r[0]:.2f}+{1000 * r[1]:.2f}/{r[2]}/{int(r[3])}" for r in records[:16]))
        out.append("  last 30 steps (GPU ms + idle ms / batch): "
                   + " ".join(f"{1000 * r[0]:.2f}+{1000 * r[1]:.2f}/{r[2]}" for r in records[-30:]))
    print("\n".join(out))
    llm.shutdown()
    return out


def _time_decode(kb, q, kc, vc, bt, sl, ks, vs, **kw) -> float:
    from nvcli.kernels.decode_attention import paged_decode_attention_triton

    return kb.bench(lambda: paged_decode_attention_triton(q, kc, vc, bt, sl, 128**-0.5, ks, vs, **kw), True)


def splits_section() -> list[str]:
    """Decode attention at the DESIGN workload's batches as they shrink (prompt lengths 100-1024 plus the step's
    generated tokens, graph-width tables, programs longest first as the engine launches them), at the split count
    choose_num_splits picks and at 2x / 4x it: does splitting the KV shorten the last wave's tail at 66-256 rows?"""
    import random

    import kernels as kb

    from nvcli.kernels.decode_attention import choose_num_splits

    out = []
    torch.manual_seed(0)
    rng = random.Random(0)
    bw = kb.copy_bandwidth("cuda", True, False)
    out.append(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    for rows, step in ((256, 60), (192, 250), (128, 500), (96, 650), (66, 780), (48, 850)):
        lens = [rng.randint(100, 1024) + step for _ in range(rows)]
        kc, vc, bt = kb.paged_kv(lens, 8, 128, 16, torch.bfloat16, "cuda", table_width=256)
        q = torch.randn(rows, 16, 128, device="cuda").to(torch.bfloat16)
        sl = kb.i32(lens, "cuda")
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        nbytes = 2 * sum(lens) * 8 * 128 * 2
        auto = choose_num_splits(rows, 8, 4096, 64, 132)
        cells = []
        for splits in (auto, 2 * auto, 4 * auto):
            kw = dict(num_splits=splits, order=order if splits == 1 else None)
            _time_decode(kb, q, kc, vc, bt, sl, None, None, **kw)  # compile, clocks
            t = min(_time_decode(kb, q, kc, vc, bt, sl, None, None, **kw) for _ in range(3))
            cells.append(f"{splits} splits {t * 1e6:.1f} us ({nbytes / t / bw:.0%})")
        line = f"bf16 B={rows} ctx {min(lens)}-{max(lens)}: " + ", ".join(cells)
        print(line, flush=True)
        out.append(line)
        del kc, vc
    return out + kernel_variant_resources()


def kernel_variant_resources() -> list[str]:
    """Registers and shared memory of each decode-attention variant this process compiled: they set how many
    programs an SM holds (4 at 128 registers and 4 warps), which the split rule's wave sizing assumes."""
    from nvcli.kernels.decode_attention import _decode_split_kernel

    out = []
    names = _decode_split_kernel.arg_names
    for cache in _decode_split_kernel.device_caches.values():
        for k in cache[0].values():
            consts = {names[i[0]]: v for i, v in getattr(k.src, "constants", {}).items() if isinstance(i, tuple)}
            flags = {n: consts.get(n) for n in ("DIRECT", "FUSED_REDUCE", "SPLITS_PAD", "ORDERED", "ROPE")}
            out.append(f"variant {flags}: {k.n_regs} registers, {k.n_spills} spills, {k.metadata.shared} B shared")
            print(out[-1], flush=True)
    return out


def sweep_section() -> list[str]:
    import kernels as kb

    from nvcli.kernels.decode_attention import choose_num_splits

    out = []
    torch.manual_seed(0)
    dev = "cuda"
    bw = kb.copy_bandwidth(dev, True, False)
    out.append(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    # the workload's shapes as its batch shrinks: big batches of short contexts, small batches of long ones
    cases = [("B=256 ctx=800", [800] * 256), ("B=128 ctx=1200", [1200] * 128), ("B=64 ctx=1400", [1400] * 64),
             ("B=32 ctx=1500", [1500] * 32), ("B=8 ctx=1600", [1600] * 8),
             ("B=256 ctx 100-2000", [100 + (1900 * i) // 255 for i in range(256)])]
    for fp8 in (False, True):
        for label, lens in cases:
            kc, vc, bt = kb.paged_kv(lens, 8, 128, 16, torch.bfloat16, dev, table_width=256)
            ks = vs = None
            elt = 2
            if fp8:
                kc, _ = kb.quantize(kc, 0.02)
                vc, _ = kb.quantize(vc, 0.02)
                ks, vs = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
                elt = 1
            q = torch.randn(len(lens), 16, 128, device=dev).to(torch.bfloat16)
            sl = kb.i32(lens, dev)
            nbytes = 2 * sum(lens) * 8 * 128 * elt
            configs = []
            for bn in (64, 128):
                auto_splits = choose_num_splits(len(lens), 8, 4096, bn, 132)
                for splits in sorted({auto_splits, 2 * auto_splits} if auto_splits > 1 or len(lens) < 128
                                     else {1}):
                    if fp8:  # the open question there: V dequantized per tile (fewer registers, no byte loads)
                        for st in (3, 4):
                            for v_tile in (False, True):
                                configs.append(dict(block_n=bn, num_warps=4, num_stages=st, num_splits=splits,
                                                    kvh_major=True, v_dequant_in_tile=v_tile))
                        continue
                    for w in (4, 8):
                        for st in (2, 3):
                            for kvh_major in (False, True):
                                configs.append(dict(block_n=bn, num_warps=w, num_stages=st, num_splits=splits,
                                                    kvh_major=kvh_major))
            _time_decode(kb, q, kc, vc, bt, sl, ks, vs)  # warm-up (compile, clocks)
            default = _time_decode(kb, q, kc, vc, bt, sl, ks, vs)
            unfused = _time_decode(kb, q, kc, vc, bt, sl, ks, vs, fused_reduce=False)
            results = []
            for cfg in configs:
                try:
                    results.append((_time_decode(kb, q, kc, vc, bt, sl, ks, vs, **cfg), cfg))
                except Exception as e:  # out of shared memory etc.
                    print(f"  {cfg}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            name = f"{'fp8' if fp8 else 'bf16'} {label}"
            line = (f"{name}: default {default * 1e6:.0f} us ({nbytes / default / bw:.0%} copy), reduce kernel "
                    f"{unfused * 1e6:.0f} us; best "
                    + ", ".join(f"{'/'.join(str(int(v)) for v in cfg.values())} {t * 1e6:.0f} us ({nbytes / t / bw:.0%})"
                                for t, cfg in results[:4]))
            print(line, flush=True)
            out.append(line)
            del kc, vc
    out.append("  (config = block_n/warps/stages/splits/kvh_major[/fp8 V dequantized per tile])")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="steps,timeline,sweep")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batches", default="1,32,128,256", help="batch sizes, each optionally :prompt_len (600)")
    args = ap.parse_args()
    model_dir = str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp())))
    lines: list[str] = []
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        if name == "steps":
            pairs = [tuple(int(v) for v in b.split(":")) if ":" in b else (int(b), 600) for b in args.batches.split(",")]
            lines += steps_section(model_dir, pairs, args.kv_cache_dtype)
        elif name == "timeline":
            import kernels as kb

            bw = kb.copy_bandwidth("cuda", True, False)
            lines.append(f"copy bandwidth {bw / 1e9:.0f} GB/s")
            lines += timeline_section(model_dir, args.kv_cache_dtype, bw)
        elif name == "prefill":
            lines += prefill_section(model_dir, args.kv_cache_dtype)
        elif name == "mixed":
            lines += mixed_section(model_dir, args.kv_cache_dtype)
        elif name == "sweep":
            lines += sweep_section()
        elif name == "splits":
            lines += splits_section()
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
